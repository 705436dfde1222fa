"""Scripted solutions of repository tasks, written as Claude Code session files.

A demonstration is what an engineer in Claude Code would do: run the failing tests, read the
code around the bug, fix it with one `Edit`, run the tests again, say what changed. Each tool
call really runs in a sandbox workspace, so the results are the real ones. The session is written
line by line as Claude Code writes it (`~/.claude/projects/...jsonl`), and the warm start reads it
back through the same ingestion as `meshrl traces ingest --format claude-code`: demonstrations
and ingested sessions take one path into training.

    python -m meshrl.tasks.repo.demos OUT_DIR [--n 50] [task kwargs as JSON]
"""

from __future__ import annotations

import argparse
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshrl.tasks.base import Prompt


def unique_context(code: str, line: int) -> str:
    """The shortest run of whole lines around `line` (1-based) that occurs once in `code`:
    what an `Edit`'s old_string needs to name one place."""
    lines = code.splitlines()
    low = high = line - 1
    while True:
        text = "\n".join(lines[low : high + 1])
        if code.count(text) == 1 or (low == 0 and high == len(lines) - 1):
            return text
        low, high = max(0, low - 1), min(len(lines) - 1, high + 1)


class SessionWriter:
    """Envelopes as Claude Code writes them: one line per content block, chained by parentUuid."""

    def __init__(self, session_id: str) -> None:
        self.session_id, self.lines, self.parent = session_id, [], None

    def _line(self, kind: str, message: dict[str, Any]) -> None:
        line_id = str(uuid.UUID(int=len(self.lines) + 1))
        self.lines.append({"parentUuid": self.parent, "isSidechain": False, "userType": "external", "cwd": "/work",
                           "sessionId": self.session_id, "version": "1.0.83", "type": kind, "message": message,
                           "uuid": line_id})  # fmt: skip
        self.parent = line_id

    def user(self, text: str) -> None:
        self._line("user", {"role": "user", "content": text})

    def assistant(self, text: str, name: str | None = None, arguments: dict[str, Any] | None = None) -> str | None:
        """One response: its text, then its tool call as the next line of the same message id."""
        message_id, call_id = f"msg_{len(self.lines):04d}", None
        self._line("assistant", {"id": message_id, "role": "assistant", "type": "message",
                                 "content": [{"type": "text", "text": text}]})  # fmt: skip
        if name is not None:
            call_id = f"toolu_{len(self.lines):04d}"
            block = {"type": "tool_use", "id": call_id, "name": name, "input": arguments or {}}
            self._line("assistant", {"id": message_id, "role": "assistant", "type": "message", "content": [block]})
        return call_id

    def result(self, call_id: str, content: str, is_error: bool) -> None:
        block = {"type": "tool_result", "tool_use_id": call_id, "content": content, "is_error": is_error}
        self._line("user", {"role": "user", "content": [block]})

    def write(self, path: Path) -> None:
        path.write_text("".join(json.dumps(line) + "\n" for line in self.lines))


@dataclass(frozen=True)
class Step:
    """One assistant turn of a scripted solution: its text and its tool call (none: the last turn)."""

    text: str
    name: str | None = None
    arguments: dict[str, Any] | None = None


def solution_steps(task: Any, task_id: str) -> list[Step]:
    """The scripted solution of a task: run the tests, read around the bug, fix it with one Edit,
    run the tests again, say what changed; in the easy tier, read the function the prompt names,
    fix it, run the test it shows, say what changed."""
    repo = task.tasks[task_id]
    source, buggy = task.sources[repo.module], task.buggy_code(repo)
    module = source.path
    path, test = f"/work/{module}", {"command": f"python3 -m unittest {source.test_module}",
                                     "description": "Run the module's tests"}  # fmt: skip
    old = unique_context(buggy, repo.line)
    fix = Step(f"Line {repo.line} looks wrong: `{repo.buggy_line.strip()}` should read `{repo.original_line.strip()}`.",
               "Edit", {"file_path": path, "old_string": old, "new_string": old.replace(repo.buggy_line, repo.original_line, 1)})  # fmt: skip
    done = Step(f"Fixed {module} line {repo.line} ({repo.operator.replace('_', ' ')}); the tests pass.")
    at = task.pointers.get(task_id)
    if at is not None:  # the easy tier: read the function the prompt names, fix it, run the test shown
        run = {"command": f"python3 -m unittest {at.test_id}", "description": "Run the failing test"}
        return [Step(f"Let me read `{at.name}` in {module}.", "Read",
                     {"file_path": path, "offset": at.start, "limit": at.end - at.start + 1}),
                fix, Step("Now the test again.", "Bash", run), done]  # fmt: skip
    return [
        Step("I'll run the tests to see what fails.", "Bash", test),
        Step(f"The failure points into {module}; let me read the code around line {repo.line}.", "Read",
             {"file_path": path, "offset": max(1, repo.line - 5), "limit": 11}),
        fix,
        Step("Now the tests again.", "Bash", test),
        done,
    ]  # fmt: skip


def solution_session(task: Any, prompt: Prompt) -> SessionWriter:
    """The scripted solution of `prompt`'s task as a session, its tool calls run in a fresh workspace."""
    writer = SessionWriter(str(uuid.uuid5(uuid.NAMESPACE_URL, prompt.prompt_id)))
    writer.user(prompt.messages[-1]["content"])
    episode = f"demo-{uuid.uuid4().hex}"
    try:
        for step in solution_steps(task, prompt.answer):
            call_id = writer.assistant(step.text, step.name, step.arguments)
            if call_id is not None:
                result = task.episode_call(episode, prompt, step.name, dict(step.arguments))
                writer.result(call_id, result.content, result.is_error)
    finally:
        task.end_episode(episode)
    return writer


def main() -> None:
    from meshrl.tasks.repo.task import RepoFixTask

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--n", type=int, default=50, help="sessions, one per task (the training split's first n)")
    parser.add_argument("--kwargs", default="{}", help="the task's kwargs as JSON (task.kwargs)")
    args = parser.parse_args()
    task = RepoFixTask(**json.loads(args.kwargs))
    args.out.mkdir(parents=True, exist_ok=True)
    for task_id in task.split_ids[: args.n]:
        prompt = task.prompt(task_id)
        solution_session(task, prompt).write(args.out / f"{task_id}.jsonl")
    print(f"wrote {min(args.n, len(task.split_ids))} sessions to {args.out}")


if __name__ == "__main__":
    main()
