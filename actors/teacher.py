"""The teacher-replay actor: the run's teachers, one shared cost meter and the disk cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from monarch.actor import Actor, current_rank, endpoint

from meshrl.configs.schema import RunConfig
from meshrl.teachers.base import Message
from meshrl.teachers.cache import TeacherCache
from meshrl.teachers.cost import CostMeter
from meshrl.teachers.replay import make_teachers, replay_states, teacher_totals
from meshrl.topology.devices import proc_device
from meshrl.topology.worker import process_info


@dataclass
class TeacherAnswers:
    """One replay round: every teacher's action at each state (None where it failed), and the
    counters summed over all teachers since this actor started."""

    actions: list[dict[str, Message | None]]
    totals: dict[str, float]


class TeacherActor(Actor):
    def __init__(self, config: RunConfig, model_path: str, cache_path: str, rank: int | None = None) -> None:
        self.rank = current_rank().rank if rank is None else rank  # a replacement keeps the rank it replaces
        self.meter = CostMeter(config.teachers.usd_ceiling)
        self.teachers = make_teachers(config, self.meter, str(proc_device(config.topology, "teacher", self.rank)))
        self.cache = TeacherCache(cache_path)
        self.max_concurrent = config.teachers.max_concurrent_requests

    @endpoint
    def info(self) -> dict[str, Any]:
        return {"role": "teacher", "rank": self.rank, **process_info(), "teachers": [t.name for t in self.teachers]}

    @endpoint
    def replay(
        self, states: list[list[Message]], contexts: list[dict[str, Any]], spent_elsewhere: float = 0.0
    ) -> TeacherAnswers:
        """Every teacher's action at each state, and this actor's counters over all its teachers.
        `spent_elsewhere`: the USD the run's other teacher actors (and earlier ones: replaced,
        before a resume) spent, as the controller last heard; the ceiling counts it."""
        self.meter.elsewhere_usd = spent_elsewhere
        actions = replay_states(self.teachers, self.cache, states, contexts, self.max_concurrent)
        return TeacherAnswers(actions, teacher_totals(self.teachers))
