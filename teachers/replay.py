"""Replay: every configured teacher's action at a state, through the on-disk cache.

One failing teacher never blocks the others; `make_teachers` builds a run's teachers from its
config, sharing one cost meter among the paid ones.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from meshrl.configs.schema import RunConfig
from meshrl.tasks.base import make_task
from meshrl.teachers.base import Message, Teacher, chat_messages
from meshrl.teachers.cache import TeacherCache, cache_key
from meshrl.teachers.cost import CostMeter
from meshrl.teachers.hf import HFTeacher, hf_generate_fn
from meshrl.teachers.openai_compat import OpenAITeacher
from meshrl.teachers.oracle import OracleTeacher

log = logging.getLogger(__name__)


def replay_state(
    teachers: Sequence[Teacher],
    cache: TeacherCache | None,
    state_messages: Sequence[Mapping[str, Any]],
    context: dict[str, Any] | None = None,
) -> dict[str, Message | None]:
    """Every teacher's action at this state, by teacher name (None where a teacher failed).

    Cached answers are reused; new ones are cached, failures are not (a later run retries
    them). An exception from a teacher counts as its failure and the others still answer.
    """
    names = [teacher.name for teacher in teachers]
    if len(set(names)) != len(names):
        raise ValueError(f"teacher names must be distinct, got {names}")
    messages = chat_messages(state_messages)
    actions: dict[str, Message | None] = {}
    for teacher in teachers:
        cacheable = cache is not None and teacher.identity is not None
        key = cache_key(teacher.name, teacher.identity, messages) if cacheable else None
        cached = cache.get(key) if key is not None else None
        if cached is not None:
            teacher.stats.cache_hits += 1
            actions[teacher.name] = cached
            continue
        try:
            action = teacher.act(messages, context)
        except Exception as error:  # noqa: BLE001 - any teacher bug is that teacher's failure
            log.warning("teacher %s raised %s: %s", teacher.name, type(error).__name__, error)
            teacher.stats.failures += 1
            action = None
        if action is not None and key is not None:
            cache.put(key, action)
        actions[teacher.name] = action
    return actions


def make_teachers(config: RunConfig, meter: CostMeter, device: str = "cpu") -> list[Teacher]:
    """The run's `teachers.members`; paid endpoints share `meter` (at `teachers.usd_ceiling`)."""
    task = None
    teachers: list[Teacher] = []
    for spec in config.teachers.members:
        if spec.backend == "openai":
            teachers.append(OpenAITeacher(spec, meter=meter))
        elif spec.backend == "hf":
            teachers.append(HFTeacher(spec, hf_generate_fn(spec.path, device)))
        else:
            task = task or make_task(config.task)
            teachers.append(OracleTeacher(task, name=spec.name))
    return teachers


def teacher_totals(teachers: Sequence[Teacher]) -> dict[str, float]:
    """Every counter of `TeacherStats`, summed over the teachers."""
    totals: dict[str, float] = {}
    for teacher in teachers:
        for name, value in vars(teacher.stats).items():
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals
