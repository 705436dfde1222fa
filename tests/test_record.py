"""A step's record built from plain values: what each key says, and that the glossary explains
every key it can hold (the manual's metrics reference is generated from that glossary)."""

from __future__ import annotations

import math

from meshrl.rollouts.batches import RlShards
from meshrl.rollouts.episodes import PROMPT_TOO_LONG, Rollout
from meshrl.run.metric_names import meaning
from meshrl.run.record import StepFacts, StepTimes, Timeline, step_record
from meshrl.tasks.base import Prompt
from meshrl.traces.collator import CollateStats

PROMPT = Prompt("p0", [{"role": "user", "content": "hi"}])


def _rollout(reward: float, versions: list[int], worker: bool = False, cut_off: bool = False) -> Rollout:
    n = len(versions)
    return Rollout(
        PROMPT, [], list(range(n)), [True] * n, [0.0] * n, versions, finish_reason="length" if cut_off else "stop",
        reward=reward, tool_errors=1, info={"worker": "w1"} if worker else {},
    )  # fmt: skip


def _facts(**changes) -> StepFacts:
    facts = dict(
        step=4, fresh=[_rollout(1.0, [4, 4]), _rollout(0.0, [3], worker=True, cut_off=True)],
        uninformative=2, refilled=1, replaced=[_rollout(1.0, [4]), _rollout(1.0, [0])], refill_on=True,
        max_off_policy_steps=1, think_end=None,
        counters={"dropped_stale": 3, "lost_rollouts": 0, "generator_errors": 1}, respawns=1, replay_pairs=5,
        rl=RlShards([[]], tokens=30, truncated=0, cut_off=1),
        trainer={"loss/total": 0.5, "grad_norm": 0.9}, collate=CollateStats(), teachers={"teacher/calls": 2.0},
        evaluation={}, ingress={"ingress/offered": 2.0},
        times=StepTimes(step=3.0, generate=2.0, wait_rollouts=1.5, train=1.0, weight_sync=0.2),
    )  # fmt: skip
    return StepFacts(**{**facts, **changes})


def test_every_key_of_a_step_record_is_in_the_glossary():
    record = step_record(_facts())
    assert [key for key in record if meaning(key) is None] == []


def test_the_record_says_what_the_step_was():
    record = step_record(_facts())
    assert (record["step"], record["policy_version"]) == (4, 5)
    assert record["reward/mean"] == 0.5
    # the replaced tied group's fresh rollout counts in reward/sampled; its stale one (version 0) does not
    assert record["reward/sampled"] == 2.0 / 3.0
    assert record["staleness"] == 1.0 / 3.0 and record["staleness/max"] == 1
    assert (record["rollouts/external"], record["reward/external"]) == (1.0, 0.0)
    assert (record["rollouts/cut_off"], record["rollouts/cut_off_masked"], record["tool_errors"]) == (1, 1, 2)
    assert (record["groups/uninformative"], record["groups/refilled"]) == (2, 1)
    assert record["rollout_tokens_per_s"] == 1.5 and record["train_tokens_per_s"] == 30.0
    assert record["time/weight_sync"] == 0.2 and record["collate/dpo_open_reasoning"] == 0


def test_the_record_says_what_the_step_s_episodes_did():
    """`episode_stats` over the fresh rollouts (tests/test_episode_stats.py has the figures): every
    family present here is in the glossary, and a task without a horizon logs no success by it."""
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c0"}]}
    erring = _rollout(1.0, [3, 4])
    erring.messages, erring.turns = [*PROMPT.messages, call, {"role": "tool", "content": "e", "is_error": True}], 2
    erring.prompt = Prompt("p1", PROMPT.messages, info={"horizon": 4})
    record = step_record(_facts(fresh=[erring, _rollout(0.0, [4])]))
    assert [key for key in record if meaning(key) is None] == []
    assert (record["episode/turns"], record["episode/tool_calls"], record["episode/tokens"]) == (1.0, 0.5, 1.5)
    assert (record["episode/version_spread"], record["episode/version_spread_max"]) == (0.5, 1)
    assert (record["tool_errors/turn_1"], record["success/horizon_4"], record["rollouts/horizon_4"]) == (1, 1.0, 1)
    plain = step_record(_facts())
    assert plain["episode/tool_calls"] == 0.0
    assert not [key for key in plain if key.startswith(("tool_errors/", "success/", "rollouts/horizon"))]


def test_a_rollout_that_ended_on_its_budget_is_cut_off_and_counted_apart():
    ended = _rollout(0.0, [4])
    ended.stop_condition, ended.finish_reason = PROMPT_TOO_LONG, "length"  # its last turn had finished
    rl = RlShards([[]], tokens=30, truncated=0, cut_off=1)  # the turn cut at max_new_tokens, left out
    record = step_record(_facts(fresh=[_rollout(1.0, [4], cut_off=True), ended, _rollout(0.5, [4])], rl=rl))
    assert (record["rollouts/cut_off"], record["rollouts/budget_ended"], record["rollouts/cut_off_masked"]) == (2, 1, 1)


def test_keys_that_belong_to_a_setting_appear_only_with_it():
    record = step_record(_facts(refill_on=False, ingress=None, times=StepTimes(3.0, 2.0, 1.5, 1.0, None)))
    assert not {"reward/sampled", "rollouts/external", "ingress/offered", "time/weight_sync"} & set(record)
    assert "reasoning/tokens" not in record
    thinking = step_record(_facts(think_end=2, fresh=[_rollout(1.0, [4, 4, 4])]))
    assert "reasoning/tokens" in thinking and not math.isnan(thinking["reasoning/tokens"])


def test_a_step_that_trained_no_rl_row_has_no_training_throughput():
    """NaN (null in metrics.jsonl, a gap in throughput.png), not 0 tokens per second."""
    record = step_record(_facts(rl=RlShards([[]], tokens=0, truncated=0)))
    assert math.isnan(record["train_tokens_per_s"]) and record["rollout_tokens_per_s"] == 1.5


def test_a_timeline_hands_over_a_step_s_spans_once():
    timeline = Timeline()
    timeline.add("trainer", 1.0, 2.0, 0)
    assert timeline.take() == [{"lane": "trainer", "start": 1.0, "end": 2.0, "step": 0}]
    assert timeline.take() == []
