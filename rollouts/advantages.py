"""Advantages: each rollout's reward against the other samples of its prompt."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from meshrl.rollouts.episodes import Rollout


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
