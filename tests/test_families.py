"""Every supported model family, built locally in the shapes real checkpoints have (tied
embeddings, grouped-query attention): the trainer's chunked logprobs are the model's own
tempered log-softmax, and a policy identical to the sampler scores its samples identically."""

from __future__ import annotations

import pytest
import torch
import transformers

from meshrl.configs import load_config
from meshrl.inference.backends import make_engine
from meshrl.loss_adapters.logprobs import sequence_token_logprobs
from meshrl.models.tiny import FAMILIES, ensure_tiny
from meshrl.trainer.core import TrainerCore

SHAPE = ["--model.tiny.hidden_size", "32", "--model.tiny.num_layers", "2", "--model.tiny.num_heads", "4",
         "--model.tiny.num_kv_heads", "2", "--model.tiny.vocab_size", "256", "--model.tiny.tie_embeddings", "true"]  # fmt: skip


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request, tmp_path_factory) -> tuple[list[str], str]:
    args = [*SHAPE, "--model.tiny.family", request.param]
    return args, str(ensure_tiny(tmp_path_factory.mktemp(request.param), load_config(args).model.tiny))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_the_models_tempered_log_softmax(family_model, temperature):
    _, path = family_model
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = sequence_token_logprobs(model, ids, chunk_size=7, temperature=temperature)
        logits = model(ids).logits[:, :-1].float() / temperature
    expected = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(got[:, 1:], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batching", ["rows", "continuous"])
def test_trainer_scores_samples_at_the_sampling_temperature(family_model, batching):
    """Synchronous step 0: the policy is the behaviour policy, so the mismatch KL is float noise, with
    either HF engine (its own loop; transformers' continuous batching). Scored at temperature 1
    instead, the same samples show the bias the issue measured."""
    args, path = family_model
    engine = make_engine("hf", path, "float32", [], hf_batching=batching)
    prompts = [[5, 9, 17, 33], [40, 41, 42]]
    completions = engine.generate(prompts, temperature=0.7, top_p=1.0, max_new_tokens=24, seed=1)
    engine.close()
    length = max(len(p) + len(c.completion_ids) for p, c in zip(prompts, completions))
    batch = {k: torch.zeros(len(prompts), length) for k in ("inference_logprobs", "advantages")}
    batch["input_ids"] = torch.zeros(len(prompts), length, dtype=torch.long)
    batch["loss_mask"] = torch.zeros(len(prompts), length, dtype=torch.bool)
    batch["attention_mask"] = torch.zeros(len(prompts), length, dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        ids = prompt + list(completion.completion_ids)
        sampled = slice(len(prompt), len(ids))
        batch["input_ids"][row, : len(ids)] = torch.tensor(ids)
        batch["attention_mask"][row, : len(ids)] = 1
        batch["loss_mask"][row, sampled] = True
        batch["inference_logprobs"][row, sampled] = torch.tensor(completion.logprobs)
        batch["advantages"][row, sampled] = 1.0 - 2 * row
    tokens = int(batch["loss_mask"].sum())

    def mismatch(temperature: float) -> float:
        core = TrainerCore(load_config([*args, "--generator.temperature", str(temperature)]), path)
        return core.train_step([[batch]], [None], tokens)["unmasked_mismatch_kl"]

    assert mismatch(0.7) < 1e-6
    assert mismatch(1.0) > 1e-4


@pytest.mark.parametrize(
    ("config_class", "attribute"),
    [("Gemma2Config", "final_logit_softcapping"), ("CohereConfig", "logit_scale")],
)
def test_families_that_transform_their_logits_are_refused_by_name(config_class, attribute):
    config = getattr(transformers, config_class)(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=f"{config.model_type} models transform their logits \\({attribute}"):
        sequence_token_logprobs(model, torch.tensor([[1, 2, 3]]))
