"""Evaluation: a task's evaluation prompts, run greedy and sampled, scored as mean reward and pass@k.

The prompts are the task's eval split when it offers one (`eval_prompts(rng, n)`), else prompts
drawn from a stream no training stream uses, so a run's evaluation is the same at every step and
never a batch it trained on (for tasks that generate prompts, as the toy task does).
pass@k is the unbiased estimator of Chen et al. (2021) over `k` samples per prompt, an episode
passing when its reward reaches `success_threshold`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from meshrl.rollouts.episodes import EpisodeFormat, Rollout, rubric_means
from meshrl.rollouts.scheduler import EpisodeScheduler, GroupRequest, Sampling
from meshrl.tasks.base import Prompt, Task

EVAL_STREAM = 7_919  # added to the run's seed: the eval prompts' stream, apart from the training ones


@dataclass
class EvalResult:
    prompts: int
    k: int
    reward_greedy: float
    reward_sampled: float
    pass_greedy: float  # the fraction of prompts whose greedy episode passed
    pass_at_1: float
    pass_at_k: float
    rubric: dict[str, float] = field(default_factory=dict)  # the sampled episodes' rubric parts (`rubric_means`)

    def metrics(self) -> dict[str, float]:
        return {
            "eval/reward_greedy": self.reward_greedy,
            "eval/reward_sampled": self.reward_sampled,
            "eval/pass_greedy": self.pass_greedy,
            "eval/pass@1": self.pass_at_1,
            f"eval/pass@{self.k}": self.pass_at_k,
            **{f"eval/{key}": value for key, value in self.rubric.items()},
        }


def eval_prompts(task: Task, n: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed + EVAL_STREAM)
    split = getattr(task, "eval_prompts", None)
    return split(rng, n) if split is not None else task.sample_prompts(rng, n)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k of the n samples (c of them passing) passes."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class EvalPlan:
    """What to evaluate and how: prompts, samples per prompt, the pass threshold, the sampling of
    the sampled half, and the scheduler's caps (generator.max_concurrent_*)."""

    prompts: list[Prompt]
    k: int
    success_threshold: float
    sampling: Sampling
    max_episodes: int
    max_tokens: int
    seed: int = 0


def _run(
    engine: object, episodes: EpisodeFormat, plan: EvalPlan, sampling: Sampling, samples: int
) -> list[list[Rollout]]:
    """Every prompt's `samples` episodes, in prompt order."""
    scheduler = EpisodeScheduler(engine, episodes, sampling, max_episodes=plan.max_episodes, max_tokens=plan.max_tokens)
    try:
        scheduler.submit([GroupRequest(str(i), p, samples, plan.seed + i) for i, p in enumerate(plan.prompts)])
        done: dict[str, list[Rollout]] = {}
        while len(done) < len(plan.prompts):
            for group in scheduler.take(wait_s=1.0):
                done[group.key] = group.rollouts
        return [done[str(i)] for i in range(len(plan.prompts))]
    finally:
        scheduler.close()


def evaluate(engine: object, episodes: EpisodeFormat, plan: EvalPlan) -> EvalResult:
    """Greedy (one episode per prompt) and sampled (`k` per prompt, at `plan.sampling`) on `engine`."""
    n, k = len(plan.prompts), plan.k
    greedy = _run(engine, episodes, plan, Sampling(0.0, 1.0, plan.sampling.max_new_tokens), 1)
    sampled = _run(engine, episodes, plan, plan.sampling, k)
    rewards = [r.reward for group in sampled for r in group]
    passed = [sum(r.reward >= plan.success_threshold for r in group) for group in sampled]
    return EvalResult(
        prompts=n,
        k=k,
        reward_greedy=sum(g[0].reward for g in greedy) / n,
        reward_sampled=sum(rewards) / len(rewards),
        pass_greedy=sum(g[0].reward >= plan.success_threshold for g in greedy) / n,
        pass_at_1=sum(pass_at_k(k, c, 1) for c in passed) / n,
        pass_at_k=sum(pass_at_k(k, c, k) for c in passed) / n,
        rubric=rubric_means([r for group in sampled for r in group]),
    )
