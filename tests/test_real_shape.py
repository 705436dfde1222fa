"""A model shaped like a real checkpoint — Qwen3 with tied embeddings, grouped-query attention,
the chat template Qwen3 ships (through the `renderers` qwen3 renderer, with reasoning and then
without), bf16 compute — through real meshes: warm start, all three channels,
FSDP2 over two ranks with a sharded DPO reference, RDMA weight sync, checkpoint, resume with
filesystem weight sync, and the exported model loaded back as a user would."""

from __future__ import annotations

import json

import pytest
import torch
from e2e import records, train
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.cli.main import main

pytestmark = pytest.mark.mesh

QWEN = [
    "--model.tiny.family", "qwen3", "--model.tiny.tie_embeddings", "true", "--model.tiny.num_heads", "4",
    "--model.tiny.num_kv_heads", "2", "--model.tiny.chat_template", "qwen3", "--model.renderer", "qwen3", "--model.dtype", "bfloat16",
    "--generator.max_new_tokens", "32", "--generator.temperature", "0.8", "--generator.samples_per_prompt", "4",
    "--trainer.warm_start_steps", "120", "--trainer.warm_start_batch_size", "8", "--trainer.warm_start_lr", "1e-2",
    "--topology.trainer.procs", "2", "--trainer.parallelism", "fsdp2", "--ckpt.interval", "2",
    "--trainer.mask_truncated_completions", "true",
]  # fmt: skip


def test_qwen_shaped_model_trains_resumes_and_exports(tmp_path, capsys):
    out = tmp_path / "run"
    first = train(out, *QWEN, "--max-steps", "4", "--generator.weight_sync", "rdma")
    assert first.returncode == 0, first.stderr[-3000:]
    # resumed without reasoning: the generation prompt prefills Qwen3's empty think block
    # (a change to the run's template settings: allowed explicitly, and recorded in config_changes.jsonl)
    resumed = train(out, *QWEN, "--max-steps", "6", "--generator.weight_sync", "filesystem", "--resume",
                    "--allow-config-change", "--model.chat_template_kwargs", '{"enable_thinking": false}')  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not list((out / "weights").iterdir())  # published files are removed with the generators

    metrics = records(out)
    assert [r["step"] for r in metrics] == list(range(6))
    for channel in ("loss/rl", "loss/replay", "loss/sdpo"):  # all three live on the warm-started policy
        assert any(r.get(channel, 0) != 0 for r in metrics), channel
    assert all(r["skipped_steps"] == 0 for r in metrics)
    assert all(0 <= r["rollouts/cut_off_masked"] <= r["rollouts/cut_off"] for r in metrics)  # left out of RL
    assert all(abs(r["unmasked_mismatch_kl"]) < 1e-2 for r in metrics if "unmasked_mismatch_kl" in r)

    checkpoint = out / "checkpoints" / "step_4"
    for folder in (checkpoint / "model", out / "final"):  # both load as an HF model directory
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert model.config.tie_word_embeddings and model.config.num_key_value_heads == 2
        assert "enable_thinking" in tokenizer.chat_template and "<think>" in tokenizer.get_vocab()
        assert (folder / "generation_config.json").exists()
    assert AutoModelForCausalLM.from_pretrained(checkpoint / "model").dtype == torch.float32  # master weights
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    assert final.dtype == torch.bfloat16
    assert json.loads((out / "final" / "config.json").read_text())["dtype"] == "bfloat16"

    # `meshrl export` in this process (its command function, exit code and messages as in a shell)
    assert main(["export", str(out), str(tmp_path / "step4"), "--step", "4"]) == 0
    step4 = AutoModelForCausalLM.from_pretrained(tmp_path / "step4")
    master = AutoModelForCausalLM.from_pretrained(checkpoint / "model")
    assert torch.equal(step4.lm_head.weight, master.lm_head.weight.to(torch.bfloat16))
    assert not torch.equal(step4.lm_head.weight, final.lm_head.weight)  # two more steps trained

    capsys.readouterr()
    assert main(["export", str(out), str(tmp_path / "x"), "--step", "3"]) == 1
    assert "no complete checkpoint for step 3 (present: 2, 4, 6)" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 1
    assert "not a run directory" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
