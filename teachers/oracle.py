"""The task's own oracle as a teacher."""

from __future__ import annotations

import logging
import threading
from typing import Any

from meshrl.tasks.base import Demonstrating, Prompt
from meshrl.teachers.base import Message, TeacherStats, chat_messages, parse_action

log = logging.getLogger(__name__)


class OracleTeacher:
    """The task's own oracle. It needs the episode's Prompt (`context["prompt"]`), which the
    cache key does not hold, so its answers are never cached (they are free anyway). Tasks need
    not be thread-safe, so it asks the oracle one state at a time. Where the oracle abstains (a
    state it cannot label), it answers None, which is no failure: no pair is mined there."""

    identity = None

    def __init__(self, task: Any, name: str = "oracle") -> None:
        if not isinstance(task, Demonstrating):
            raise TypeError(f"{type(task).__name__} is not a Demonstrating task (no oracle_action)")
        self.name = name
        self.stats = TeacherStats()
        self._task = task
        self._lock = threading.Lock()

    def act(self, state_messages: list[Message], context: dict[str, Any] | None = None) -> Message | None:
        self.stats.add(calls=1)
        prompt = (context or {}).get("prompt")
        try:
            if not isinstance(prompt, Prompt):
                raise ValueError("no Prompt in context['prompt']")
            with self._lock:
                answer = self._task.oracle_action(prompt, chat_messages(state_messages))
            return None if answer is None else parse_action(answer)  # None: the oracle abstains here
        except ValueError as error:
            log.warning("teacher %s: no answer (%s)", self.name, error)
            self.stats.add(failures=1)
            return None
