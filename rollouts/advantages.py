"""Advantages: each rollout's reward against the other samples of its prompt."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence

from meshrl.rollouts.episodes import Rollout


def check_draws(prompt_ids: Sequence[str], in_flight: Collection[str], task: str) -> None:
    """Refuse a draw whose prompt ids repeat one another or a group of the same step still in
    flight: advantages are per prompt id, so two draws sharing one would merge into one group."""
    seen = set(in_flight)
    for prompt_id in prompt_ids:
        if prompt_id in seen:
            raise ValueError(
                f"task {task} drew prompt id {prompt_id!r} twice for one step: a group is one draw, so each "
                "draw needs its own prompt_id (keep the problem's id in Prompt.info)"
            )
        seen.add(prompt_id)


def group_advantages(rollouts: Sequence[Rollout]) -> list[float]:
    """Reward minus the mean reward of the rollouts of the same prompt.

    A group whose rewards are all equal gets exactly 0 (it carries no signal and is not
    trained on): its float mean can miss the shared value by an ulp, which would leave
    advantages like 5.6e-17 that the zero filter lets through.
    """
    groups: dict[str, list[float]] = defaultdict(list)
    for r in rollouts:
        groups[r.prompt.prompt_id].append(r.reward)
    means = {k: v[0] if min(v) == max(v) else sum(v) / len(v) for k, v in groups.items()}
    return [r.reward - means[r.prompt.prompt_id] for r in rollouts]
