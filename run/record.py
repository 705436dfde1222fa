"""What a step leaves behind: its record (one line of `metrics.jsonl`, built in one function from
plain values, every key explained by `run/metric_names.py`) and its timeline (the spans of
`timeline.jsonl`). A new per-step metric goes into `StepFacts` and `step_record`, and its
meaning into the glossary; a test fails on a key the glossary does not explain."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from meshrl.rollouts.batches import RlShards
from meshrl.rollouts.episode_stats import episode_stats
from meshrl.rollouts.episodes import Rollout, fresh_rollouts, reasoning_stats, rubric_means
from meshrl.traces.collator import CollateStats


class Timeline:
    """The current step's spans, one bar each of the timeline figure: a lane (generator r, ingress,
    trainer, weights, teacher r, checkpoint (the snapshot), checkpoint write (until committed)),
    wall-clock start and end, and the step it served."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []

    def add(self, lane: str, start: float, end: float, step: int) -> None:
        self.spans.append({"lane": lane, "start": start, "end": end, "step": step})

    def take(self) -> list[dict[str, Any]]:
        """The spans so far; the next step's start empty."""
        spans, self.spans = self.spans, []
        return spans


@dataclass
class StepTimes:
    """Seconds: the whole step, its groups' first start to last finish, the controller's wait for
    them, the trainers' step, and the weight publish (None when the step stopped before it)."""

    step: float
    generate: float
    wait_rollouts: float
    train: float
    weight_sync: float | None


@dataclass
class StepFacts:
    """Everything a step's record says, as the collaborators reported it."""

    step: int  # the optimizer step trained (0-based)
    fresh: list[Rollout]
    uninformative: int  # dynamic sampling: the step's own tied groups
    refilled: int  # ... the extra groups asked for
    replaced: list[Rollout]  # ... the rollouts of the tied groups they replaced
    refill_on: bool  # generator.refill_uninformative > 0
    max_off_policy_steps: int
    think_end: int | None  # the `</think>` id of a thinking model's vocabulary
    counters: dict[str, int]  # the feed's running totals (dropped_stale, lost_rollouts, generator_errors)
    respawns: int
    replay_pairs: int
    rl: RlShards
    trainer: dict[str, float]  # the trainer's loss and optimizer metrics
    collate: CollateStats
    teachers: dict[str, float]
    evaluation: dict[str, float]
    ingress: dict[str, float] | None  # the ingress's counters (None: no ingress)
    times: StepTimes


def step_record(f: StepFacts) -> dict[str, Any]:
    """One line of `metrics.jsonl`."""
    sampled = [v for r in f.fresh for v in r.versions]
    return {
        "step": f.step,
        "policy_version": f.step + 1,
        "reward/mean": _mean([r.reward for r in f.fresh]),
        **({"reward/sampled": _sampled_reward(f)} if f.refill_on else {}),
        **rubric_means(f.fresh),
        **(reasoning_stats(f.fresh, f.think_end) if f.think_end is not None else {}),
        "rollouts": len(f.fresh),
        "dropped_stale": f.counters["dropped_stale"],
        "lost_rollouts": f.counters["lost_rollouts"],
        "generator/respawns": f.respawns,
        "generator/errors": f.counters["generator_errors"],
        "staleness": sum(f.step - v for v in sampled) / max(1, len(sampled)),
        "staleness/max": max(f.step - v for v in sampled),
        "tool_errors": sum(r.tool_errors for r in f.fresh),
        "replay_pairs": f.replay_pairs,
        "truncated": f.rl.truncated,
        "rollouts/cut_off": sum(r.finish_reason == "length" for r in f.fresh),
        "rollouts/budget_ended": sum(r.budget_ended for r in f.fresh),
        "rollouts/cut_off_masked": f.rl.cut_off,
        "rollouts/elided": sum(bool(r.earlier) for r in f.fresh),
        **episode_stats(f.fresh),
        "groups/uninformative": f.uninformative,
        "groups/refilled": f.refilled,
        **f.trainer,
        **{f"collate/{k}": v for k, v in asdict(f.collate).items()},
        **f.teachers,
        **f.evaluation,
        **(_ingress(f.fresh, f.ingress) if f.ingress is not None else {}),
        "rollout_tokens_per_s": len(sampled) / max(f.times.generate, 1e-9),
        "train_tokens_per_s": f.rl.tokens / max(f.times.train, 1e-9) if f.rl.tokens else float("nan"),
        "time/step": f.times.step,
        "time/generate": f.times.generate,
        "time/wait_rollouts": f.times.wait_rollouts,
        "time/train": f.times.train,
        **({"time/weight_sync": f.times.weight_sync} if f.times.weight_sync is not None else {}),
    }


def _mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))


def _sampled_reward(f: StepFacts) -> float:
    """`reward/sampled`: the mean over every fresh rollout sampled for the step, the tied groups
    dynamic sampling replaced included (`reward/mean` covers the trained batch only)."""
    return _mean([r.reward for r in f.fresh + fresh_rollouts(f.replaced, f.step, f.max_off_policy_steps)])


def _ingress(fresh: list[Rollout], counters: dict[str, float]) -> dict[str, float]:
    """The ingress counters, the outside rollouts this step trained on and their mean reward
    (a worker that cherry-picks samples shows as a gap to the mesh's)."""
    external = [r for r in fresh if "worker" in r.info]
    return {
        **counters,
        "rollouts/external": float(len(external)),
        "reward/external": _mean([r.reward for r in external]) if external else float("nan"),
    }
