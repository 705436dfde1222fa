"""The run's random streams and the groups drawn from them.

Each stream is its own `random.Random`, checkpointed by state: the prompts, the generators'
sampling seeds, dynamic sampling's extra groups, and the offline states the teachers replay. A
resumed run draws exactly what the uninterrupted one would have, and a refill or a teacher round
never moves the steps' own prompts.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import replace
from typing import Any

from meshrl.configs.schema import RunConfig
from meshrl.rollouts.advantages import check_draws
from meshrl.rollouts.episodes import Rollout
from meshrl.rollouts.scheduler import GroupRequest
from meshrl.tasks.base import Curriculum, Task


def stream_seed(config: RunConfig) -> int:
    """The seed of the run's prompt, sampling and teacher-state streams. Islands share
    `config.seed` (the same tiny model and warm start: every island starts from the same weights)
    but each draws its own prompts and sampling seeds; two islands on one seed would train on the
    same rollouts, half the data their rollout count says."""
    island = config.trainer.diloco.replica_id
    return config.seed if island is None else config.seed + (zlib.crc32(island.encode()) << 4)


def rng_state(rng: random.Random) -> list[Any]:
    """A stream's state as JSON can hold it."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def rng_from(state: list[Any]) -> tuple[Any, ...]:
    """The state `rng_state` wrote, for `random.Random.setstate`."""
    return (state[0], tuple(state[1]), state[2])


class GroupStreams:
    """The prompts and sampling seeds of the steps' groups, and of dynamic sampling's extra groups
    (a stream of their own, so the steps' prompts are those of a run without refills)."""

    def __init__(self, config: RunConfig, task: Task) -> None:
        self.config, self.task = config, task
        seed = stream_seed(config)
        self.data_rng = random.Random(seed)  # prompts
        self.seed_rng = random.Random(seed + 1)  # generator sampling seeds
        self.refill_rng = random.Random(seed + 4)  # prompts and seeds of dynamic sampling's extra groups
        self.asked = 0  # groups drawn so far: the next group's key
        self.summaries: list[dict[str, Any]] = []  # a curriculum task's summary of each step done, in order
        self.stages: dict[int, dict[str, float]] = {}  # the curriculum's metrics at each step's draw

    def state(self) -> dict[str, Any]:
        """The main streams as they are now (a checkpoint records those of the oldest step in flight)."""
        return {"data_rng": rng_state(self.data_rng), "seed_rng": rng_state(self.seed_rng)}

    def restore(self, state: dict[str, Any]) -> None:
        self.data_rng.setstate(rng_from(state["data_rng"]))
        self.seed_rng.setstate(rng_from(state["seed_rng"]))
        if "refill_rng" in state:  # checkpoints written before dynamic sampling existed go on with a fresh stream
            self.refill_rng.setstate(rng_from(state["refill_rng"]))

    def observe(self, step: int, rollouts: list[Rollout]) -> None:
        """A curriculum task's summary of the step's scored rollouts, kept for later draws."""
        if isinstance(self.task, Curriculum):
            if step != len(self.summaries):
                raise RuntimeError(f"curriculum: step {step} observed after {len(self.summaries)} steps")
            self.summaries.append(self.task.summarize([r.prompt for r in rollouts], [r.reward for r in rollouts]))

    def stage_metrics(self, step: int) -> dict[str, float]:
        """The curriculum's metrics as the step's prompts were drawn (none for other tasks)."""
        return self.stages.get(step, {})

    def step_groups(self, step: int, in_flight: list[str]) -> list[GroupRequest]:
        """The step's own groups, from the main streams."""
        return self._draw(step, self.config.task.prompts_per_step, self.data_rng, self.seed_rng, in_flight)

    def refill_groups(self, step: int, n: int, in_flight: list[str]) -> list[GroupRequest]:
        """`n` extra groups for dynamic sampling, from its own stream."""
        return self._draw(step, n, self.refill_rng, self.refill_rng, in_flight)

    def rekey(self, group: GroupRequest, step: int) -> GroupRequest:
        """The same prompt and seed under a new key (a step asked again)."""
        return replace(group, key=self._key(step))

    def _draw(
        self, step: int, n: int, prompt_rng: random.Random, seed_rng: random.Random, in_flight: list[str]
    ) -> list[GroupRequest]:
        """`n` groups for `step`: a group starts once its generator runs policy version
        `step - max_async_level` or newer. `in_flight`: the step's prompt ids already asked for."""
        g = self.config.generator
        if isinstance(self.task, Curriculum):  # the steps every draw of `step` can see, in any run
            seen = self.summaries[: max(0, step - (g.max_async_level + 2) + 1)]
            self.stages[step] = self.task.stage(seen)
        prompts = self.task.sample_prompts(prompt_rng, n)
        check_draws([p.prompt_id for p in prompts], in_flight, self.config.task.import_path)
        groups = []
        for prompt in prompts:
            key = self._key(step)
            seed = seed_rng.randrange(2**31)
            groups.append(
                GroupRequest(key, prompt, g.samples_per_prompt, seed, min_version=max(0, step - g.max_async_level))
            )
        return groups

    def _key(self, step: int) -> str:
        key = f"{step}/{self.asked}"
        self.asked += 1
        return key
