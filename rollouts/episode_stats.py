"""What a step's episodes did across their turns, for its record (`run.record.step_record`): how
many turns and tool calls they took, at which turns their tool calls erred, how long they were end
to end (elided tool results at their full size), how many policy versions sampled their turns, and
how often they succeeded by the task's horizon (`prompt.info["horizon"]`). Plain arithmetic over
the rollouts' fields: nothing is re-tokenized."""

from __future__ import annotations

from collections.abc import Sequence

from meshrl.rollouts.episodes import Rollout

# Bins of an assistant turn's 1-based index (log2 past the second turn, so 32-turn episodes keep the
# key set small): (first turn, last turn or None, the key's suffix).
TURN_BINS: tuple[tuple[int, int | None, str], ...] = (
    (1, 1, "1"),
    (2, 2, "2"),
    (3, 4, "3-4"),
    (5, 8, "5-8"),
    (9, 16, "9-16"),
    (17, 32, "17-32"),
    (33, None, "33+"),
)
SUCCESS = 1.0  # the reward of a success: full reward


def turn_bin(turn: int) -> str:
    """The bin of a 1-based assistant turn index: "1", "2", "3-4", "5-8", ..., "33+"."""
    return next(name for low, high, name in TURN_BINS if low <= turn and (high is None or turn <= high))


def episode_stats(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """`episode/<figure>` means over the rollouts (turns, tool calls, tokens, elided tokens, version
    spread) and the largest tokens and spread; `tool_errors/turn_<bin>`, the erring tool results
    answering the assistant turns of each bin, for the bins where some episode made tool calls; and
    for rollouts whose prompt's info has an int `horizon`, `success/horizon_<h>` (fraction with
    reward >= 1) and `rollouts/horizon_<h>` (how many). Empty for no rollouts."""
    if not rollouts:
        return {}
    n = len(rollouts)
    calls = errors = 0
    erred: dict[str, int] = {}
    tokens, elided, spreads = [], [], []
    horizons: dict[int, list[bool]] = {}
    for rollout in rollouts:
        for turn, made, failed in _turns(rollout):
            calls += made
            if made:
                erred.setdefault(turn_bin(turn), 0)
                erred[turn_bin(turn)] += failed
                errors += failed
        full, removed = episode_tokens(rollout)
        tokens.append(full)
        elided.append(removed)
        spreads.append(max(rollout.versions) - min(rollout.versions) if rollout.versions else 0)
        horizon = rollout.prompt.info.get("horizon")
        if isinstance(horizon, int) and not isinstance(horizon, bool):
            horizons.setdefault(horizon, []).append(rollout.reward is not None and rollout.reward >= SUCCESS)
    return {
        "episode/turns": sum(r.turns for r in rollouts) / n,
        "episode/tool_calls": calls / n,
        "episode/tokens": sum(tokens) / n,
        "episode/tokens_max": max(tokens),
        "episode/elided_tokens": sum(elided) / n,
        "episode/version_spread": sum(spreads) / n,
        "episode/version_spread_max": max(spreads),
        **{f"tool_errors/turn_{name}": erred[name] for _, _, name in TURN_BINS if name in erred},
        **{f"success/horizon_{h}": sum(won) / len(won) for h, won in sorted(horizons.items())},
        **{f"rollouts/horizon_{h}": len(won) for h, won in sorted(horizons.items())},
    }


def _turns(rollout: Rollout) -> list[tuple[int, int, int]]:
    """Each assistant turn of the episode (past its prompt's messages): its 1-based index, the tool
    calls it made, and how many of the tool results answering it were errors (`is_error`)."""
    turns: list[tuple[int, int, int]] = []
    for message in rollout.messages[len(rollout.prompt.messages) :]:
        if message.get("role") == "assistant":
            turns.append((len(turns) + 1, len(message.get("tool_calls") or []), 0))
        elif message.get("role") == "tool" and message.get("is_error") and turns:
            index, made, failed = turns[-1]
            turns[-1] = (index, made, failed + 1)
    return turns


def episode_tokens(rollout: Rollout) -> tuple[int, int]:
    """The episode's length as sampled end to end (prompt, sampled turns, tool turns), an elided tool
    result counted at its full size, and the tokens elision took out of its context. Each context an
    elision started opens with the shortened context, unsampled, before the turn sampled next: what
    a context held beyond that opening is what the episode added in it."""
    segments = rollout.segments()
    removed = sum(len(left.token_ids) - _opening(kept.loss_mask) for left, kept in zip(segments, segments[1:]))
    return len(rollout.token_ids) + removed, removed


def _opening(loss_mask: Sequence[bool]) -> int:
    """Tokens before the first sampled one (all of them when none was)."""
    return next((i for i, sampled in enumerate(loss_mask) if sampled), len(loss_mask))
