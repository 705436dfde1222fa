"""EpisodeScheduler on the real tiny model: KV reuse across turns, weights swapped mid-turn,
slots refilled at once, concurrent tool calls, the token cap, version gating, staleness drops.

The multi-turn tests use a tiny model warm-started on PollTask's demonstrations (it calls the
tool turn after turn), built once per session; nothing here is timed.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.configs import load_config
from meshrl.inference.backends import EngineLimits, make_engine
from meshrl.inference.completion import Completion
from meshrl.inference.hf_continuous import ContinuousHFEngine
from meshrl.inference.hf_engine import HFEngine
from meshrl.inference.toolcalls import MALFORMED
from meshrl.models.tiny import build_model, build_tokenizer, ensure_tiny
from meshrl.rollouts.advantages import group_advantages
from meshrl.rollouts.batches import rl_shards
from meshrl.rollouts.episodes import (
    ELIDED,
    PROMPT_TOO_LONG,
    TOOL_FAILED,
    EpisodeFormat,
    EpisodeLimits,
    Rollout,
    cap_tokens,
    cap_trace,
    fresh_rollouts,
    rubric_means,
)
from meshrl.rollouts.scheduler import EpisodeScheduler, FinishedGroup, GroupRequest, Sampling
from meshrl.tasks.base import Ending, Prompt, Score, ToolResult
from meshrl.tasks.poll import PollTask
from meshrl.tasks.toy import ToolTask
from meshrl.traces.collator import TraceCollator
from meshrl.traces.schema import ToolCall, TraceExample, Turn
from meshrl.trainer.core import TrainerCore
from tests.test_chat_families import memorised


@pytest.fixture(scope="session")
def poll_model(tmp_path_factory) -> str:
    """The tiny model after 60 SFT steps on PollTask demonstrations."""
    root = tmp_path_factory.mktemp("poll")
    base = ensure_tiny(root / "base")
    core = TrainerCore(load_config(["--trainer.lr", "3e-3"]), str(base))
    tokenizer = AutoTokenizer.from_pretrained(base)
    collator = TraceCollator(tokenizer)
    demos = PollTask(1, 6).demonstrations(random.Random(0), 60 * 32)
    for i in range(60):
        core.sft_step([collator(demos[i * 32 : (i + 1) * 32]).batch])
    core.model.save_pretrained(root / "sft")
    tokenizer.save_pretrained(root / "sft")
    return str(root / "sft")


def scheduler(path: str, task, *, max_new_tokens: int = 40, max_episodes: int = 16, max_tokens: int = 100_000,
              limits: EpisodeLimits | None = None, batching: str = "rows"):  # fmt: skip
    engine = make_engine("hf", path, "float32", [], EngineLimits(4096, max_tokens, max_episodes), hf_batching=batching)
    episodes = EpisodeFormat(AutoTokenizer.from_pretrained(path), task, limits=limits)
    return EpisodeScheduler(engine, episodes, Sampling(1.0, 1.0, max_new_tokens), max_episodes=max_episodes,
                            max_tokens=max_tokens)  # fmt: skip


def run_groups(sched: EpisodeScheduler, requests: list[GroupRequest], timeout_s: float = 120) -> list[FinishedGroup]:
    sched.submit(requests)
    done: list[FinishedGroup] = []
    deadline = time.monotonic() + timeout_s
    while len(done) < len(requests):
        assert time.monotonic() < deadline, "groups did not finish"
        done += sched.take(0.5)
    return done


def full_forward_logprobs(model, rollout: Rollout, upto: int | None = None) -> torch.Tensor:
    """Logprobs of the rollout's sampled tokens (before `upto`) from one forward over its ids."""
    ids = torch.tensor([rollout.token_ids[:upto]])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    picked = logprobs.gather(-1, ids[0, 1:, None]).squeeze(-1)
    mask = torch.tensor(rollout.loss_mask[1 : len(ids[0])])
    return picked[mask]


class ConcurrencyGatedPollTask(PollTask):
    """PollTask whose first tool calls wait (a minute at most) until `gate` of them are running at
    once: a scheduler that ran tool calls one after another could never open the gate, whatever
    the machine's load (counting overlaps of instant tool calls depended on it)."""

    def __init__(self, *args: int, gate: int = 4) -> None:
        super().__init__(*args)
        self.gate, self.entered, self.lock, self.open = gate, 0, threading.Lock(), threading.Event()

    def call_tool(self, prompt: Prompt, name: str, arguments: dict) -> ToolResult:
        with self.lock:
            self.entered += 1
            if self.entered >= self.gate:
                self.open.set()
        self.open.wait(timeout=60)
        return super().call_tool(prompt, name, arguments)


@pytest.fixture(scope="module")
def multi_turn(poll_model):
    """One shared run: 6 prompts x 2 samples of (gated) PollTask on the warm-started model."""
    task = ConcurrencyGatedPollTask(1, 6)
    sched = scheduler(poll_model, task)
    try:
        prompts = task.sample_prompts(random.Random(1), 6)
        groups = run_groups(sched, [GroupRequest(f"g{i}", p, 2, seed=i) for i, p in enumerate(prompts)])
    finally:
        sched.close()
    return groups, sched.stats


@pytest.mark.slow
def test_turns_prefill_only_new_ids_and_logprobs_match_a_full_forward(poll_model, multi_turn):
    groups, stats = multi_turn
    rollouts = [r for g in groups for r in g.rollouts]
    assert sorted(g.key for g in groups) == [f"g{i}" for i in range(6)]
    assert max(r.turns for r in rollouts) >= 3, "the warm-started model should poll several times"
    model = AutoModelForCausalLM.from_pretrained(poll_model)
    for r in rollouts:
        assert len(r.token_ids) == len(r.loss_mask) == len(r.logprobs)
        assert len(r.versions) == sum(r.loss_mask) and set(r.versions) == {0}
        recorded = torch.tensor([lp for lp, m in zip(r.logprobs, r.loss_mask) if m])
        torch.testing.assert_close(full_forward_logprobs(model, r), recorded, atol=2e-4, rtol=0)
    # Each turn prefills only what its cache lacks: the prompt, then per later turn the last
    # sampled token and the tool turn. Re-prefilling every turn from scratch would feed far more.
    unsampled = sum(len(r.token_ids) - sum(r.loss_mask) for r in rollouts)
    assert stats.prefilled_tokens <= unsampled + sum(r.turns for r in rollouts)
    from_scratch = 0
    for r in rollouts:
        turn_starts = [i for i in range(1, len(r.token_ids)) if r.loss_mask[i] and not r.loss_mask[i - 1]]
        from_scratch += sum(turn_starts)
    assert stats.prefilled_tokens < from_scratch / 2


def test_tool_calls_of_different_episodes_run_concurrently(poll_model, multi_turn):
    groups, stats = multi_turn
    assert stats.tool_calls >= 12
    assert stats.max_running_tools >= 4  # the gate opened: 4 calls of 12 polling episodes ran at once


@pytest.mark.slow
def test_continuous_batching_runs_multi_turn_episodes_under_the_same_contract(poll_model):
    """transformers' continuous batching behind the scheduler: episodes of several turns, tool calls
    running at once, each sampled token's logprob that of a full forward over its episode."""
    task = ConcurrencyGatedPollTask(1, 6)
    sched = scheduler(poll_model, task, batching="continuous", max_tokens=8192)
    try:
        prompts = task.sample_prompts(random.Random(1), 4)
        groups = run_groups(sched, [GroupRequest(f"g{i}", p, 2, seed=i) for i, p in enumerate(prompts)])
    finally:
        sched.close()
    assert isinstance(sched.engine, ContinuousHFEngine)
    rollouts = [r for g in groups for r in g.rollouts]
    assert max(r.turns for r in rollouts) >= 3 and sched.stats.max_running_tools >= 4
    model = AutoModelForCausalLM.from_pretrained(poll_model)
    for r in rollouts:
        assert len(r.versions) == sum(r.loss_mask) and set(r.versions) == {0}
        recorded = torch.tensor([lp for lp, m in zip(r.logprobs, r.loss_mask) if m])
        torch.testing.assert_close(full_forward_logprobs(model, r), recorded, atol=2e-4, rtol=0)


def test_a_weight_update_lands_mid_turn_and_each_token_keeps_its_own_logprob(tmp_path):
    """Long single turns of the untrained model; version 1 is staged while they decode."""
    path = ensure_tiny(tmp_path / "tiny")
    task = PollTask()
    sched = scheduler(str(path), task, max_new_tokens=150)
    new = build_model(load_config([]).model.tiny, AutoTokenizer.from_pretrained(path), seed=1).state_dict()
    try:
        sched.submit([GroupRequest("g", task.sample_prompts(random.Random(0), 1)[0], 4, seed=3)])
        while sched.stats.sampled_tokens < 40:
            time.sleep(0.001)
        sched.load_weights(new, version=1).wait(timeout=30)
        (group,) = sched.take(60.0)
    finally:
        sched.close()
    old_model = AutoModelForCausalLM.from_pretrained(path)
    spanning = [r for r in group.rollouts if set(r.versions) == {0, 1}]
    assert spanning, "no turn was decoding when the weights changed"
    for r in spanning:
        assert r.versions == sorted(r.versions)  # the switch happened once, mid-turn
        recorded = [lp for lp, m in zip(r.logprobs, r.loss_mask) if m]
        first_new = r.versions.index(1)
        sampled_at = [i for i, m in enumerate(r.loss_mask) if m]
        before = full_forward_logprobs(old_model, r, upto=sampled_at[first_new])
        torch.testing.assert_close(before, torch.tensor(recorded[:first_new]), atol=2e-4, rtol=0)
        after = full_forward_logprobs(old_model, r)[first_new:]
        assert not torch.allclose(after, torch.tensor(recorded[first_new:]), atol=1e-2)  # v1 sampled these
    # The trainer gets each token's own behaviour logprob, whichever version sampled it.
    rollouts = group.rollouts
    for r, a in zip(rollouts, [1.0, -1.0, 0.5, -0.5]):
        r.reward = a
    shards = rl_shards(rollouts, group_advantages(rollouts), 4096, 0, 1)
    batch_logprobs = torch.cat([torch.as_tensor(mb["inference_logprobs"])[torch.as_tensor(mb["loss_mask"])]
                                for mb in shards.shards[0]])  # fmt: skip
    expected = sorted(lp for r in rollouts for lp, m in zip(r.logprobs, r.loss_mask) if m)
    assert sorted(batch_logprobs.tolist()) == pytest.approx(expected, abs=1e-6)


class GatedPollTask(PollTask):
    """PollTask whose prompt "gated" holds its tool calls until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__(1, 2)
        self.gate = threading.Event()
        self.calls: list[str] = []

    def gated_prompts(self, seed: int, n: int) -> list[Prompt]:
        """`n` prompts, the first of them the gated one."""
        prompts = self.sample_prompts(random.Random(seed), n)
        prompts[0].prompt_id = "gated"
        return prompts

    def call_tool(self, prompt: Prompt, name: str, arguments: dict) -> ToolResult:
        self.calls.append(prompt.prompt_id)
        if prompt.prompt_id == "gated":
            assert self.gate.wait(timeout=60)
        return super().call_tool(prompt, name, arguments)


class EpisodicPollTask(GatedPollTask):
    """GatedPollTask whose tool calls keep state per episode (`Episodic`): which episodes are open."""

    def __init__(self) -> None:
        super().__init__()
        self.open_episodes: set[str] = set()
        self.seen: set[str] = set()

    def episode_call(self, episode: str, prompt: Prompt, name: str, arguments: dict) -> ToolResult:
        self.open_episodes.add(episode)
        self.seen.add(episode)
        return self.call_tool(prompt, name, arguments)

    def end_episode(self, episode: str) -> None:
        self.open_episodes.discard(episode)


def finished_beside_the_gate(sched: EpisodeScheduler, prompts: list[Prompt], count: int) -> list[FinishedGroup]:
    """Submit one group of one sample per prompt; return once `count` of them finished (the gated
    prompt's episode is held in its tool call meanwhile)."""
    sched.submit([GroupRequest(p.prompt_id, p, 1, seed=i) for i, p in enumerate(prompts)])
    done: list[FinishedGroup] = []
    deadline = time.monotonic() + 60
    while len(done) < count:
        assert time.monotonic() < deadline, f"only {len(done)} of {count} groups finished beside the gated one"
        done += sched.take(0.5)
    return done


def test_an_episodic_tasks_state_ends_with_its_episode_finished_or_cut_short_by_close(poll_model):
    task = EpisodicPollTask()
    prompts = task.gated_prompts(3, 3)
    sched = scheduler(poll_model, task, max_episodes=4)
    try:
        done = finished_beside_the_gate(sched, prompts, 2)
        rollouts = [r for g in done for r in g.rollouts]
        assert all(r.episode_id in task.seen and r.episode_id not in task.open_episodes for r in rollouts)
        assert len(task.open_episodes) == 1  # the gated episode, waiting in its tool call
        sched.close()  # while it waits: the episode is cancelled, and its state ends with it
        assert not task.open_episodes and len(task.seen) == 3
    finally:
        task.gate.set()
        sched.close()


def test_a_finished_episodes_slot_is_refilled_while_another_continues(poll_model):
    task = GatedPollTask()
    prompts = task.gated_prompts(2, 4)
    sched = scheduler(poll_model, task, max_episodes=2)
    try:
        done = finished_beside_the_gate(sched, prompts, 3)  # with 2 slots and one of them held at the gate
        assert "gated" in task.calls  # the gated episode is mid-episode, in its tool call
        task.gate.set()
        done += sched.take(60.0)
    finally:
        task.gate.set()
        sched.close()
    assert [g.key for g in done][:3] == [p.prompt_id for p in prompts[1:]]
    assert done[-1].key == "gated"


def test_the_token_cap_evicts_idle_caches_and_refuses_an_episode_that_cannot_fit(poll_model):
    task = PollTask(3, 5)
    prompts = task.sample_prompts(random.Random(3), 4)
    sched = scheduler(poll_model, task, max_tokens=400)  # about 1.5 episodes at their longest
    try:
        groups = run_groups(sched, [GroupRequest(f"g{i}", p, 2, seed=i) for i, p in enumerate(prompts)])
    finally:
        sched.close()
    assert sched.stats.evictions > 0
    model = AutoModelForCausalLM.from_pretrained(poll_model)
    for r in (r for g in groups for r in g.rollouts):  # evicted episodes prefilled again, same numbers
        recorded = torch.tensor([lp for lp, m in zip(r.logprobs, r.loss_mask) if m])
        torch.testing.assert_close(full_forward_logprobs(model, r), recorded, atol=2e-4, rtol=0)

    assert_fails_to_fit(scheduler(poll_model, task, max_tokens=45), prompts[0], "max_concurrent_tokens 45")


def assert_fails_to_fit(sched: EpisodeScheduler, prompt: Prompt, match: str) -> None:
    """The scheduler fails on an episode that outgrows its token cap (and is closed after)."""
    try:
        sched.submit([GroupRequest("g", prompt, 1, seed=0)])
        with pytest.raises(RuntimeError, match=f"does not fit generator.{match}"):
            for _ in range(100):
                sched.take(0.5)
    finally:
        sched.close()


class FloodingPollTask(PollTask):
    """PollTask whose tool appends ~120 KB of hex to every answer (a policy's
    `print(random.randbytes(60000).hex())`)."""

    def call_tool(self, prompt: Prompt, name: str, arguments: dict) -> ToolResult:
        result = super().call_tool(prompt, name, arguments)
        return ToolResult(result.content + "\n" + random.Random(0).randbytes(60_000).hex(), result.is_error)


def test_a_flooding_tool_is_capped_and_an_episode_past_its_budget_ends_cut_off(poll_model):
    """Unbounded, one result is ~100k tokens: the episode no longer fits the scheduler's cap and
    the generator fails. Bounded, every tool turn keeps its head and tail within the cap, around a
    marker the policy reads, and an episode whose next turn would not fit ends cut off."""
    task = FloodingPollTask(4, 6)
    prompts = task.sample_prompts(random.Random(5), 3)
    limits = EpisodeLimits(max_tokens=600, max_new_tokens=40, max_tool_tokens=128)
    bounded = scheduler(poll_model, task, max_tokens=4096, limits=limits)
    try:
        groups = run_groups(bounded, [GroupRequest(f"g{i}", p, 2, seed=i) for i, p in enumerate(prompts)])
    finally:
        bounded.close()
    tokenizer = AutoTokenizer.from_pretrained(poll_model)
    rollouts = [r for g in groups for r in g.rollouts]
    tool_turns = [m["content"] for r in rollouts for m in r.messages if m["role"] == "tool"]
    assert tool_turns and all("characters of tool output cut" in t for t in tool_turns)
    assert max(len(tokenizer.encode(t, add_special_tokens=False)) for t in tool_turns) <= 128
    assert all(t.startswith(("running", "done", "error")) for t in tool_turns)  # the head is kept
    ended = [r for r in rollouts if r.stop_condition == PROMPT_TOO_LONG]
    assert ended and all(r.finish_reason == "length" and r.budget_ended and not r.last_turn_cut for r in ended)
    assert all(max(i for i, m in enumerate(r.loss_mask) if m) < 600 for r in rollouts)  # every sampled token fits

    assert_fails_to_fit(scheduler(poll_model, task, max_tokens=4096), prompts[0], "max_concurrent_tokens")


class BrokenScorerPollTask(PollTask):
    """PollTask whose scorer raises on every episode of prompts it was told to break (a policy's
    output that a parser cannot take: a 200,000-term expression, 1,000 nested brackets)."""

    broken: set[str] = set()

    def score(self, prompt: Prompt, messages: list[dict], ending: Ending) -> Score:
        if prompt.prompt_id in self.broken:
            raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")
        return Score(self.reward(prompt, messages))


def test_a_scorer_that_raises_is_a_0_for_its_episodes_and_the_generator_goes_on(poll_model):
    task = BrokenScorerPollTask(1, 4)
    prompts = task.sample_prompts(random.Random(7), 3)
    task.broken = {prompts[0].prompt_id}
    sched = scheduler(poll_model, task)
    try:
        first = run_groups(sched, [GroupRequest(f"g{i}", p, 2, seed=i) for i, p in enumerate(prompts)])
        later = run_groups(sched, [GroupRequest("after", prompts[1], 2, seed=9)])  # the scheduler still runs
    finally:
        sched.close()
    broken = [r for g in first for r in g.rollouts if r.prompt.prompt_id in task.broken]
    assert len(broken) == 2 and all(r.reward == 0.0 and r.score.metrics == {"score_errors": 1.0} for r in broken)
    assert all(r.score.metrics == {} for g in first + later for r in g.rollouts if r not in broken)
    assert len(later) == 1 and len(later[0].rollouts) == 2


def test_a_policys_call_holding_a_lone_surrogate_is_answered_with_a_tool_error(tmp_path):
    """A policy that memorised a call named `lookup\\ud800` (JSON's escape of a lone surrogate,
    plain ASCII to sample): the toy task echoes an unknown tool's name, and building that tool turn
    made the tokenizer raise TypeError, which failed the scheduler. Now the call is malformed."""
    tok, task = build_tokenizer(512, "hermes"), ToolTask(max_turns=2, recovery_rate=0.0)
    episodes = EpisodeFormat(tok, task)
    (prompt,) = task.sample_prompts(random.Random(0), 1)
    script = episodes.start(prompt)
    sampled = '<tool_call>\n{"name": "lookup\\ud800", "arguments": {"key": "a"}}\n</tool_call>'
    ids = tok(sampled, add_special_tokens=False)["input_ids"] + episodes.stop_ids[:1]
    episodes.add_turn(script, Completion(script.token_ids, ids, [0.0] * len(ids), "stop", [0] * len(ids)))
    path = memorised(tok, script, tmp_path / "policy")
    sched = EpisodeScheduler(HFEngine.from_pretrained(str(path)), episodes, Sampling(1.0, 1.0, 64), max_episodes=4,
                             max_tokens=100_000)  # fmt: skip
    try:
        (group,) = run_groups(sched, [GroupRequest("g", prompt, 2, seed=0)])
    finally:
        sched.close()
    for rollout in group.rollouts:
        call, result = rollout.messages[len(prompt.messages) :][:2]
        assert rollout.turn_ids[0] == ids  # the policy sampled the memorised call
        assert [c["function"] for c in call["tool_calls"]] == [{"name": MALFORMED, "arguments": {}}]
        assert result["role"] == "tool" and result["is_error"] and MALFORMED in result["content"]
        assert rollout.stop_condition != TOOL_FAILED and rollout.reward is not None


class BreakingToolPollTask(PollTask):
    """PollTask whose tool, on prompts it was told to break, raises, or answers with a lone surrogate
    (a file name `os.fsdecode` read from bytes that are not UTF-8), which the tokenizer refuses."""

    broken: dict[str, str] = {}  # prompt id -> "raises" | "unencodable"

    def call_tool(self, prompt: Prompt, name: str, arguments: dict) -> ToolResult:
        how = self.broken.get(prompt.prompt_id)
        if how == "raises":
            raise OSError("the tool's own bug")
        result = super().call_tool(prompt, name, arguments)
        if how == "unencodable":
            return ToolResult(result.content + "\n" + os.fsdecode(b"\xff.py"), result.is_error)
        return result


def test_a_tool_that_raises_ends_its_episode_alone_and_the_scheduler_goes_on(poll_model, caplog):
    """Defence in depth behind the parsers: a tool call or tool turn that raises ends that episode
    (`tool_failed`, reward 0, `task_metric/tool_failures`), logged once with its traceback; the
    other episodes and later groups run as ever."""
    task = BreakingToolPollTask(1, 4)
    prompts = task.sample_prompts(random.Random(7), 3)
    task.broken = {prompts[0].prompt_id: "raises", prompts[1].prompt_id: "unencodable"}
    sched = scheduler(poll_model, task)
    try:
        with caplog.at_level(logging.ERROR, logger="meshrl.rollouts.scheduler"):
            first = run_groups(sched, [GroupRequest(f"g{i}", p, 2, seed=i) for i, p in enumerate(prompts)])
        later = run_groups(sched, [GroupRequest("after", prompts[2], 2, seed=9)])  # the scheduler still runs
    finally:
        sched.close()
    rollouts = [r for g in first for r in g.rollouts]
    failed = [r for r in rollouts if r.prompt.prompt_id in task.broken]
    assert len(failed) == 4 and all(r.stop_condition == TOOL_FAILED for r in failed)
    for r in failed:
        assert r.reward == 0.0 and r.score.metrics == {"tool_failures": 1.0}
        assert r.messages[-1]["role"] == "assistant" and r.messages[-1]["tool_calls"]  # its calls have no results
        assert len(r.token_ids) == len(r.loss_mask) == len(r.logprobs) and r.loss_mask[-1]  # ends on its sampled turn
    assert all(r.stop_condition != TOOL_FAILED and r.score is None for r in rollouts + later[0].rollouts
               if r not in failed)  # fmt: skip
    errors = [(rec.exc_info[0], rec.getMessage()) for rec in caplog.records if rec.exc_info]
    assert sorted(kind.__name__ for kind, _ in errors) == ["OSError", "OSError", "TypeError", "TypeError"]
    assert all(any(r.episode_id in message for _, message in errors) for r in failed)
    assert rubric_means(rollouts)["task_metric/tool_failures"] == 1.0
    advantages = group_advantages(rollouts)  # a group all of whose tools failed is tied: advantage 0
    assert [a for a, r in zip(advantages, rollouts) if r in failed] == [0.0] * 4


def test_an_episode_past_its_budget_elides_old_tool_results_and_trains_as_the_contexts_it_saw(poll_model):
    """`generator.context_policy = "elide"`: where the cut-off episodes above ended, the oldest tool
    results give way to a marker the policy reads, and the episode goes on. Each context it was
    sampled in is a row of its own, holding exactly the ids its turns were sampled after: the
    sampler's logprobs equal one forward over each row, and every row fits the budget."""
    task = FloodingPollTask(6, 8)
    prompts = task.sample_prompts(random.Random(5), 3)
    limits = EpisodeLimits(max_tokens=600, max_new_tokens=40, max_tool_tokens=128, elide=True)
    sched = scheduler(poll_model, task, max_tokens=4096, limits=limits)
    try:
        groups = run_groups(sched, [GroupRequest(f"g{i}", p, 2, seed=i) for i, p in enumerate(prompts)])
    finally:
        sched.close()
    rollouts = [r for g in groups for r in g.rollouts]
    elided = [r for r in rollouts if r.earlier]
    assert elided, "no episode outgrew its budget"
    model = AutoModelForCausalLM.from_pretrained(poll_model)
    tokenizer = AutoTokenizer.from_pretrained(poll_model)
    marker = ELIDED.split("}")[1]
    for rollout in elided:
        segments = rollout.segments()
        assert sum(sum(s.loss_mask) for s in segments) == len(rollout.versions) == sum(map(len, rollout.turn_ids))
        for k, segment in enumerate(segments):
            row = Rollout(rollout.prompt, [], segment.token_ids, segment.loss_mask, segment.logprobs, [])
            sampled = torch.tensor([lp for lp, m in zip(segment.logprobs, segment.loss_mask) if m])
            torch.testing.assert_close(full_forward_logprobs(model, row), sampled, rtol=0, atol=2e-4)
            assert max(i for i, m in enumerate(segment.loss_mask) if m) < limits.max_tokens
            assert (marker in tokenizer.decode(segment.token_ids)) == (k > 0)
        assert len(rl_shards([rollout], [1.0], 4096, 0, 1).shards[0][0]["input_ids"]) == len(segments)
    # with nothing elided, the context rebuilt from the turns is the episode's own ids (token-exact)
    episodes = EpisodeFormat(tokenizer, task, limits=limits)
    for rollout in [r for r in rollouts if not r.earlier]:
        assert episodes.context_ids(rollout, set()) == rollout.token_ids


@pytest.mark.parametrize("cap", [64, 100, 257])
def test_a_capped_tool_result_stays_as_it_is_when_capped_again(poll_model, cap):
    """The verifier caps a worker's (already capped) tool turn again: it must read the same."""
    tokenizer = AutoTokenizer.from_pretrained(poll_model)
    rng = random.Random(cap)
    texts = [
        "short result",
        rng.randbytes(3000).hex(),
        " ".join(str(rng.random()) for _ in range(900)),
        rng.randbytes(200_000).hex(),
        "=" * 100_000 + "end",
    ]  # a flood past the windows; very long tokens
    for text in texts:
        once = cap_tokens(tokenizer, text, cap)
        assert len(tokenizer.encode(once, add_special_tokens=False)) <= cap
        assert cap_tokens(tokenizer, once, cap) == once
        assert (once == text) == (len(tokenizer.encode(text, add_special_tokens=False)) <= cap)


def test_a_trace_s_tool_results_are_capped_as_an_episode_s(poll_model):
    """A demonstration or an ingested session shows the policy what an episode would: each tool
    turn within the cap, split between the calls it answers; a sampled trace keeps its ids."""
    tokenizer = AutoTokenizer.from_pretrained(poll_model)
    flood = random.Random(1).randbytes(20_000).hex()
    calls = [ToolCall(id=f"c{i}", name="poll", arguments={"ticket": "a"}) for i in range(2)]
    turns = [Turn(role="user", content="go"), Turn(role="assistant", tool_calls=calls[:1]),
             Turn(role="tool", content=flood, tool_call_id="c0"), Turn(role="assistant", tool_calls=calls),
             Turn(role="tool", content=flood, tool_call_id="c0"), Turn(role="tool", content="short", tool_call_id="c1"),
             Turn(role="assistant", content="42")]  # fmt: skip
    capped = cap_trace(TraceExample(trace_id="t", source="s", turns=turns), tokenizer, 256)
    sizes = [len(tokenizer.encode(t.content, add_special_tokens=False)) for t in capped.turns if t.role == "tool"]
    assert sizes[0] <= 256 and sizes[1] <= 128 and capped.turns[5].content == "short"
    assert capped.turns[-1].content == "42" and turns[2].content == flood  # a copy: the original is kept
    sampled = TraceExample(trace_id="t", source="s", turns=turns, token_ids=[1, 2, 3])
    assert cap_trace(sampled, tokenizer, 256) is sampled


def test_a_group_waits_for_the_policy_version_it_needs(tmp_path):
    path = ensure_tiny(tmp_path / "tiny")
    task = PollTask()
    sched = scheduler(str(path), task, max_new_tokens=8)
    try:
        prompt = task.sample_prompts(random.Random(0), 1)[0]
        sched.submit([GroupRequest("g", prompt, 2, seed=0, min_version=1)])
        assert sched.take(0.5) == [] and sched.stats.turns == 0
        weights = AutoModelForCausalLM.from_pretrained(path).state_dict()
        sched.load_weights(weights, version=1)
        (group,) = sched.take(30.0)
    finally:
        sched.close()
    assert all(set(r.versions) == {1} for r in group.rollouts)


def test_staleness_drops_by_the_oldest_token():
    prompt = Prompt("p", [])

    def rollout(versions: list[int]) -> Rollout:
        return Rollout(prompt, [], [1] * len(versions), [True] * len(versions), [0.0] * len(versions), versions)

    spanning, fresh, old = rollout([3, 4, 6]), rollout([5, 6]), rollout([2, 2])
    assert spanning.version == 3
    assert fresh_rollouts([spanning, fresh, old], step=6, max_off_policy_steps=2) == [fresh]
    assert fresh_rollouts([spanning, fresh, old], step=6, max_off_policy_steps=3) == [spanning, fresh]


def test_a_weight_update_that_fails_stops_the_scheduler_and_wakes_its_waiter(tmp_path):
    """The engine refuses the update (a wrong shape): the staged load's waiter wakes, `check` and
    `take` raise naming it, and no token is sampled after it (the generator is then replaced)."""
    path = ensure_tiny(tmp_path / "tiny")
    task = PollTask()
    sched = scheduler(str(path), task, max_new_tokens=150)
    bad = {"lm_head.weight": torch.zeros(3, 3)}
    try:
        sched.submit([GroupRequest("g", task.sample_prompts(random.Random(0), 1)[0], 2, seed=3)])
        while sched.stats.sampled_tokens < 10:
            time.sleep(0.001)
        assert sched.load_weights(bad, version=1).wait(timeout=30)
        with pytest.raises(RuntimeError, match="the episode scheduler failed: ValueError: lm_head.weight: shape"):
            sched.check()
        sampled = sched.stats.sampled_tokens
        with pytest.raises(RuntimeError, match="lm_head.weight"):
            sched.take(0.5)
        assert sched.stats.sampled_tokens == sampled and sched.engine.version == 0
    finally:
        sched.close()
