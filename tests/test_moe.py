"""A Qwen3-MoE-shaped tiny model (`model.tiny.family = "qwen3_moe"`): it trains with its routers'
statistics logged, checkpoints and resumes exactly, its sampler and trainer agree token by token,
and it runs through the meshes."""

from __future__ import annotations

import math

import torch

from meshrl.configs import load_config
from meshrl.inference.hf_engine import HFEngine
from meshrl.loss_adapters.logprobs import sequence_token_logprobs
from meshrl.models.tiny import ensure_tiny
from meshrl.trainer.core import TrainerCore
from tests.e2e import records, train
from tests.test_trainer import rl_batch

MOE = ["--model.tiny.family", "qwen3_moe", "--model.tiny.num_experts", "4", "--model.tiny.experts_per_token", "2",
       "--model.tiny.hidden_size", "32", "--model.tiny.num_heads", "4", "--model.tiny.num_kv_heads", "2",
       "--model.tiny.vocab_size", "256", "--trainer.lr", "1e-2"]  # fmt: skip


def test_the_moe_model_trains_logs_its_routers_and_resumes_exactly(tmp_path):
    config = load_config(MOE)
    path = str(ensure_tiny(tmp_path / "model", config.model.tiny))
    core = TrainerCore(config, path)
    mlp = core.model.model.layers[0].mlp
    assert mlp.gate.num_experts == 4 and mlp.gate.top_k == 2 and not hasattr(mlp, "shared_expert")
    metrics = core.train_step([[rl_batch(core.model, 0)]], [None], rl_tokens=10)
    assert 1.0 <= metrics["moe/expert_load_max"] <= 4.0 and 0.0 <= metrics["moe/expert_load_min"] <= 1.0
    assert 0.0 < metrics["moe/router_entropy"] <= math.log(4) + 1e-6
    core.save(tmp_path / "ckpt")
    resumed = TrainerCore(config, path)
    resumed.load(tmp_path / "ckpt")
    for one in (core, resumed):
        one.train_step([[rl_batch(one.model, 1)]], [None], rl_tokens=10)
    for (name, a), b in zip(core.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_the_load_balancing_loss_is_transformers_and_trains_a_skewed_router(tmp_path):
    """`trainer.router_aux_loss_coef`: the RL pass adds coef × the load-balancing loss, the very
    value transformers' Qwen3-MoE computes (`output_router_logits`). With advantages 0 it alone
    trains routers skewed onto one expert, and the loss falls to what an even load gives (top-k,
    2). A dense model refuses the key."""
    import pytest

    config = load_config([*MOE, "--trainer.router_aux_loss_coef", "0.5", "--trainer.lr", "3e-2"])
    path = str(ensure_tiny(tmp_path / "model", config.model.tiny))
    core = TrainerCore(config, path)
    with torch.no_grad():
        for layer in core.model.model.layers:  # every router sends most tokens to expert 0
            layer.mlp.gate.weight[0] += 2 * layer.mlp.gate.weight[1:].abs().max()
    batch = rl_batch(core.model, 0)
    tokens = float(batch["loss_mask"].sum())
    loss, metrics, _ = core._loss(batch, tokens)
    with torch.no_grad():
        expected = core.model(batch["input_ids"], output_router_logits=True).aux_loss
    assert metrics["moe/aux_loss"] == pytest.approx(float(expected), rel=1e-6)
    plain = TrainerCore(load_config(MOE), path)
    plain.model.load_state_dict(core.model.state_dict())
    without, _, _ = plain._loss(batch, tokens)
    assert float(loss - without) == pytest.approx(0.5 * float(expected), rel=1e-5)

    still = {**batch, "advantages": torch.zeros_like(batch["advantages"])}
    first = core.train_step([[still]], [None], rl_tokens=int(tokens))
    for _ in range(30):
        last = core.train_step([[still]], [None], rl_tokens=int(tokens))
    assert first["moe/expert_load_max"] > 1.5  # skewed: top-2 of 4 caps an expert at 2, even is 1
    assert first["moe/aux_loss"] > 2.02 and last["moe/aux_loss"] == pytest.approx(2.0, abs=1e-3)
    assert last["loss/total"] == pytest.approx(0.5 * last["moe/aux_loss"], rel=1e-3, abs=1e-6)

    dense = load_config(["--trainer.router_aux_loss_coef", "0.5"])
    with pytest.raises(ValueError, match="trainer.router_aux_loss_coef"):
        TrainerCore(dense, str(ensure_tiny(tmp_path / "dense", dense.model.tiny)))


def test_the_sampler_and_the_trainer_route_alike(tmp_path):
    """The R3 problem: a sampler whose routing differs from the trainer's scores other experts. In
    float32 the HF engine's incremental decoding and the trainer's full forward agree token by token."""
    config = load_config(MOE)
    path = str(ensure_tiny(tmp_path / "model", config.model.tiny))
    engine = HFEngine.from_pretrained(path)
    prompts = [list(range(5, 15)), list(range(20, 26))]
    turns = engine.generate(prompts, temperature=1.0, top_p=1.0, max_new_tokens=24, seed=0)
    for prompt, turn in zip(prompts, turns):
        ids = torch.tensor([prompt + turn.completion_ids])
        with torch.no_grad():
            scored = sequence_token_logprobs(engine.model, ids)[0, len(prompt) :]
        sampled = torch.tensor(turn.logprobs)
        diff = scored - sampled
        assert diff.abs().max() < 1e-4 and float((diff.exp() - 1 - diff).mean()) < 1e-8


def test_the_moe_model_runs_through_the_meshes_and_exports(tmp_path):
    out = tmp_path / "run"
    # the teachers' pairs arrive at step 2; the load-balancing loss rides along
    run = train(out, *MOE[:-2], "--max-steps", "3", "--ckpt.interval", "3", "--trainer.router_aux_loss_coef", "0.01")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = records(out)
    routed = [r for r in rows if "moe/expert_load_max" in r]  # a step whose trainer ran a forward
    assert len(rows) == 3 and routed and all(1.0 <= r["moe/expert_load_max"] <= 4.0 for r in routed)
    assert all(r["moe/aux_loss"] >= 2.0 - 1e-4 for r in rows if "loss/rl" in r)  # top-k 2: an even load
    assert (out / "final" / "config.json").is_file() and '"qwen3_moe"' in (out / "final" / "config.json").read_text()
