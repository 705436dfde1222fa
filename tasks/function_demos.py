"""Demonstrations of the write-run-fix loop for function tasks with the `run_python` tool.

A demonstration runs a function on its docstring's example in the sandbox (an `assert` whose
message is what the function returned, so a wrong result is a tool error, as a crash is), reads
the result, and answers with the function. A recovery demonstration first runs a bugged copy of
the reference (a constant off by one, a flipped comparison or operator, a misspelled parameter)
whose run fails, then the fixed function, then answers: the error site SDPO trains at, shown once.
Every tool result is the sandbox's own: what the policy will see after the same code.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Callable
from typing import Any

from meshrl.sandbox.core import Run
from meshrl.tasks.base import ToolResult
from meshrl.traces.schema import ToolCall, Turn

RUN_PYTHON = "run_python"
PASSED = "passed"  # what a demonstration's run prints when the example's result is right
# Edits of a reference body that keep it valid Python; each is tried where it changes the body.
EDITS: tuple[tuple[str, str | Callable[[re.Match[str]], str]], ...] = (
    (r"\b\d+\b", lambda match: str(int(match.group()) + 1)),
    (r" > ", " >= "),
    (r" < ", " <= "),
    (r" \+ ", " - "),
    (r" - ", " + "),
    (r" == ", " != "),
    (r"\breversed\(", "sorted("),
    (r"\bmax\(", "min("),
)


def definition(problem: dict[str, Any]) -> str:
    """The problem's `def` line (its signature), as the prompt writes it."""
    return next(line for line in problem["prompt"].splitlines() if line.startswith("def "))


def function(problem: dict[str, Any], body: str) -> str:
    """The function with `body`: its `def` line, then the body (indented, as references are)."""
    return f"{definition(problem)}\n{body.rstrip()}\n"


def example_check(problem: dict[str, Any]) -> str:
    """Lines that call the function on the docstring's example and fail, showing what it returned,
    unless it returns the docstring's result."""
    return f"\nresult = {problem['example']}\nassert result == {problem['expected']}, result\nprint({PASSED!r})\n"


def reference_run(problem: dict[str, Any]) -> str:
    """The code a demonstration runs last: the reference function, then the example's check."""
    return function(problem, problem["canonical_solution"]) + example_check(problem)


def answer(problem: dict[str, Any]) -> str:
    """The final answer of a demonstration: the reference function in a ```python block."""
    return f"```python\n{function(problem, problem['canonical_solution'])}```"


def parameters(problem: dict[str, Any]) -> list[str]:
    """The function's parameter names, read from its `def` line."""
    tree = ast.parse(definition(problem) + "\n    pass")
    return [arg.arg for arg in tree.body[0].args.args]  # type: ignore[attr-defined]


def bugs(problem: dict[str, Any], rng: random.Random) -> list[str]:
    """Bugged copies of the reference body, in a random order: each edit of EDITS at its first
    place, and each parameter misspelled at its first use (a NameError)."""
    body = problem["canonical_solution"]
    out = {re.sub(pattern, edit, body, count=1) for pattern, edit in EDITS}
    for name in parameters(problem):
        use = re.search(rf"\b{re.escape(name)}\b", body)
        if use:
            out.add(body[: use.start()] + (name[:-1] if len(name) > 2 else name + "s") + body[use.end() :])
    out.discard(body)
    return rng.sample(sorted(out), len(out))


def run_turns(call_id: str, code: str, result: ToolResult) -> list[Turn]:
    """An assistant turn calling `run_python` on `code`, and the tool's turn with its result."""
    call = ToolCall(id=call_id, name=RUN_PYTHON, arguments={"code": code})
    return [
        Turn(role="assistant", tool_calls=[call]),
        Turn(role="tool", content=result.content, tool_call_id=call_id, is_error=result.is_error or None),
    ]


def episode_turns(
    problem: dict[str, Any], call_tool: Callable[[str, dict[str, Any]], ToolResult], rng: random.Random, recover: bool
) -> list[Turn] | None:
    """The assistant and tool turns of a demonstration (after the prompt), each run through
    `call_tool(name, arguments)`: with `recover`, a bugged run that fails first (the first of `bugs`
    whose run errs). None when the reference's own run fails (no demonstration of a function that
    does not pass its example)."""

    def run(code: str) -> ToolResult:
        return call_tool(RUN_PYTHON, {"code": code})

    turns: list[Turn] = []
    if recover:
        for bug in bugs(problem, rng):
            code = function(problem, bug) + example_check(problem)
            result = run(code)
            if result.is_error:
                turns += run_turns("call_0", code, result)
                break
    code = reference_run(problem)
    result = run(code)
    if result.is_error:
        return None
    return [
        *turns,
        *run_turns(f"call_{len(turns) // 2}", code, result),
        Turn(role="assistant", content=answer(problem)),
    ]


def next_action(problem: dict[str, Any], messages: list[dict[str, Any]], max_turns: int) -> dict[str, Any]:
    """The demonstrations' next turn from any state of an episode (chat messages): run the reference
    on the example until a run of the episode has passed, then answer with it; the last turn answers
    whatever came before, since a call there would end the episode unanswered."""
    taken = sum(message.get("role") == "assistant" for message in messages)
    ran = any(message.get("role") == "tool" and Run.reported_ok(message.get("content") or "") for message in messages)
    if ran or taken >= max_turns - 1:
        return {"role": "assistant", "content": answer(problem)}
    call = {
        "id": f"call_{taken}",
        "type": "function",
        "function": {"name": RUN_PYTHON, "arguments": {"code": reference_run(problem)}},
    }
    return {"role": "assistant", "content": "", "tool_calls": [call]}
