"""What every teacher backend shares: the Teacher protocol, its counters, and the message forms.

A teacher answers one state (the chat messages before an assistant turn) with one action,
or None when it could not. An action is an assistant message in the task protocol's form:

    {"role": "assistant", "content": str,
     "tool_calls"?: [{"id", "type": "function", "function": {"name", "arguments": dict}}]}
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

Message = dict[str, Any]


@dataclass
class TeacherStats:
    """One teacher's counters. `calls` are answers asked of the backend (cache misses within
    budget); `failures` are calls that gave no action, exceptions included.

    Replay asks one teacher about several states at once, so counters change only through
    `add`, under a lock (`+=` on an attribute is a read and a write another thread can split).
    """

    calls: int = 0
    cache_hits: int = 0
    failures: int = 0
    skipped_budget: int = 0
    usd_spent: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def add(self, **counts: float) -> None:
        """Add to the named counters, e.g. `add(calls=1)`."""
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def counters(self) -> dict[str, float]:
        """A consistent snapshot of every counter."""
        with self._lock:
            return {f.name: float(getattr(self, f.name)) for f in fields(self) if f.init}  # not the lock


class Teacher(Protocol):
    name: str
    identity: str | None  # what answers depend on besides the state (cache key); None: never cached
    stats: TeacherStats

    def act(self, state_messages: list[Message], context: dict[str, Any] | None) -> Message | None: ...


def _chat_call(call: Any, index: int) -> Message:
    """A tool call in OpenAI form with dict arguments, from OpenAI form (arguments a dict or a
    JSON string) or the trace schema's flat {"id", "name", "arguments"}."""
    if not isinstance(call, Mapping):
        raise ValueError(f"tool call {index} is not an object")
    function = call.get("function", call)
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"tool call {index} has no function name")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        arguments = json.loads(arguments)  # JSONDecodeError is a ValueError
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call {index}: arguments are not an object")
    call_id = call.get("id") or f"call_{index}"
    return {"id": str(call_id), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[Message]:
    """State messages in the OpenAI chat form (dict arguments), whichever form they came in.

    Trace turns carry annotations (logprobs, error kinds) no backend should see, and flat tool
    calls chat templates cannot render; both are normalised here, so the cache key is the
    state a teacher is actually shown.
    """
    out = []
    for message in messages:
        chat: Message = {"role": message["role"], "content": message.get("content") or ""}
        if message.get("tool_calls"):
            chat["tool_calls"] = [_chat_call(call, i) for i, call in enumerate(message["tool_calls"])]
        if message.get("tool_call_id") is not None:
            chat["tool_call_id"] = message["tool_call_id"]
        out.append(chat)
    return out


def parse_action(message: Any) -> Message:
    """A backend's answer as an action; ValueError when it is malformed or empty."""
    if not isinstance(message, Mapping):
        raise ValueError("the answer is not an object")
    if message.get("role", "assistant") != "assistant":
        raise ValueError(f"the answer's role is {message.get('role')!r}, not 'assistant'")
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    if not isinstance(content, str) or not isinstance(calls, list):
        raise ValueError("the answer's content is not text or its tool_calls not a list")
    if not content.strip() and not calls:
        raise ValueError("the answer is empty")
    action: Message = {"role": "assistant", "content": content}
    if calls:
        action["tool_calls"] = [_chat_call(call, i) for i, call in enumerate(calls)]
    return action
