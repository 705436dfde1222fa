"""A Qwen3-MoE-shaped tiny model (`model.tiny.family = "qwen3_moe"`): it trains with its routers'
statistics logged, checkpoints and resumes exactly, its sampler and trainer agree token by token,
and it runs through the meshes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from monarch.actor import this_host
from monarch.spmd import setup_torch_elastic_env
from transformers import AutoModelForCausalLM

from meshrl.actors.trainer import TrainerActor
from meshrl.configs import load_config
from meshrl.inference.hf_engine import HFEngine
from meshrl.loss_adapters.logprobs import sequence_token_logprobs
from meshrl.models.tiny import ensure_tiny
from meshrl.rollouts.batches import rl_shards
from meshrl.rollouts.episodes import Rollout
from meshrl.rollouts.packing import Encoded, pack_rows
from meshrl.tasks.base import Prompt
from meshrl.trainer.core import TrainerCore
from tests.e2e import records, train
from tests.test_trainer import rl_batch, sdpo_batch

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


def _packed_rl_batch(pad_id: int) -> dict[str, torch.Tensor]:
    """Two rollouts of 20 and 14 tokens packed by `rl_shards` into rows 20 wide: the second row
    ends in 6 pads."""
    rollouts = [
        Rollout(Prompt(f"p{n}", []), [], list(range(10, 10 + n)), [False] * 8 + [True] * (n - 8), [0.0] * n, [0],
                reward=reward)
        for n, reward in ((20, 1.0), (14, 0.0))
    ]  # fmt: skip
    ((batch,),) = rl_shards(rollouts, [0.5, -0.5], micro_batch_tokens=64, pad_id=pad_id, world=1).shards
    assert batch["input_ids"].shape == (2, 20) and int((batch["sample_index"] < 0).sum()) == 6
    return batch


def test_the_router_figures_and_balance_loss_are_over_the_policys_own_tokens(tmp_path):
    """The moe/ figures count the RL pass's real tokens alone: not its pads, not the reference's
    forward (run here through the policy's own routers, as LoRA's adapters-off reference is), not
    SDPO's student and teacher forwards. They and the load-balancing loss are what the model's own
    router logits give over those tokens."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    config = load_config([*MOE, "--loss.type", "ref_kl", "--loss.sdpo.weight", "0.2",
                          "--trainer.router_aux_loss_coef", "0.1"])  # fmt: skip
    path = str(ensure_tiny(tmp_path / "model", config.model.tiny))
    core = TrainerCore(config, path)
    core.ref_call = core.call
    batch = _packed_rl_batch(pad_id=3)
    real = batch["sample_index"] >= 0
    with torch.no_grad():
        logits = core.model(batch["input_ids"], position_ids=batch["position_ids"], output_router_logits=True)
    logits = [layer[real.flatten()] for layer in logits.router_logits]
    chosen = [layer.topk(2, dim=-1).indices for layer in logits]
    counts = torch.stack([torch.bincount(c.flatten(), minlength=4) for c in chosen]).double()
    load = counts / counts.mean(-1, keepdim=True)
    probs = logits[0].softmax(-1)
    entropy = float(-(probs * probs.log()).sum(-1).mean())

    counted = []
    take = core.router.take
    core.router.take = lambda *args: counted.append(core.router.tokens) or take(*args)
    aux = [sdpo_batch(7, core.model.config.vocab_size, [3, 2])]
    metrics = core.train_step([[batch]], aux, rl_tokens=int(batch["loss_mask"].sum()))
    assert counted[-1] == int(real.sum()) == 34
    assert metrics["moe/expert_load_max"] == pytest.approx(float(load.max()))
    assert metrics["moe/expert_load_min"] == pytest.approx(float(load.min()))
    assert metrics["moe/router_entropy"] == pytest.approx(entropy, rel=1e-5)
    balance = load_balancing_loss_func(tuple(logits), 4, 2)  # the real tokens' logits alone
    assert metrics["moe/aux_loss"] == pytest.approx(float(balance), rel=1e-5)


def _route_by_parity(path: str) -> None:
    """Rewrite the model at `path` so every layer routes a token by its id's parity alone: even ids
    to experts 0 and 1, odd ids to 2 and 3 (an embedding component that dwarfs the rest of the
    residual stream, the only one the routers read)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed[:, 0] = torch.where(torch.arange(len(embed)) % 2 == 0, 10.0, -10.0)
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()
            layer.mlp.gate.weight[:, 0] = torch.tensor([10.0, 10.0, -10.0, -10.0])
    model.save_pretrained(path)


def _parity_batch(model: torch.nn.Module, parity: int, lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """One packed RL micro-batch of samples of even (0) or odd (1) ids, on-policy; a row shorter than
    the longest sample ends in pads (id 0, even), −1 in its `sample_index`."""
    g = torch.Generator().manual_seed(seed)
    rows = [Encoded((2 * torch.randint(2, 100, (n,), generator=g) + parity).numpy(), np.arange(n) >= n // 2)
            for n in lengths]  # fmt: skip
    batch = pack_rows(rows, [(-1.0) ** i for i in range(len(rows))], max(lengths), pad_id=0)
    with torch.no_grad():
        logprobs = sequence_token_logprobs(model, batch["input_ids"], position_ids=batch["position_ids"])
    return {**batch, "inference_logprobs": logprobs * batch["loss_mask"]}


@pytest.mark.mesh  # a two-proc Monarch mesh
def test_two_ranks_on_disjoint_experts_report_the_even_load_they_share(tmp_path):
    """The moe/ figures come from the expert counts summed over the ranks. Rank 0 routes every
    token to experts 0-1, rank 1 to 2-3, 34 real tokens each: each rank alone is all on half its
    experts (load 2 and 0), together they are even (1 and 1). Rank 1's packed row ends in pads, and
    under FSDP2 it runs a spare pass over rank 0's first batch at weight 0: both would go to
    experts 0-1 if they were counted."""
    args = [*MOE, "--trainer.parallelism", "fsdp2", "--topology.trainer.procs", "2"]
    model_path = str(ensure_tiny(tmp_path / "model", load_config(args).model.tiny))
    _route_by_parity(model_path)
    config = load_config([*args, "--model.path", model_path])
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    shards = [[_parity_batch(model, 0, [17], 1), _parity_batch(model, 0, [17], 2)],
              [_parity_batch(model, 1, [20, 14], 3)]]  # fmt: skip
    rl_tokens = sum(int(b["loss_mask"].sum()) for shard in shards for b in shard)
    alone = TrainerCore(config, model_path).train_step([shards[0]], [None], rl_tokens)
    assert (alone["moe/expert_load_max"], alone["moe/expert_load_min"]) == (2.0, 0.0)

    procs = this_host().spawn_procs(per_host={"procs": 2})
    try:
        setup_torch_elastic_env(procs)
        trainers = procs.spawn("trainer", TrainerActor, config, model_path)
        trainers.setup.call().get()
        got = list(trainers.train_step.call(shards, [None, None], rl_tokens).get().values())
    finally:
        procs.stop().get()
    for metrics in got:
        assert (metrics["moe/expert_load_max"], metrics["moe/expert_load_min"]) == (1.0, 1.0)
        assert metrics["moe/router_entropy"] == pytest.approx(math.log(2), abs=1e-6)  # two experts tie


def test_the_load_balancing_loss_is_transformers_and_trains_a_skewed_router(tmp_path):
    """`trainer.router_aux_loss_coef`: the RL pass adds coef × the load-balancing loss, the very
    value transformers' Qwen3-MoE computes (`output_router_logits`). With advantages 0 it alone
    trains routers skewed onto one expert, and the loss falls to what an even load gives (top-k,
    2). A dense model refuses the key."""
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
    # the teachers' pairs arrive at step 2; the load-balancing loss rides along. ref_kl trains every
    # rollout, tied groups too, so every step has RL rows, whose tokens the routers' figures count.
    run = train(out, *MOE[:-2], "--max-steps", "3", "--ckpt.interval", "3", "--trainer.router_aux_loss_coef", "0.01",
                "--loss.type", "ref_kl")  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = records(out)
    assert len(rows) == 3 and all(1.0 <= r["moe/expert_load_max"] <= 4.0 for r in rows)
    assert all(r["moe/aux_loss"] >= 2.0 - 1e-4 for r in rows)  # top-k 2: an even load
    assert (out / "final" / "config.json").is_file() and '"qwen3_moe"' in (out / "final" / "config.json").read_text()
