"""The rollout feed's prompt streams through a step that is asked again, with a generator of plain
Python in place of the mesh's: what a step trains on and what a checkpoint records of the
streams must be those of a run that lost nothing, so a resumed run draws what it would have."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from monarch.actor import ActorError

from meshrl.configs.loader import load_config
from meshrl.rollouts.episodes import Rollout
from meshrl.rollouts.scheduler import FinishedGroup, GroupRequest
from meshrl.run.feed import RolloutFeed
from meshrl.run.generator_lane import GeneratorLane
from meshrl.run.record import Timeline
from meshrl.run.streams import GroupStreams
from meshrl.tasks.base import make_task
from meshrl.topology.faults import SupervisionError

LOCAL = str(Path(__file__).parents[1] / "configs" / "local.toml")


class _Answered:
    """A call's future: the call runs when its answer is asked for (and raises there, as Monarch's)."""

    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args

    def get(self, timeout: float | None = None) -> Any:
        return self.fn(*self.args)


class _Endpoint:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def call_one(self, *args: Any) -> _Answered:
        return _Answered(self.fn, args)


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


class BrokenGenerator(FakeGenerator):
    """Takes the groups dealt to it; its `take` then fails with `error`: a dead actor's
    (SupervisionError) or a raised call's (ActorError)."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.take = _Endpoint(self._fail)
        self.close = _Endpoint(lambda: None)
        self.error = error

    def _fail(self, wait_s: float) -> None:
        raise self.error


class Respawner:
    """The weight publisher's part in a generator's death: the rank gets a healthy replacement."""

    def __init__(self, pool: list[FakeGenerator]) -> None:
        self.pool, self.reloaded = pool, []

    def reload(self, rank: int) -> None:
        self.pool[rank] = FakeGenerator()
        self.reloaded.append(rank)


def _feed(tmp_path: Path, generator: FakeGenerator, weights: Any = None) -> tuple[RolloutFeed, GeneratorLane]:
    config = load_config(["@", LOCAL, "--output-dir", str(tmp_path / "run")])
    pool = [generator]
    lane = GeneratorLane(pool, alive=lambda rank: True, weights=weights or Respawner(pool))
    return RolloutFeed(config, GroupStreams(config, make_task(config.task)), lane, None, Timeline()), lane


def _steps(tmp_path: Path, stale_deliveries: int) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """Each of 3 steps' trained prompt ids and the streams a checkpoint after it records."""
    feed, _ = _feed(tmp_path / str(stale_deliveries), FakeGenerator(stale_deliveries))
    prompts, streams = [], []
    for step in range(3):
        collected = feed.collect(step)
        prompts.append(sorted({r.prompt.prompt_id for r in collected.fresh}))
        streams.append(feed.checkpoint_streams())
    return prompts, streams


def test_a_step_whose_rollouts_are_all_stale_is_asked_again_for_the_same_prompts(tmp_path):
    prompts, streams = _steps(tmp_path, stale_deliveries=0)
    again_prompts, again_streams = _steps(tmp_path, stale_deliveries=8)  # step 0's 8 groups, every one stale
    assert len(prompts[0]) == 8 and again_prompts == prompts
    assert again_streams == streams


@pytest.mark.parametrize("dies", [True, False])
def test_a_generator_that_dies_loses_its_groups_and_one_whose_call_raised_has_them_dealt_again(tmp_path, dies):
    """A dead rank's groups in flight are lost (counted) and the step asks for its own prompts
    again; a rank whose call raised has its groups dealt once more to its replacement. Either way
    the step trains on the prompts of a run without the fault."""
    healthy, _ = _feed(tmp_path / "healthy", FakeGenerator())
    error = SupervisionError("actor died") if dies else ActorError(ValueError("engine stopped"))
    broken, lane = _feed(tmp_path / "broken", BrokenGenerator(error))
    prompts = sorted({r.prompt.prompt_id for r in broken.collect(0).fresh})
    assert prompts == sorted({r.prompt.prompt_id for r in healthy.collect(0).fresh})
    assert lane.weights.reloaded == [0]
    in_flight = 3 * 8 * 4  # steps 0-2 dealt (max_async_level 1, and a step beyond what may start), 8 groups of 4
    assert (lane.lost_rollouts, lane.errors) == ((in_flight, 0) if dies else (0, 1))
    assert broken.counters() == {
        "dropped_stale": 0,
        "lost_rollouts": lane.lost_rollouts,
        "generator_errors": lane.errors,
    }
