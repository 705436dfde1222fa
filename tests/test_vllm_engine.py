"""VLLMEngine: its request/response mapping on data shaped like vLLM's outputs, then the real engine
(vLLM's CPU build, eager) on SmolLM2-135M-Instruct and on a tiny Qwen3 under its real template. A
run through the meshes with it, and its export served, are in tests/test_gguf.py (the SmolLM2
preset samples with vLLM).

The real-engine tests share one engine and run in this file's order: the last one breaks it on
purpose (and checks that an engine started after it in the same process is sound)."""

from __future__ import annotations

import logging
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from meshrl.configs import load_config
from meshrl.configs.schema import TinyModelConfig
from meshrl.inference.completion import Completion, request_seeds
from meshrl.inference.vllm_engine import (
    EngineBroken,
    ExpectedReloadWarnings,
    VLLMEngine,
    add_output,
    kv_bytes_per_token,
    moe_layers,
    nothing_to_load,
    to_prompt_inputs,
    to_sampling_kwargs,
)
from meshrl.ingress.worker import RolloutWorker
from meshrl.loss_adapters.logprobs import sequence_token_logprobs
from meshrl.models.tiny import ensure_tiny
from meshrl.rollouts.episodes import EpisodeFormat
from tests.test_chat_families import FAMILIES, TASK, family_tokenizer, memorised, sampled_episode, scripted
from tests.test_ingress import make_harness, worked_offers

PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]


# Shapes of vllm.logprobs.Logprob, vllm.outputs.CompletionOutput and vllm.outputs.RequestOutput (fields we read).
@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    routed_experts: np.ndarray | None = None  # [seq_len, layer_num, topk], on a finished request that asked


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


def request_output(prompt, tokens, logprobs, finish_reason="stop", per_position=None) -> RequestOutput:
    positions = per_position or [{token: Logprob(lp, rank=1)} for token, lp in zip(tokens, logprobs)]
    sample = CompletionOutput(0, "", tokens, sum(logprobs), positions, finish_reason, None)
    return RequestOutput("0", prompt, [sample])


def complete(prompt: list[int], output: RequestOutput, version: int = 0) -> Completion:
    """A turn from one finished output."""
    turn = Completion(prompt, [], [], "length")
    assert add_output(turn, output, version)
    return turn


def test_vllms_routed_experts_become_the_turns_routing_checked():
    """A request that asked for routed experts (a mixture of experts under routing replay) returns them
    when it finishes, one row per position but the last (vLLM's GPU model runner; its CPU build cannot):
    they become the turn's routing in uint8. A record of another length, or an index that is no expert,
    is refused, not trained on."""
    prompt, tokens = [1, 2, 3, 4], [5, 6, 7]
    routed = np.arange(6 * 3 * 2).reshape(6, 3, 2).astype(np.int32) % 8
    output = request_output(prompt, tokens, [-0.5, -0.25, -1.0])
    output.outputs[0].routed_experts = routed
    turn = Completion(prompt, [], [], "length")
    assert add_output(turn, output, 0, experts=(3, 2, 8))
    assert turn.routing.dtype == np.uint8 and np.array_equal(turn.routing, routed)
    assert complete(prompt, output).routing is None  # not asked: nothing recorded
    for bad in (routed[:-1], routed + 8):
        output.outputs[0].routed_experts = bad
        with pytest.raises(ValueError, match="vLLM's routed_experts"):
            add_output(Completion(prompt, [], [], "length"), output, 0, experts=(3, 2, 8))
    qwen3_moe = {"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert moe_layers(qwen3_moe) == 2 and moe_layers({"num_hidden_layers": 4}) == 4


def test_importing_the_module_does_not_import_vllm():
    # A fresh interpreter, so other tests that start vLLM cannot have imported it already.
    check = "import sys, meshrl.inference.vllm_engine; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], check=True)


def test_sampling_kwargs_ask_for_one_sample_with_its_logprob_and_no_text():
    kwargs = to_sampling_kwargs(temperature=0.7, top_p=0.9, max_new_tokens=32, stop_token_ids=[5, 9], seed=11)
    assert kwargs == {
        "n": 1,
        "temperature": 0.7,
        "top_p": 0.9,
        "max_tokens": 32,
        "stop_token_ids": [5, 9],
        "logprobs": 0,
        "seed": 11,
        "detokenize": False,
    }
    assert (
        to_sampling_kwargs(temperature=0.0, top_p=1.0, max_new_tokens=1, stop_token_ids=None, seed=None)[
            "stop_token_ids"
        ]
        == []
    )


def test_request_seeds_are_reproducible_and_distinct_for_duplicated_prompts():
    assert request_seeds(None, 3) == [None, None, None]
    seeds = request_seeds(7, 8)
    assert seeds == request_seeds(7, 8)
    assert len(set(seeds)) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert seeds != request_seeds(8, 8)


def test_prompt_inputs_are_token_prompts_salted_by_policy_version():
    prompts = [[1, 2, 3], [4]]
    inputs = to_prompt_inputs(prompts, version=3)
    assert inputs == [{"prompt_token_ids": [1, 2, 3], "cache_salt": "policy-3"},
                      {"prompt_token_ids": [4], "cache_salt": "policy-3"}]  # fmt: skip
    assert inputs[0]["prompt_token_ids"] is not prompts[0]
    # the same ids under another version share no prefix-cache blocks with these
    assert {i["cache_salt"] for i in to_prompt_inputs(prompts, version=4)}.isdisjoint({"policy-3"})


def test_a_stopped_request_becomes_a_completion_ending_in_its_stop_token():
    out = complete([1, 2], request_output([1, 2], [7, 8, 3], [-0.5, -1.25, -0.01]))
    expected = Completion([1, 2], [7, 8, 3], [-0.5, -1.25, -0.01], finish_reason="stop", versions=[0, 0, 0])
    assert out == expected


def test_delta_outputs_accumulate_and_each_token_keeps_the_version_that_sampled_it():
    turn = Completion([1], [], [], "length")
    first = request_output([1], [7, 8], [-0.5, -1.0])
    first.finished = False
    assert not add_output(turn, first, version=3)
    later = request_output(None, [9], [-0.2], finish_reason="length")
    assert add_output(turn, later, version=4)  # the weights changed between two engine steps
    assert turn == Completion([1], [7, 8, 9], [-0.5, -1.0, -0.2], "length", versions=[3, 3, 4])


def test_the_sampled_tokens_logprob_is_read_when_other_tokens_are_listed():
    # With logprobs=1 vLLM also lists the top token; only the sampled one's logprob counts.
    positions = [{7: Logprob(-2.0, rank=3), 4: Logprob(-0.1, rank=1)}, {9: Logprob(-0.3, rank=1)}]
    out = complete([1], request_output([1], [7, 9], [-2.0, -0.3], "length", positions))
    assert out.logprobs == [-2.0, -0.3] and out.finish_reason == "length"


def test_outputs_that_break_the_contract_are_refused():
    with pytest.raises(ValueError, match="no logprob"):
        complete([1], request_output([1], [7, 8], [-0.5], per_position=[{7: Logprob(-0.5)}]))
    missing = request_output([1], [7], [-0.5])
    missing.outputs[0].logprobs = None
    with pytest.raises(ValueError, match="no logprob"):
        complete([1], missing)
    with pytest.raises(ValueError, match="abort"):
        complete([1], request_output([1], [7], [-0.5], finish_reason="abort"))
    with pytest.raises(ValueError, match="different prompt"):
        complete([1, 2], request_output([2, 1], [7], [-0.5]))


def test_the_kv_cache_is_sized_per_token_from_the_models_shape():
    """SmolLM2-135M in float32: 30 layers × keys and values × 3 KV heads × 64 dims × 4 bytes."""
    smollm2 = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3}
    assert kv_bytes_per_token(smollm2, "float32") == 46080 and kv_bytes_per_token(smollm2, "bfloat16") == 23040
    assert kv_bytes_per_token({**smollm2, "head_dim": 128}, "bfloat16") == 30 * 2 * 3 * 128 * 2


def test_only_layers_with_nothing_to_load_have_their_reload_warning_dropped():
    """A tied head (its weight is the embedding's) and a table of buffers alone load nothing from a
    checkpoint; a layer class that also has loading instances keeps its warning."""

    class Rotary(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cos_sin_cache", torch.ones(4), persistent=False)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)
            self.rotary = Rotary()
            self.proj = torch.nn.Linear(4, 4)  # a Linear that loads: the class keeps its warning
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    assert nothing_to_load(Model()) == {"Rotary"}
    model = Model()
    del model.proj
    assert nothing_to_load(model) == {"Rotary", "Linear"}
    quiet = ExpectedReloadWarnings({"Rotary", "Linear"})

    def record(name: str, msg: str = "%s: Failed to load weights") -> logging.LogRecord:
        return logging.LogRecord("vllm", logging.WARNING, __file__, 1, msg, (name,), None)

    assert not quiet.filter(record("Rotary")) and not quiet.filter(record("Linear"))
    assert quiet.filter(record("Embedding")) and quiet.filter(record("Rotary", "%s: Delayed processing"))


# ---------------------------------------------------------------- the real engine (vLLM's CPU build)


def cpu_engine(path: Path | str) -> VLLMEngine:
    return VLLMEngine(str(path), dtype="float32", enforce_eager=True, max_model_len=1024, kv_tokens=4096)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir) -> Path:
    return smollm2_dir


@pytest.fixture(scope="module")
def engine(smollm2) -> VLLMEngine:
    return cpu_engine(smollm2)


@pytest.fixture(scope="module")
def trainer_model(smollm2):
    """The trainer's view of the policy: the HF model, scored as the loss scores it."""
    return AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()


def worst_gap(model, turns: list[Completion], temperature: float) -> float:
    """Largest |sampler - trainer| logprob over the turns' sampled tokens."""
    gaps = []
    for turn in turns:
        ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
        with torch.no_grad():
            scored = sequence_token_logprobs(model, ids, temperature=temperature)[0, len(turn.prompt_ids) :]
        gaps.append((scored - torch.tensor(turn.logprobs)).abs().max().item())
    return max(gaps)


def next_version(model, scale: float = 0.02, seed: int = 0) -> dict[str, torch.Tensor]:
    """A trainer step's worth of change to every weight, applied to `model` too (the head stays tied)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.add_(scale * torch.randn(tensor.shape, generator=generator))
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_sampled_and_greedy_tokens_carry_the_trainers_logprobs(engine, trainer_model):
    sampled = engine.generate(PROMPTS, temperature=0.7, top_p=1.0, max_new_tokens=16, seed=1)
    assert sampled == engine.generate(PROMPTS, temperature=0.7, top_p=1.0, max_new_tokens=16, seed=1)
    assert worst_gap(trainer_model, sampled, 0.7) < 1e-3
    greedy = engine.generate(PROMPTS, temperature=0.0, top_p=1.0, max_new_tokens=16)
    assert worst_gap(trainer_model, greedy, 1.0) < 1e-3  # greedy reports the temperature-1 logprobs
    for turn in greedy:
        with torch.no_grad():
            logits = trainer_model(torch.tensor([turn.prompt_ids + turn.completion_ids])).logits[0]
        assert logits[len(turn.prompt_ids) - 1 : -1].argmax(-1).tolist() == turn.completion_ids


@pytest.mark.slow
def test_an_update_is_refused_whole_when_a_weight_is_missing_or_misshapen(engine, trainer_model):
    weights = {k: v.clone() for k, v in trainer_model.state_dict().items()}
    missing = {k: v for k, v in weights.items() if k != "model.layers.3.mlp.up_proj.weight"}
    with pytest.raises(
        ValueError, match=r"version 7 refused, the engine still serves version 0: missing \['model.layers.3"
    ):
        engine.load_weights(missing, version=7)
    misshapen = {**weights, "model.norm.weight": torch.ones(3)}
    with pytest.raises(ValueError, match=r"wrong shapes \['model.norm.weight \(3,\)"):
        engine.load_weights(misshapen, version=7)
    assert engine.version == 0
    assert (
        worst_gap(trainer_model, engine.generate(PROMPTS, temperature=0.7, top_p=1.0, max_new_tokens=8, seed=2), 0.7)
        < 1e-3
    )


@pytest.mark.slow
def test_an_update_mid_turn_stamps_each_token_and_a_new_version_never_reuses_old_cache(engine, trainer_model):
    """Two turns decode while version 1 lands: their tokens carry the version that sampled them.
    Afterwards a prompt seen under version 0 is scored by version 1 (the cache salt), tied head
    included (the CPU build's packed copy of it is rebuilt)."""
    seqs = [engine.sequence(ids, seed=5) for ids in PROMPTS[:2]]
    batch = engine.batch()
    engine.begin_turns(seqs, temperature=0.7, top_p=1.0, max_new_tokens=24)
    for seq in seqs:
        batch.add(seq)
    for _ in range(4):
        assert not batch.step()
    weights = next_version(trainer_model)
    engine.load_weights(weights, version=1)
    ended = []
    while len(ended) < 2:
        ended += batch.step()
    for seq in seqs:
        versions = seq.turn.versions
        assert versions == sorted(versions) and set(versions) == {0, 1} and len(versions) == 24
    assert engine.version == 1
    again = engine.generate(PROMPTS, temperature=0.7, top_p=1.0, max_new_tokens=16, seed=1)
    assert {v for turn in again for v in turn.versions} == {1}
    assert worst_gap(trainer_model, again, 0.7) < 2e-3


@pytest.fixture(scope="module")
def qwen3_episode(tmp_path_factory):
    """The Qwen3 family's scripted tool episode (a wrong ticket, the right one, the answer), by a
    tiny Qwen3 that memorised it, sampled through the scheduler on a vLLM engine."""
    family = FAMILIES["qwen3-no-thinking"]
    tok = family_tokenizer(family)
    episodes = EpisodeFormat(tok, TASK, family.settings)
    expected = scripted(episodes, family)
    spec = TinyModelConfig(family="qwen3", hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=1)
    path = memorised(tok, expected, tmp_path_factory.mktemp("qwen3"), spec)
    rollout = sampled_episode(cpu_engine(path), episodes, max_tokens=4096)
    return expected, rollout, AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.mark.slow
def test_a_tool_episode_on_a_real_template_is_the_sampled_ids_and_the_tool_turns(qwen3_episode):
    expected, rollout, model = qwen3_episode
    assert rollout.turns == 3 and rollout.tool_errors == 1 and rollout.reward == 1.0
    assert rollout.token_ids == expected.token_ids and rollout.loss_mask == expected.loss_mask
    ids = torch.tensor([rollout.token_ids])
    with torch.no_grad():
        scored = sequence_token_logprobs(model, ids)[0][torch.tensor(rollout.loss_mask)]
    got = torch.tensor([lp for lp, m in zip(rollout.logprobs, rollout.loss_mask) if m])
    torch.testing.assert_close(got, scored, rtol=0, atol=1e-3)  # later turns prefilled from the prefix cache


@pytest.mark.slow
def test_an_outside_rollout_worker_on_vllm_is_never_rejected(tmp_path):
    """`meshrl rollout-worker --backend vllm`: a `RolloutWorker` fetching spec and weights over the
    wire samples on vLLM's CPU build; the controller's verifier re-scores every sampled token with
    the trainer's HF model and rejects none."""
    h = make_harness(tmp_path, TinyModelConfig(hidden_size=128, num_heads=2), "float32", 1.0, verify_fraction=1.0)
    logs: list[str] = []
    worker = RolloutWorker(h.client("honest"), max_groups=4, max_tokens=8192, backend="vllm", log=logs.append)
    accepted = worked_offers(h, worker, 12)
    assert len(accepted) == 12 and worker.stats.verdicts == {"accepted": 12}
    assert "worker: vllm engine on cpu, policy version 0" in logs
    assert h.server.verifier.stats.checked_tokens == sum(sum(r.loss_mask) for g in accepted for r in g.rollouts) > 0


def moe_on_vllm(path: str) -> tuple[float, float, bool, bool]:
    """The worst sampler-trainer gap before and after an update of every weight, whether the update
    changed what was sampled, and whether any turn came back with a routing record (asked for: the CPU
    build cannot return one). Run in a process of its own: vLLM builds its parallel groups once per
    process, for the first model it loads, and a dense model's lack the experts' group."""
    moe = VLLMEngine(path, dtype="float32", enforce_eager=True, max_model_len=1024, kv_tokens=4096, record_routing=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = [list(range(5, 15)), list(range(20, 26))]
    before = moe.generate(prompts, temperature=1.0, top_p=1.0, max_new_tokens=24, seed=0)
    first = worst_gap(model, before, 1.0)
    moe.load_weights(next_version(model, scale=0.05), version=1)
    after = moe.generate(prompts, temperature=1.0, top_p=1.0, max_new_tokens=24, seed=0)
    recorded = any(turn.routing is not None for turn in before + after)
    return first, worst_gap(model, after, 1.0), after != before, recorded


@pytest.mark.slow
def test_a_mixture_of_experts_samples_the_trainers_logprobs_before_and_after_an_update(tmp_path):
    """The tiny Qwen3-MoE shape on vLLM's CPU build (its fused-MoE path): the sampled tokens'
    logprobs are the trainer's HF model's, routing included (the R3 problem), before and after a
    weight update of every expert."""
    import multiprocessing

    from tests.test_moe import MOE

    config = load_config([*MOE, "--model.tiny.hidden_size", "128", "--model.tiny.num_heads", "2"])
    path = ensure_tiny(tmp_path / "moe", config.model.tiny)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        before, after, changed, recorded = pool.apply(moe_on_vllm, (str(path),))
    assert before < 1e-4 and after < 1e-4 and changed, (before, after, changed)
    assert not recorded  # routing replay asked: vLLM's CPU build returns no routed experts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's GPU model runner records routed experts; needs CUDA")
def test_vllm_and_the_hf_engine_record_the_same_experts_for_the_same_tokens_and_weights(tmp_path):
    """On a GPU with vLLM's GPU build (not exercised on the CPU machines this suite runs on): a turn's
    `routed_experts` are the HF engine's record of the same tokens under the same weights, in float32."""
    from meshrl.inference.hf_engine import HFEngine
    from meshrl.models.routing import RoutingRecorder, moe_routers
    from tests.test_moe import MOE

    config = load_config([*MOE, "--model.tiny.hidden_size", "128", "--model.tiny.num_heads", "2"])
    path = str(ensure_tiny(tmp_path / "moe", config.model.tiny))
    engine = VLLMEngine(path, dtype="float32", max_model_len=1024, kv_tokens=4096, record_routing=True)
    prompts = [list(range(5, 15)), list(range(20, 26))]
    turns = engine.generate(prompts, temperature=1.0, top_p=1.0, max_new_tokens=24, seed=0)
    hf = HFEngine.from_pretrained(path, device="cuda")
    recorder = RoutingRecorder(moe_routers(hf.model))
    for prompt, turn in zip(prompts, turns):
        ids = prompt + turn.completion_ids
        with torch.no_grad():
            hf.model(torch.tensor([ids], device="cuda"))
        own = recorder.take(1, len(ids))[0][:-1]
        assert turn.routing is not None and turn.routing.shape == own.shape
        assert (np.sort(own, -1) != np.sort(turn.routing, -1)).any(-1).mean() < 0.01


@pytest.mark.slow
def test_vllm_logs_warnings_alone_by_default_and_a_tied_heads_sync_no_failed_layers(tmp_path, monkeypatch):
    """generator.vllm_log_level's default, 'warning': a tiny tied-head model's engine start and
    weight sync log no vLLM record below WARNING (21 INFO lines before) and no "Failed to load
    weights" (22 INFO records and the tied head's and rotary table's "Failed to load weights" before:
    no checkpoint weight loads into them; the sampled logprobs are the new version's all the same).
    'info' brings vLLM's lines back in the same process, vLLM imported and configured at 'warning'."""
    records: list[logging.LogRecord] = []
    call_handlers = logging.Logger.callHandlers  # past the logger's level and filters: what would print

    def recorded(logger: logging.Logger, record: logging.LogRecord) -> None:
        if record.name.startswith("vllm"):
            records.append(record)
        call_handlers(logger, record)

    monkeypatch.setattr(logging.Logger, "callHandlers", recorded)
    spec = TinyModelConfig(hidden_size=128, num_heads=2, tie_embeddings=True)
    path = ensure_tiny(tmp_path / "tied", spec)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tied = cpu_engine(path)
    tied.load_weights(next_version(model, scale=0.05), version=1)
    shown = [r.getMessage() for r in records if r.levelno < logging.WARNING or "Failed to load" in r.getMessage()]
    assert shown == []
    turns = tied.generate(PROMPTS, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=0)
    assert worst_gap(model, turns, 1.0) < 1e-3 and {v for turn in turns for v in turn.versions} == {1}
    del tied
    records.clear()
    VLLMEngine(str(path), dtype="float32", enforce_eager=True, max_model_len=256, kv_tokens=1024, log_level="info")
    assert any(r.levelno == logging.INFO for r in records)


@pytest.mark.slow
def test_a_seeded_prompt_longer_than_a_steps_token_budget_samples_on_the_cpu_build(tmp_path):
    """A 5,000-token prompt outgrows the CPU build's default step budget (4,096 tokens): chunked, the
    seeded request's partial prefill failed ("CPU Generator does not use offset"); it is prefilled whole.
    On a tiny model (SmolLM2's prefill of it took 36 s of the suite)."""
    path = ensure_tiny(tmp_path / "long", TinyModelConfig(hidden_size=64, num_heads=2, max_position_embeddings=8192))
    engine = VLLMEngine(str(path), dtype="float32", enforce_eager=True, max_model_len=6144, kv_tokens=8192)
    prompt = [3 + j % 90 for j in range(5000)]
    turns = engine.generate([prompt], temperature=1.0, top_p=1.0, max_new_tokens=4, seed=3)
    assert [len(turn.completion_ids) for turn in turns] == [4]


@pytest.mark.slow
def test_an_update_that_fails_part_way_leaves_an_engine_that_refuses_to_sample(engine, trainer_model, smollm2):
    """A weight that cannot be read (a transfer that left it unmaterialised) halfway through the
    layers: the engine raises, keeps its version, and samples nothing more, rather than serve a
    mix of two versions. (Last: the engine stays broken.)"""
    original = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    weights = next_version(trainer_model, seed=1)
    weights["model.layers.15.mlp.up_proj.weight"] = torch.empty_like(
        weights["model.layers.15.mlp.up_proj.weight"], device="meta"
    )
    serving = engine.version
    with pytest.raises(EngineBroken, match="the update to policy version 20 failed part-way"):
        engine.load_weights(weights, version=20)
    assert engine.version == serving
    with pytest.raises(EngineBroken, match=f"holds parts of versions {serving} and 20 and samples no more"):
        engine.generate(PROMPTS, temperature=0.7, top_p=1.0, max_new_tokens=4, seed=0)
    with pytest.raises(EngineBroken):
        engine.load_weights(next_version(trainer_model, seed=2), version=21)
    fresh = cpu_engine(smollm2)  # vLLM shares rotary modules between a process's engines: not the broken ones
    assert (
        worst_gap(original, fresh.generate(PROMPTS, temperature=0.7, top_p=1.0, max_new_tokens=8, seed=0), 0.7) < 1e-3
    )
