"""Rollouts to trainer rows: group advantages and the zero-advantage filter."""

from __future__ import annotations

import math

import pytest

from meshrl.rollouts.advantages import check_draws, group_advantages
from meshrl.rollouts.batches import rl_shards
from meshrl.rollouts.episodes import PROMPT_TOO_LONG, Rollout, reasoning_stats
from meshrl.tasks.base import Prompt


def _rollout(prompt_id: str, reward: float) -> Rollout:
    prompt = Prompt(prompt_id, [{"role": "user", "content": "q"}])
    return Rollout(prompt, [], [1, 2, 3, 4], [False, False, True, True], [0.0, 0.0, -0.5, -0.7], [0, 0], reward=reward)


def test_a_group_with_equal_rewards_has_exactly_zero_advantage_and_no_rows():
    # 0.4 * 3 / 3 is 0.4000000000000001 in floats: the group mean misses the shared reward.
    rollouts = [_rollout("same", 0.4) for _ in range(3)] + [_rollout("mixed", 0.0), _rollout("mixed", 1.0)]
    advantages = group_advantages(rollouts)
    assert advantages == [0.0, 0.0, 0.0, -0.5, 0.5]
    rl = rl_shards(rollouts, advantages, micro_batch_tokens=64, pad_id=0, world=1)
    assert rl.tokens == 4  # only the two rollouts of the mixed group, two sampled tokens each
    (shard,) = rl.shards
    assert sum(int(b["loss_mask"].sum()) for b in shard) == 4
    # ref_kl's signal is the reference's logprobs, not the advantage: every rollout trains.
    kept = rl_shards(rollouts, advantages, micro_batch_tokens=64, pad_id=0, world=1, keep_zero_advantage=True)
    assert kept.tokens == 10
    # TRL's normaliser: the tied group's 6 tokens count, untrained.
    counted = rl_shards(rollouts, advantages, micro_batch_tokens=64, pad_id=0, world=1, count_zero_advantage=True)
    assert (counted.tokens, counted.normaliser, len(counted.shards[0])) == (4, 10, len(shard))
    assert rl.normaliser == 4


def test_truncated_completions_are_left_out_only_when_asked():
    """mask_truncated leaves out a rollout whose last turn hit generator.max_new_tokens; one that
    ended on its token budget, its last turn finished, is left out only with mask_budget_ended."""
    rollouts = [_rollout("g", 0.0), _rollout("g", 1.0), _rollout("g", 0.5), _rollout("g", 0.2)]
    rollouts[1].finish_reason = "length"  # cut off at generator.max_new_tokens
    rollouts[3].stop_condition, rollouts[3].finish_reason = PROMPT_TOO_LONG, "length"  # as `goes_on` ends it
    advantages = group_advantages(rollouts)
    assert advantages[1] > 0  # its reward still shapes the group's advantages
    assert rl_shards(rollouts, advantages, micro_batch_tokens=64, pad_id=0, world=1).tokens == 8
    masked = rl_shards(rollouts, advantages, micro_batch_tokens=64, pad_id=0, world=1, mask_truncated=True)
    assert (masked.tokens, masked.cut_off) == (6, 1)
    both = rl_shards(rollouts, advantages, micro_batch_tokens=64, pad_id=0, world=1, mask_truncated=True,
                     mask_budget_ended=True)  # fmt: skip
    assert (both.tokens, both.cut_off) == (4, 2)
    assert [(r.last_turn_cut, r.budget_ended) for r in rollouts[1::2]] == [(True, False), (False, True)]


def test_rl_micro_batches_stack_rows_as_wide_as_the_longest_rollout():
    """Rows are packed to the longest rollout's width (attention over a row is dense) and stacked
    into micro-batches within the token budget; every sampled token is dealt exactly once."""
    lengths = [10, 6, 4, 3, 3]
    rollouts = [
        Rollout(Prompt(f"p{i}", []), [], list(range(1, n + 1)), [False] + [True] * (n - 1), [0.0] * n, [0], reward=i)
        for i, n in enumerate(lengths)
    ]
    rl = rl_shards(rollouts, [1.0] * 5, micro_batch_tokens=24, pad_id=0, world=2)
    widths = [b["input_ids"].shape for shard in rl.shards for b in shard]
    assert widths == [(2, 10), (1, 10)]  # rows [10], [6 4], [3 3]: two fit in 24 tokens
    assert rl.tokens == sum(n - 1 for n in lengths) == sum(int(b["loss_mask"].sum()) for s in rl.shards for b in s)
    # More ranks than micro-batches by the budget: every rank with a row to take gets one.
    spread = rl_shards(rollouts, [1.0] * 5, micro_batch_tokens=24, pad_id=0, world=4)
    assert [len(shard) for shard in spread.shards] == [1, 1, 1, 0]


def test_a_step_whose_draws_share_a_prompt_id_is_refused_naming_the_task():
    check_draws(["a#1", "a#2"], ["b#1"], "pkg.mod:Task")
    with pytest.raises(ValueError, match="task pkg.mod:Task drew prompt id 'a' twice for one step"):
        check_draws(["a", "b", "a"], [], "pkg.mod:Task")
    with pytest.raises(ValueError, match="drew prompt id 'b#1' twice"):
        check_draws(["b#1"], ["b#1"], "pkg.mod:Task")  # a group of the same step still in flight


def test_reasoning_is_measured_over_the_turns_that_closed_it():
    """An episode that takes more turns, or a turn that never closes its reasoning, does not read as
    shorter reasoning: closed turns are averaged, the unclosed counted apart."""
    prompt = Prompt("p", [{"role": "user", "content": "q"}])
    think_end = 9
    # episode 1: a first turn that reasons 3 tokens and closes (4 counted), a second that closes none
    ids, mask = [1, 5, 5, 5, think_end, 6, 7, 2, 6, 6], [False, True, True, True, True, True, False, False, True, True]
    # episode 2: a first turn of 1 token of reasoning (2 counted), a second of 5 (6 counted)
    ids2 = [1, 5, think_end, 6, 2, 5, 5, 5, 5, 5, think_end]
    mask2 = [False, True, True, True, False, True, True, True, True, True, True]
    rollouts = [
        Rollout(prompt, [], ids, mask, [0.0] * 10, [0] * 7),
        Rollout(prompt, [], ids2, mask2, [0.0] * 11, [0] * 9),
    ]
    stats = reasoning_stats(rollouts, think_end)
    assert stats == {"reasoning/tokens": 4.0, "reasoning/first_turn_tokens": 3.0, "reasoning/unclosed": 0.25}
    assert all(math.isnan(v) for v in reasoning_stats([], think_end).values())
