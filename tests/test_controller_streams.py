"""The controller's prompt streams through a step that is asked again, with a generator of plain
Python in place of the mesh's: what a step trains on and what a checkpoint records of the
streams must be those of a run that lost nothing, so a resumed run draws what it would have."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from meshrl.configs.loader import load_config
from meshrl.rollouts.episodes import Rollout
from meshrl.rollouts.scheduler import FinishedGroup, GroupRequest
from meshrl.run.controller import Controller

LOCAL = str(Path(__file__).parents[1] / "configs" / "local.toml")


class _Answered:
    def __init__(self, value: Any) -> None:
        self.value = value

    def get(self, timeout: float | None = None) -> Any:
        return self.value


class _Endpoint:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def call_one(self, *args: Any) -> _Answered:
        return _Answered(self.fn(*args))


class FakeGenerator:
    """Finishes every group it is given at once, as sampled by policy version `version`; the
    first `stale_deliveries` groups come back sampled 100 versions ago (too stale to train on)."""

    def __init__(self, stale_deliveries: int = 0) -> None:
        self.pending: list[GroupRequest] = []
        self.stale_left = stale_deliveries
        self.submit = _Endpoint(self.pending.extend)
        self.take = _Endpoint(self._take)

    def _take(self, wait_s: float) -> list[FinishedGroup]:
        done, self.pending[:] = list(self.pending), []
        finished = []
        for group in done:
            version = -100 if self.stale_left > 0 else group.min_version
            self.stale_left -= 1
            rollouts = [
                Rollout(group.prompt, [], [1, 2], [False, True], [0.0, -1.0], [version], reward=float(i % 2))
                for i in range(group.samples)
            ]
            finished.append(FinishedGroup(group.key, rollouts, time.time(), time.time()))
        return finished


def _steps(tmp_path: Path, stale_deliveries: int) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """Each of 3 steps' trained prompt ids and the streams a checkpoint after it records."""
    config = load_config(["@", LOCAL, "--output-dir", str(tmp_path / f"run{stale_deliveries}")])
    controller = Controller(config)
    controller.generators = [FakeGenerator(stale_deliveries)]
    prompts, streams = [], []
    for step in range(3):
        collected = controller._collect(step)
        prompts.append(sorted({r.prompt.prompt_id for r in collected.fresh}))
        controller.step = step + 1
        streams.append(controller.checkpoint_streams())
    return prompts, streams


def test_a_step_whose_rollouts_are_all_stale_is_asked_again_for_the_same_prompts(tmp_path):
    prompts, streams = _steps(tmp_path, stale_deliveries=0)
    again_prompts, again_streams = _steps(tmp_path, stale_deliveries=8)  # step 0's 8 groups, every one stale
    assert len(prompts[0]) == 8 and again_prompts == prompts
    assert again_streams == streams
