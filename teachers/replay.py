"""Replay: every configured teacher's action at many states, through the on-disk cache.

Requests run concurrently (a slow endpoint costs wall time, not a request slot per state in
turn); one failing teacher never blocks the others. `make_teachers` builds a run's teachers
from its config, sharing one cost meter among the paid ones.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from meshrl.configs.schema import RunConfig
from meshrl.tasks.base import make_task, task_tools
from meshrl.teachers.base import Message, Teacher, chat_messages
from meshrl.teachers.cache import TeacherCache, cache_key
from meshrl.teachers.cost import CostMeter
from meshrl.teachers.hf import HFTeacher, hf_generate_fn
from meshrl.teachers.openai_compat import OpenAITeacher
from meshrl.teachers.oracle import OracleTeacher

log = logging.getLogger(__name__)


def replay_states(
    teachers: Sequence[Teacher],
    cache: TeacherCache | None,
    states: Sequence[Sequence[Mapping[str, Any]]],
    contexts: Sequence[dict[str, Any] | None],
    max_concurrent: int,
) -> list[dict[str, Message | None]]:
    """Every teacher's action at each state, by teacher name (None where a teacher failed), in
    the order of `states`.

    The (state, teacher) requests run on at most `max_concurrent` threads. Cached answers are
    reused; new ones are cached, failures are not (a later run retries them). An exception from
    a teacher counts as its failure and the others still answer. Requests for the same cache
    key run one after another, so a state repeated within the round is paid for once.

    The paid ceiling is checked before each request, so up to `max_concurrent` requests
    already in flight may still be paid for once the meter crosses it.
    """
    names = [teacher.name for teacher in teachers]
    if len(set(names)) != len(names):
        raise ValueError(f"teacher names must be distinct, got {names}")
    if len(contexts) != len(states):
        raise ValueError(f"{len(states)} states but {len(contexts)} contexts")
    chats = [chat_messages(state) for state in states]
    keys = [[_key(teacher, cache, chat) for teacher in teachers] for chat in chats]
    key_locks = {key: threading.Lock() for row in keys for key in row if key is not None}
    with ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="teacher") as pool:
        futures = [
            [pool.submit(_answer, teacher, cache, chat, context, key, key_locks) for teacher, key in zip(teachers, row)]
            for chat, context, row in zip(chats, contexts, keys)
        ]
    return [{teacher.name: future.result() for teacher, future in zip(teachers, row)} for row in futures]


def _key(teacher: Teacher, cache: TeacherCache | None, messages: list[Message]) -> str | None:
    """The teacher's cache key for this state; None when nothing is cached for it."""
    if cache is None or teacher.identity is None:
        return None
    return cache_key(teacher.name, teacher.identity, messages)


def _answer(
    teacher: Teacher,
    cache: TeacherCache | None,
    messages: list[Message],
    context: dict[str, Any] | None,
    key: str | None,
    key_locks: Mapping[str, threading.Lock],
) -> Message | None:
    """One teacher's action at one state: from the cache, else asked (and cached when it is one).

    The key's lock spans lookup, request and store, so a second request for the key finds the
    first one's answer in the cache (or asks again when that one failed, as in turn it would).
    """
    if cache is None or key is None:
        return _ask(teacher, messages, context)
    with key_locks[key]:
        cached = cache.get(key)
        if cached is not None:
            teacher.stats.add(cache_hits=1)
            return cached
        action = _ask(teacher, messages, context)
        if action is not None:
            cache.put(key, action)
        return action


def _ask(teacher: Teacher, messages: list[Message], context: dict[str, Any] | None) -> Message | None:
    """The teacher's action, an exception counting as its failure."""
    try:
        return teacher.act(messages, context)
    except Exception as error:  # noqa: BLE001 - any teacher bug is that teacher's failure
        log.warning("teacher %s raised %s: %s", teacher.name, type(error).__name__, error)
        teacher.stats.add(failures=1)
        return None


def make_teachers(config: RunConfig, meter: CostMeter, device: str = "cpu") -> list[Teacher]:
    """The run's `teachers.members`; paid endpoints share `meter` (at `teachers.usd_ceiling`)."""
    task = make_task(config.task)
    tools = task_tools(task)  # model teachers see the tools the policy sees, and answer with native calls
    teachers: list[Teacher] = []
    for spec in config.teachers.members:
        if spec.backend == "openai":
            teacher = OpenAITeacher(spec, meter=meter, tools=tools)
            teacher.check_tools()
            teachers.append(teacher)
        elif spec.backend == "hf":
            generate = hf_generate_fn(spec.path, device, config.generator.max_new_tokens, tools=tools,
                                      tool_parser=spec.tool_parser, renderer=spec.renderer)  # fmt: skip
            teachers.append(HFTeacher(spec, generate))
        else:
            teachers.append(OracleTeacher(task, name=spec.name))
    return teachers


def teacher_totals(teachers: Sequence[Teacher]) -> dict[str, float]:
    """Every counter of `TeacherStats`, summed over the teachers."""
    totals: dict[str, float] = {}
    for teacher in teachers:
        for name, value in teacher.stats.counters().items():
            totals[name] = totals.get(name, 0.0) + value
    return totals
