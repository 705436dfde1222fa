"""From scored rollouts (and mined pairs) to each trainer rank's micro-batches.

RL rows come straight from the rollouts' token ids (what the policy sampled), packed
first-fit-decreasing into rows as wide as the step's longest rollout, stacked into
micro-batches of at most micro_batch_tokens tokens and dealt round-robin to the ranks.
Rows no wider than needed matter: attention over a packed row is dense (every token scores
every other one in the row, then masks), so a 1024-wide row of 18 short rollouts trained
1.6x slower than the same rollouts as an 18-row batch (SmolLM2 on CPU).

SDPO rows (error sites of the rollouts, hint from the task) and replay-DPO rows go through
the TraceCollator into one auxiliary batch per rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshrl.models.routing import extended
from meshrl.rollouts.episodes import Rollout, sampled_spans
from meshrl.rollouts.packing import Encoded, pack_rows
from meshrl.traces.collator import CollateStats, TraceCollator
from meshrl.traces.errors import ErrorClassifier, mark_error_sites
from meshrl.traces.schema import TraceExample, Turn


@dataclass
class RlShards:
    """A step's RL micro-batches: a list per trainer rank, their loss-mask tokens over all ranks,
    how many rollouts were cut to the micro-batch, how many cut off (finish reason `length`) were
    left out (`mask_truncated`, `mask_budget_ended`), and the loss-mask tokens of the
    zero-advantage rollouts left out that still count in the loss normaliser (`count_zero_advantage`)."""

    shards: list[list[dict[str, Any]]]
    tokens: int
    truncated: int
    cut_off: int = 0
    idle_tokens: int = 0

    @property
    def normaliser(self) -> int:
        """What the step's summed RL loss is divided by (over all ranks)."""
        return self.tokens + self.idle_tokens


@dataclass
class AuxShards:
    """A step's replay/SDPO batch per trainer rank (None where a rank gets nothing) and what
    the collator left out."""

    shards: list[dict[str, Any] | None]
    stats: CollateStats


def rl_shards(
    rollouts: Sequence[Rollout],
    advantages: Sequence[float],
    micro_batch_tokens: int,
    pad_id: int,
    world: int,
    keep_zero_advantage: bool = False,
    mask_truncated: bool = False,
    mask_budget_ended: bool = False,
    count_zero_advantage: bool = False,
) -> RlShards:
    """Per-rank lists of packed micro-batches, the step's loss-mask token count, and truncations.

    Zero-advantage rollouts carry no policy gradient and are left out (PRIME-RL does the same),
    unless `keep_zero_advantage`: a loss whose signal is not the advantage (ref_kl) trains on them.
    With `count_zero_advantage` their tokens, untrained, still count in the normaliser (TRL's `dapo`,
    verl's token-mean): a step whose groups all but tied then moves the policy less.
    With `mask_truncated`, rollouts whose last turn the generator cut off at its token limit are
    left out too (TRL's `mask_truncated_completions`, DAPO's overlong filtering): their advantage
    was computed, and shaped their group's, but an unfinished answer is not trained on. Episodes
    that ended on their token budget, their last turn finished, are left out only with
    `mask_budget_ended`: their turns are whole, only the episode is unfinished.
    A rollout longer than the micro-batch keeps its first `micro_batch_tokens` tokens. Each rank
    gets at least one micro-batch while there are rows to deal. A micro-batch keeps its
    `sample_index` (−1 on padding): what tells the trainer a row's pads from its tokens.
    """
    rows, values, truncated, cut_off, idle = [], [], 0, 0, 0
    for r, a in zip(rollouts, advantages):
        cut = (mask_truncated and r.last_turn_cut) or (mask_budget_ended and r.budget_ended)
        segments = r.segments()  # an episode that elided tool results: one row per context it was sampled in
        if a == 0 and not keep_zero_advantage:
            if count_zero_advantage and not cut:
                idle += sum(int(np.count_nonzero(s.loss_mask[:micro_batch_tokens])) for s in segments)
            continue
        if cut:
            cut_off += 1
            continue
        for segment in segments:
            ids, mask, lp = (np.asarray(x) for x in (segment.token_ids, segment.loss_mask, segment.logprobs))
            if ids.size > micro_batch_tokens:
                ids, mask, lp = ids[:micro_batch_tokens], mask[:micro_batch_tokens], lp[:micro_batch_tokens]
                truncated += 1
            routing = extended(segment.routing, ids.size)
            rows.append(Encoded(ids.astype(np.int64), mask.astype(bool), lp.astype(np.float32), routing))
            values.append(a)
    shards: list[list[dict[str, Any]]] = [[] for _ in range(world)]
    if not rows:
        return RlShards(shards, 0, truncated, cut_off, idle)
    packed = pack_rows(rows, values, max(r.ids.size for r in rows), pad_id)
    count, width = packed["input_ids"].shape
    batches = max(math.ceil(count / max(1, micro_batch_tokens // width)), min(count, world))
    per = math.ceil(count / batches)
    for i, start in enumerate(range(0, count, per)):
        shards[i % world].append({k: v[start : start + per] for k, v in packed.items()})
    return RlShards(shards, int(sum(int(r.mask.sum()) for r in rows)), truncated, cut_off, idle)


def rollout_trace(rollout: Rollout, classifier: ErrorClassifier) -> TraceExample:
    """A rollout as a trace example, its error sites marked as ingestion marks them, with its exact
    ids and each sampled assistant turn's span in them. Assistant turns of the prompt (few-shot
    examples) are context: they carry no span, as turns of an ingested trace carry none."""
    if rollout.earlier:  # an episode that elided tool results has no one row its turns lie in
        raise ValueError(f"rollout {rollout.prompt.prompt_id}: it elided tool results, so it is no one trace")
    turns = [Turn.from_message(m) for m in rollout.messages]
    assistant = [t for t in turns[len(rollout.prompt.messages) :] if t.role == "assistant"]
    spans = sampled_spans(rollout.loss_mask)
    if len(spans) != len(assistant):
        raise ValueError(f"rollout {rollout.prompt.prompt_id}: {len(spans)} sampled spans for {len(assistant)} turns")
    for turn, span in zip(assistant, spans):
        turn.token_span = span
    mark_error_sites(turns, classifier)
    for turn in turns[: len(rollout.prompt.messages)]:  # an error site is a turn the policy sampled
        turn.tool_error = turn.error_meta = None
    return TraceExample(
        trace_id=rollout.prompt.prompt_id,
        source="rollout",
        turns=turns,
        final_reward=rollout.reward,
        token_ids=list(rollout.token_ids),
    ).with_routing(rollout.routing)


def aux_shards(
    rollouts: Sequence[Rollout], pairs: Sequence[Any], collator: TraceCollator, world: int, max_sdpo_rows: int
) -> AuxShards:
    """Per-rank replay/SDPO batches (None where a rank gets nothing) and the collator's counters."""
    classifier = ErrorClassifier()
    # an episode that elided tool results has no one row its turns lie in: it trains on RL alone
    traces = [rollout_trace(r, classifier) for r in rollouts if r.tool_errors and not r.earlier]
    traces = [t for t in traces if any(turn.tool_error for turn in t.turns)][:max_sdpo_rows]
    out = AuxShards([], CollateStats())
    for rank in range(world):
        collated = collator(traces[rank::world], pairs=pairs[rank::world], rl=False)
        out.stats += collated.stats
        out.shards.append(collated.batch or None)
    return out
