"""Routing replay: the sampler records each token's experts, the rollout carries them through packing
and micro-batching, and the trainer's policy and reference route every recorded token to them, with
gate weights from their own routers (`models/routing.py`)."""

from __future__ import annotations

import base64
import math
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshrl.configs import load_config
from meshrl.inference.hf_engine import HFEngine
from meshrl.loss_adapters.logprobs import sequence_token_logprobs
from meshrl.models.routing import RoutingRecorder, moe_routers
from meshrl.models.tiny import ensure_tiny
from meshrl.rollouts.batches import rl_shards
from meshrl.rollouts.episodes import Rollout
from meshrl.tasks.base import Prompt
from meshrl.trainer.activations import recomputing
from meshrl.trainer.core import TrainerCore
from tests.test_moe import MOE

PROMPTS = [list(range(5, 15)), list(range(20, 26)), list(range(40, 52))]


def _model(tmp_path, *args: str):
    config = load_config([*MOE, *args])
    return config, str(ensure_tiny(tmp_path / "model", config.model.tiny))


def _rollouts(engine: HFEngine, tool: list[int]) -> list[Rollout]:
    """Two-turn episodes: a sampled turn, a tool turn of `tool` ids, a second sampled turn, each turn's
    routing as the engine recorded it (the rollout keeps its last turn's, over the whole context)."""
    seqs = [engine.sequence(prompt, seed) for seed, prompt in enumerate(PROMPTS)]
    rollouts = [
        Rollout(Prompt(str(i), []), [], list(p), [False] * len(p), [0.0] * len(p), []) for i, p in enumerate(PROMPTS)
    ]
    for turn in range(2):
        batch = engine.batch()
        for seq, on in zip(seqs, engine.begin_turns(seqs, temperature=1.0, top_p=1.0, max_new_tokens=6)):
            if on:
                batch.add(seq)
        while len(batch):
            batch.step()
        for seq, rollout in zip(seqs, rollouts):
            done = seq.turn
            rollout.token_ids += done.completion_ids
            rollout.loss_mask += [True] * len(done.completion_ids)
            rollout.logprobs += done.logprobs
            rollout.versions += done.versions
            rollout.routing = done.routing
            if turn == 0:
                seq.extend(tool)
                rollout.token_ids += tool
                rollout.loss_mask += [False] * len(tool)
                rollout.logprobs += [0.0] * len(tool)
    return rollouts


def _own_routing(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    recorder = RoutingRecorder(moe_routers(model))
    with torch.no_grad():
        model(torch.tensor([ids]))
    return recorder.take(1, len(ids))[0]


def test_the_engine_records_each_positions_experts_across_turns(tmp_path):
    """The HF engine's record over a two-turn episode (prefill, decode, a tool turn prefilled onto the
    cache) is vLLM's layout: every position but the last, in uint8, and in float32 the experts a full
    forward over the whole episode chooses."""
    _, path = _model(tmp_path)
    engine = HFEngine.from_pretrained(path, record_routing=True)
    for rollout in _rollouts(engine, tool=[7, 8, 9, 10]):
        record = rollout.routing
        assert record.shape == (len(rollout.token_ids) - 1, 2, 2) and record.dtype == np.uint8
        full = _own_routing(engine.model, rollout.token_ids)[:-1]
        assert np.array_equal(np.sort(full, -1), np.sort(record, -1))
    assert HFEngine.from_pretrained(path).generate([PROMPTS[0]], temperature=1.0, top_p=1.0, max_new_tokens=3,
                                                    seed=0)[0].routing is None  # fmt: skip


def _forced_logprobs(model: torch.nn.Module, ids: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """Logprobs of a forward whose every MoE block is rewritten to send each token to `recorded`'s experts
    ((tokens, layers, k)), weighted by its router's softmax renormalised over them: routing replay as
    the method defines it, written out here apart from the trainer's hooks."""
    blocks = [layer.mlp for layer in model.model.layers]

    def forward(block, hidden, layer):
        rows, columns, width = hidden.shape
        flat = hidden.reshape(-1, width)
        probs = F.linear(flat, block.gate.weight).float().softmax(-1)
        experts = recorded[:, layer].long()
        weights = probs.gather(-1, experts)
        weights = weights / weights.sum(-1, keepdim=True)
        return block.experts(flat, experts, weights.to(flat.dtype)).reshape(rows, columns, width)

    for layer, block in enumerate(blocks):
        block.forward = types.MethodType(lambda self, h, layer=layer: forward(self, h, layer), block)
    try:
        with torch.no_grad():
            return sequence_token_logprobs(model, ids)
    finally:
        for block in blocks:
            del block.forward


def test_replayed_logprobs_are_a_forward_forced_to_the_recorded_experts_off_policy(tmp_path):
    """The trainer's weights moved on from the sampler's (routers perturbed, as several steps off
    policy): its own routing drifts from the record, its replayed logprobs are those of a forward
    forced to the recorded experts, and differ from its free routing's."""
    config, path = _model(tmp_path)
    engine = HFEngine.from_pretrained(path, record_routing=True)
    rollout = _rollouts(engine, tool=[7, 8, 9])[0]
    core = TrainerCore(config, path)
    torch.manual_seed(0)
    with torch.no_grad():
        for router in moe_routers(core.model):
            router.weight.add_(torch.randn_like(router.weight) * 0.5)
    ids = torch.tensor([rollout.token_ids])
    recorded = torch.from_numpy(rollout.routing)
    own = _own_routing(core.model, rollout.token_ids)[:-1]
    drift = (np.sort(own, -1) != np.sort(rollout.routing, -1)).any(-1).mean()
    assert drift > 0.2
    routed = torch.cat([recorded, recorded[-1:]])[None]  # the last position, never forwarded, left as it is
    with torch.no_grad():
        replayed = sequence_token_logprobs(core.model, ids, routed_experts=routed)
        free = sequence_token_logprobs(core.model, ids)
    forced = _forced_logprobs(core.model, ids, routed[0])
    torch.testing.assert_close(replayed, forced, rtol=0, atol=1e-5)
    assert (replayed - free).abs().max() > 1e-2


def _captured(model: torch.nn.Module) -> list[tuple[int, torch.Tensor, bool]]:
    """Every router call's (layer, experts used, in a recompute) from now on, after replay's hooks."""
    calls = []
    for layer, router in enumerate(moe_routers(model)):
        router.register_forward_hook(
            lambda module, inputs, out, layer=layer: calls.append((layer, out[2].detach().clone(), recomputing()))
        )
    return calls


@pytest.mark.parametrize("lora", [False, True])
def test_the_trainer_routes_as_recorded_through_packing_micro_batches_checkpointing_and_the_reference(tmp_path, lora):
    """Recorded rollouts packed by `rl_shards` (rows of several samples, pads, two micro-batches) train
    under full activation checkpointing with ref_kl's reference: every router call (the policy's
    forward, its recompute in backward, the reference's forward; LoRA's adapters-off reference too)
    uses the recorded experts at every recorded token. With the trainer's routers perturbed, the step
    reports how many recorded tokens its own routing would have sent elsewhere."""
    args = ["--loss.type", "ref_kl", "--trainer.activation_checkpointing", "full", "--trainer.micro_batch_tokens", "80"]
    if lora:
        args += ["--model.lora", '{"r": 4, "lora_alpha": 8}']
    config, path = _model(tmp_path, *args)
    engine = HFEngine.from_pretrained(path, record_routing=True)
    rollouts = _rollouts(engine, tool=[7, 8, 9])
    core = TrainerCore(config, path)
    assert core.routing_replay
    with torch.no_grad():
        for router in moe_routers(core.model):
            router.weight.add_(torch.randn_like(router.weight) * 0.5)
    shards = rl_shards(rollouts, [1.0, -1.0, 0.5], micro_batch_tokens=80, pad_id=0, world=1)
    batches = shards.shards[0]
    assert len(batches) == 2 and all("routed_experts" in b for b in batches)
    assert any(int((b["sample_index"] < 0).sum()) for b in batches)  # a row with pads
    calls = _captured(core.model)
    if not lora:
        calls_ref = _captured(core.ref_model)
    metrics = core.train_step([batches], [None], rl_tokens=shards.tokens)

    records = [b["routed_experts"].flatten(0, 1) for b in batches]
    recorded = torch.cat(records)
    known = (recorded < 4).all(-1).all(-1)
    assert known.float().mean() > 0.5
    assert any(c[2] for c in calls)  # the recompute ran, under the record too
    # Per micro-batch: LoRA's reference (the policy with its adapters off) runs on the policy's routers
    # before the policy's forward; a separate reference has its own and runs without grad (no recompute).
    forwards = 2 if lora else 1
    checks = [(calls, False, forwards), (calls, True, 1)] + ([] if lora else [(calls_ref, False, 1)])
    for captured, recompute, per_batch in checks:
        expected = [record for record in records for _ in range(per_batch)]
        for layer in range(2):
            used = [experts for i, experts, again in captured if i == layer and again == recompute]
            assert len(used) == len(expected)
            for experts, record in zip(used, expected):
                mine = (record < 4).all(-1).all(-1)
                want = record[:, layer].long()
                assert torch.equal(experts[mine].sort(-1).values, want[mine].sort(-1).values)
    assert 0.2 < metrics["moe/routing_drift"] <= 1.0
    assert metrics["moe/recorded_tokens"] == pytest.approx(float(known[(recorded_real(batches))].float().mean()))
    assert set(metrics) >= {"moe/routing_drift/layer_0", "moe/routing_drift/layer_1"}


def recorded_real(batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    return torch.cat([(b["sample_index"] >= 0).flatten() for b in batches])


def test_routing_replay_is_refused_where_it_cannot_run(tmp_path):
    """`trainer.routing_replay = true` on a dense model, and continuous batching asked to record."""
    from meshrl.inference.backends import make_engine

    dense = load_config(["--trainer.routing_replay", "true"])
    with pytest.raises(ValueError, match="trainer.routing_replay"):
        TrainerCore(dense, str(ensure_tiny(tmp_path / "dense", dense.model.tiny)))
    _, path = _model(tmp_path)
    with pytest.raises(ValueError, match="hf_batching = 'continuous'"):
        make_engine("hf", path, "float32", [], hf_batching="continuous", record_routing=True)
    assert make_engine("hf", path, "float32", [], record_routing=True).recorder is not None
    off = load_config([*MOE, "--trainer.routing_replay", "false"])
    assert not TrainerCore(off, path).routing_replay


def test_sdpo_student_rows_replay_the_episodes_routing_and_teacher_rows_route_themselves(tmp_path):
    """An SDPO site's student row (the episode's prefix) carries the episode's routing and its forward
    takes it; the hinted teacher row has none, and its routers choose for themselves."""
    from tests.test_trainer import sdpo_batch

    config, path = _model(tmp_path, "--loss.sdpo.weight", "0.5")
    core = TrainerCore(config, path)
    batch = sdpo_batch(3, core.model.config.vocab_size, [3, 2])
    rows, width = batch["sdpo_student_input_ids"].shape
    record = torch.randint(0, 4, (rows, width, 2, 2), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    record[..., 1] = (record[..., 0] + 1) % 4  # two distinct experts a token
    record[0, :2] = 255  # positions without a record route freely
    calls = _captured(core.model)
    core.train_step([[]], [{**batch, "sdpo_student_routed_experts": record}], rl_tokens=0)
    flat, known = record.flatten(0, 1).long(), (record.flatten(0, 1) < 4).all(-1).all(-1)
    for layer in range(2):
        student, teacher = [experts for i, experts, _ in calls if i == layer]
        want = flat[:, layer].sort(-1).values
        assert torch.equal(student[known].sort(-1).values, want[known])
        assert not torch.equal(teacher[known].sort(-1).values, want[known])


def test_an_outside_workers_routing_is_scored_under_its_claim_and_held_to_the_router(tmp_path):
    """A worker's episodes carry their routed experts, which the trainer's forward will take. An honest
    claim is accepted and trained on as sent. A forger that picks other experts, and sends the logprobs
    those experts give (so the logprob check alone passes), is rejected for its routing; so are claims
    that are not a routing of this model (an expert index out of range, a ragged length, not base64)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from meshrl.inference.weights import save_weights_file
    from meshrl.ingress.client import to_episode
    from meshrl.ingress.verify import Rejected, Scorer, Verifier
    from meshrl.models.routing import encode_record, force_routing
    from meshrl.rollouts.episodes import EpisodeFormat
    from meshrl.rollouts.scheduler import EpisodeScheduler, GroupRequest, Sampling
    from meshrl.tasks.base import make_task
    from tests.test_ingress import MAX_NEW, TASK

    _, path = _model(tmp_path)
    engine = HFEngine.from_pretrained(path, record_routing=True)
    weights = tmp_path / "v0.safetensors"
    save_weights_file(engine.model.state_dict(), weights)
    episodes = EpisodeFormat(AutoTokenizer.from_pretrained(path), make_task(TASK))
    (prompt,) = make_task(TASK).sample_prompts(__import__("random").Random(0), 1)
    scheduler = EpisodeScheduler(engine, episodes, Sampling(1.0, 1.0, MAX_NEW), max_episodes=4, max_tokens=4096)
    scheduler.submit([GroupRequest("g", prompt, 2, 0, 0)])
    groups = []
    while not groups:
        groups = scheduler.take(1.0)
    scheduler.close()
    rollouts = groups[0].rollouts
    assert all(r.routing is not None and len(r.routing) >= len(r.token_ids) - 2 for r in rollouts)
    verifier = Verifier(episodes, Scorer(path, "float32", 1.0, lambda v: weights if v == 0 else None),
                        max_new_tokens=MAX_NEW, fraction=1.0, tolerance=0.05, routing_tolerance=0.1)  # fmt: skip
    leased = Prompt(prompt.prompt_id, prompt.messages, None, prompt.info)

    rebuilt = verifier.check_group(leased, 2, 0, 0, [to_episode(r) for r in rollouts])
    for mine, theirs in zip(rebuilt, rollouts):
        assert np.array_equal(mine.routing, theirs.routing)

    forger = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    force_routing(forger)
    forged = []
    for rollout in rollouts:  # each token's two least likely experts, and the logprobs they give
        routing = (rollout.routing.astype(np.int64) + 2) % 4
        routed = torch.from_numpy(np.concatenate([routing, routing[-1:]]))[None]
        with torch.no_grad():
            scored = sequence_token_logprobs(forger, torch.tensor([rollout.token_ids]), routed_experts=routed)[0]
        episode = to_episode(rollout)
        episode.routing = encode_record(routing.astype(np.uint8))
        episode.logprobs = [float(lp) if m else 0.0 for lp, m in zip(scored, rollout.loss_mask)]
        forged.append(episode)
    with pytest.raises(Rejected, match="routing_mismatch"):
        verifier.check_group(leased, 2, 0, 0, forged)

    honest = to_episode(rollouts[0])
    out_of_range = rollouts[0].routing.copy()
    out_of_range[3, 0, 0] = 9
    ragged = base64.b64encode(rollouts[0].routing.tobytes() + b"\x01").decode()
    too_long = encode_record(np.concatenate([rollouts[0].routing] * 2))
    for claim in (encode_record(out_of_range), ragged, too_long, "not base64!"):
        with pytest.raises(Rejected, match="bad_routing"):
            verifier.check_group(leased, 2, 0, 0, [honest.model_copy(update={"routing": claim}), honest])


@pytest.mark.mesh  # a two-proc Monarch mesh
def test_fsdp2_ranks_with_lora_and_a_reference_route_every_recorded_token_as_recorded(tmp_path):
    """Two FSDP2 ranks, LoRA adapters and ref_kl's reference: the routers route a token by its id's
    parity (even ids to experts 0-1, odd to 2-3), and every recorded token's record says 0-1. Rank 0's
    even tokens agree with the record, rank 1's odd ones all drift. Under replay every token of both
    ranks, in every layer, is on experts 0-1 (load 2 and 0, where free routing's is even), and half the
    recorded tokens drifted. Rank 1's packed row ends in pads, and rank 1 runs a spare pass over rank
    0's batch at weight 0: neither counts."""
    from monarch.actor import this_host
    from monarch.spmd import setup_torch_elastic_env
    from transformers import AutoModelForCausalLM

    from meshrl.actors.trainer import TrainerActor
    from tests.test_moe import _parity_batch, _route_by_parity

    args = [*MOE, "--trainer.parallelism", "fsdp2", "--topology.trainer.procs", "2", "--loss.type", "ref_kl",
            "--model.lora", '{"r": 4, "lora_alpha": 8}']  # fmt: skip
    model_path = str(ensure_tiny(tmp_path / "model", load_config(args).model.tiny))
    _route_by_parity(model_path)
    config = load_config([*args, "--model.path", model_path])
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)

    def recorded(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        record = torch.zeros((*batch["input_ids"].shape, 2, 2), dtype=torch.uint8)
        record[..., 1] = 1
        return {**batch, "routed_experts": record}

    shards = [[recorded(_parity_batch(model, 0, [17], 1)), recorded(_parity_batch(model, 0, [17], 2))],
              [recorded(_parity_batch(model, 1, [20, 14], 3))]]  # fmt: skip
    rl_tokens = sum(int(b["loss_mask"].sum()) for shard in shards for b in shard)
    procs = this_host().spawn_procs(per_host={"procs": 2})
    try:
        setup_torch_elastic_env(procs)
        trainers = procs.spawn("trainer", TrainerActor, config, model_path)
        trainers.setup.call().get()
        got = list(trainers.train_step.call(shards, [None, None], rl_tokens).get().values())
    finally:
        procs.stop().get()
    for metrics in got:
        assert (metrics["moe/expert_load_max"], metrics["moe/expert_load_min"]) == (2.0, 0.0)
        assert metrics["moe/routing_drift"] == 0.5 and metrics["moe/recorded_tokens"] == 1.0
        assert metrics["moe/routing_drift/layer_0"] == metrics["moe/routing_drift/layer_1"] == 0.5
        assert math.isfinite(metrics["loss/rl"])
