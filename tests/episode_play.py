"""An episode played the way the rollout runs it, for task tests: no model, no tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshrl.tasks.base import Prompt, Stopping, Task

Message = dict[str, Any]


def play(task: Task, prompt: Prompt, act: Callable[[list[Message]], Message]) -> list[Message]:
    """Act, answer every call, stop on a turn without calls, after `max_turns`, or where a task
    that ends its own episodes (`Stopping`) says so."""
    messages = [dict(m) for m in prompt.messages]
    for _ in range(task.max_turns):
        action = act(messages)
        messages.append(action)
        if not action.get("tool_calls"):
            break
        for call in action["tool_calls"]:
            result = task.call_tool(prompt, call["function"]["name"], call["function"]["arguments"])
            messages.append({"role": "tool", "content": result.content, "tool_call_id": call["id"]})
        if isinstance(task, Stopping) and task.stops(prompt, messages):
            break
    return messages
