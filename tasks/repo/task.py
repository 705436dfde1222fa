"""Fix-the-failing-tests on a real repository, in Claude Code's tools, for 10 to 50 turns.

A prompt is a task of `build`: a standard-library module with one bug and its own test suite,
checked out at `/work` of a sandbox workspace that lives as long as the episode (its files persist
across the episode's calls and no other episode sees them). The policy explores, edits and runs
the tests with Read, Edit, Write, Bash, Grep and Glob (`tools`), and ends the episode with a turn
without tool calls. The reward runs the hidden tests on the episode's module (`scoring`).

Splits are by source module: `eval_modules` are held out (`split = "test"`, and `eval_prompts`),
the other modules train (`split = "train"`); `"all"` is both.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from meshrl.configs.schema import SandboxConfig
from meshrl.sandbox import Workspace, make_sandbox
from meshrl.tasks.base import Ending, Prompt, Score, ToolResult, prompt_id_of
from meshrl.tasks.repo import scoring, tools
from meshrl.tasks.repo.build import RepoTask, answer_key, buggy_code, build_tasks, refuse_readable_copies, source_tests
from meshrl.tasks.repo.demos import solution_session, solution_steps
from meshrl.tasks.repo.export import swe_instance
from meshrl.tasks.repo.named import pointer
from meshrl.tasks.repo.sources import sources_of
from meshrl.traces.claude_code import ingest_claude_code
from meshrl.traces.schema import TraceExample, Turn

MODULES = ["colorsys", "shlex", "string", "getopt", "quopri", "base64", "uu", "bisect", "fractions", "graphlib",
           "netrc"]  # fmt: skip
EVAL_MODULES = ["graphlib", "netrc"]  # held out by default where `modules` lists them
NO_HELD_OUT = " (name the held-out modules, by dotted name, in task.kwargs.eval_modules)"
# A module's whole test suite takes a tenth of a CPU second to a few: a mutation that loops is stopped
# by CPU time, which a busy host does not change (a wall-time limit would drop other mutations there).
BUILD_LIMITS = {"cpu_time_s": 2}
# The walk of all a call can read (`refuse_readable_copies`): a second or two here, at every start.
WALK_LIMITS = {"cpu_time_s": 120, "wall_time_s": 300.0, "memory_mb": 2048}
SYSTEM = (
    "You are a coding agent in a Python repository checked out at /work. Use the tools to explore it, "
    "run commands and edit files. Fix the bug in the source so that the failing tests pass, without "
    "changing the tests. When you are done, reply without calling a tool."
)
HINTS = {
    "edit_failed": "An Edit's old_string must match the file exactly, once: Read the lines first and copy them.",
    "command_failed": "The command failed: read its output. Where a test fails, read its assertion and the code "
    "it calls, then fix that code, not the test.",
}


class RepoFixTask:
    """`modules` and `eval_modules` (held out) are standard-library modules with their tests; each
    gives at most `per_module` tasks from `tries` mutations (seeded by `seed`), built once into
    `cache_dir`. `sandbox`: the `SandboxConfig` of every call, the hidden tests' too."""

    # Workspaces have state: an outside worker's tool turns are taken from its messages, and the
    # reward rebuilds the state itself (`scoring`).
    replayable_tools = False

    def __init__(
        self,
        modules: list[str] | None = None,
        eval_modules: list[str] | None = None,
        repos: list[dict[str, str]] | None = None,
        split: str = "train",
        max_turns: int = 50,
        seed: int = 0,
        tries: int = 80,
        per_module: int = 40,
        cache_dir: str = "~/.cache/meshrl",
        sandbox: dict[str, Any] | None = None,
        easy: bool = False,
    ) -> None:
        if split not in ("train", "test", "all"):
            raise ValueError(f"task.kwargs.split {split!r}: one of 'train', 'test', 'all'")
        if max_turns < 1:
            raise ValueError("task.kwargs.max_turns must be at least 1")
        modules = list(MODULES if modules is None else modules)
        held_out = [m for m in EVAL_MODULES if m in modules] if eval_modules is None else list(eval_modules)
        sources = sources_of(modules, held_out, repos)
        self.held_out = held_out
        self.max_turns = max_turns
        self.tools = tools.TOOLS
        config = SandboxConfig(**(sandbox or {}))
        self.sandbox = make_sandbox(config)
        # Every call of a task, the hidden tests' too, runs where the copies of its original module and
        # tests (and their bytecode) that the interpreter ships cannot be read: no answer key in reach.
        # Per module: another task's module may be one this one's tests import.
        self.answer_keys = {source.module: answer_key(source, config.python) for source in sources}
        if config.backend != "none":  # no isolation, nothing to check: the host's every copy is readable
            walker = make_sandbox(config.model_copy(update=WALK_LIMITS))
            try:
                refuse_readable_copies(walker, sources, self.answer_keys)
            finally:
                walker.close()
        # Building runs each module's tests once per mutation: a mutation that loops stops at BUILD_LIMITS.
        builder = make_sandbox(
            config.model_copy(update={k: min(getattr(config, k), v) for k, v in BUILD_LIMITS.items()})
        )
        try:
            build = build_tasks(builder, sources, seed, tries, per_module, cache_dir, self.answer_keys)
        finally:
            builder.close()
        built, self.sources, self.build_stats, self.expected = build.tasks, build.sources, build.stats, build.expected
        # The easy tier: the tasks whose bug is in a short function and one failing test a short method.
        self.pointers = {t.task_id: found for t in built if easy and (found := pointer(self.sources[t.module], t))}
        built = [t for t in built if not easy or t.task_id in self.pointers]
        self.tasks = {task.task_id: task for task in built}
        self.eval_ids = interleaved([t for t in built if t.module in held_out])
        self.split_ids = {
            "train": [t.task_id for t in built if t.module not in held_out],
            "test": self.eval_ids,
            "all": [t.task_id for t in built],
        }[split]
        if not self.split_ids:
            raise ValueError(f"task.kwargs.split: the {split!r} split of the sources {[s.module for s in sources]} "
                             f"(held out: {held_out}) has no tasks{NO_HELD_OUT if not held_out else ''}")  # fmt: skip
        self._workspaces: dict[str, Workspace] = {}
        self._opening: dict[str, threading.Lock] = {}  # episode -> held while its workspace is made
        self._lock = threading.Lock()
        self._demos: dict[str, TraceExample] = {}

    # ------------------------------------------------------------------ prompts

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """`n` draws, each its own prompt id (the task's and 32 bits of `rng`)."""
        return [self.prompt(rng.choice(self.split_ids), rng.getrandbits(32)) for _ in range(n)]

    def eval_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """The first `n` held-out tasks, each once, the held-out modules taking turns (`interleaved`):
        the task id is the prompt id."""
        if not self.eval_ids:
            why = (
                NO_HELD_OUT
                if not self.held_out
                else f" (of {self.held_out}, none kept a task{' of the easy tier' * bool(self.pointers)})"
            )
            raise ValueError(f"task.kwargs.eval_modules: no held-out source has tasks{why}")
        return [self.prompt(task_id) for task_id in self.eval_ids[:n]]

    def prompt(self, task_id: str, draw: int | None = None) -> Prompt:
        task = self.tasks[task_id]
        source = self.sources[task.module]
        at = self.pointers.get(task_id)
        if at is not None:  # the easy tier
            user = (
                f"This test in {source.test_path} fails:\n```python\n{at.test_code.rstrip()}\n```\nThe bug is in the "
                f"function `{at.name}` of {source.path} (lines {at.start}-{at.end}). Fix it so that the tests pass, "
                f"without changing them. Run the test with `python3 -m unittest {at.test_id}`."
            )
        else:
            failing = ", ".join(
                name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1] for name in task.fail_to_pass[:3]
            )
            more = f" and {len(task.fail_to_pass) - 3} more" if len(task.fail_to_pass) > 3 else ""
            user = (
                f"Some tests in {source.test_path} fail: {failing}{more}. Find the bug in {source.path} and "
                f"fix it so that every test passes. Run the tests with `python3 -m unittest {source.test_module}`."
            )
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        return Prompt(
            prompt_id=prompt_id_of(task_id, draw), messages=messages, answer=task_id, info={"problem": task_id}
        )

    def swe_instances(self) -> list[dict[str, Any]]:
        """Every task as a SWE-bench-style instance that names its source (`export.swe_instance`)."""
        return [swe_instance(self.sources[task.module], task, self.prompt(task.task_id).messages[-1]["content"])
                for task in self.tasks.values()]  # fmt: skip

    def buggy_code(self, task: RepoTask) -> str:
        return buggy_code(self.sources[task.module], task)

    def repository(self, task_id: str) -> dict[str, str]:
        """The buggy repository's files (what a workspace starts with). KeyError names a task this
        build does not have (an outside worker's build that kept other mutations than the controller's)."""
        if task_id not in self.tasks:
            raise KeyError(f"repository task {task_id!r} is not in this build ({len(self.tasks)} tasks)")
        task = self.tasks[task_id]
        return self.sources[task.module].files(self.buggy_code(task))

    # ------------------------------------------------------------------ tools

    def call_tool(self, prompt: Prompt, name: str, arguments: dict[str, Any]) -> ToolResult:
        """A call outside any episode runs in a workspace of its own, removed after it."""
        episode = f"call-{id(arguments)}-{time.monotonic_ns()}"
        try:
            return self.episode_call(episode, prompt, name, arguments)
        finally:
            self.end_episode(episode)

    def episode_call(self, episode: str, prompt: Prompt, name: str, arguments: dict[str, Any]) -> ToolResult:
        """A call in the episode's workspace, made at its first call (a task this build lacks is a tool error).
        It stays until `end_episode`, however long between calls: a long turn looks like an abandoned
        episode, and every runner ends its episodes (the scheduler's `finally` and `close`, the ingress's)."""
        with self._lock:
            opening = self._opening.setdefault(episode, threading.Lock())
        with opening:  # two calls of one turn: one makes the workspace, the other waits for it
            with self._lock:
                workspace = self._workspaces.get(episode)
            if workspace is None:
                try:
                    files = self.repository(prompt.info["problem"])
                except KeyError as error:
                    return ToolResult(f"<tool_use_error>{error.args[0]}</tool_use_error>", is_error=True)
                module = self.tasks[prompt.info["problem"]].module
                workspace = self.sandbox.workspace(files, hidden=self.answer_keys[module])
                with self._lock:
                    self._workspaces[episode] = workspace
        return tools.call(self.sandbox, workspace, name, arguments)

    def end_episode(self, episode: str) -> None:
        with self._lock:
            workspace = self._workspaces.pop(episode, None)
            self._opening.pop(episode, None)
        if workspace is not None:
            workspace.close()

    def live_workspaces(self) -> int:
        with self._lock:
            return len(self._workspaces)

    # ------------------------------------------------------------------ reward

    def final_module(self, task: RepoTask, messages: list[dict[str, Any]]) -> bytes | None:
        """The module as the episode left it: the writing calls its tool turns answered (a turn cut
        at max_new_tokens ran none), replayed in order in a fresh workspace."""
        workspace = self.sandbox.workspace(self.repository(task.task_id), hidden=self.answer_keys[task.module])
        try:
            for name, arguments in answered_calls(messages):
                if name in tools.WRITES:
                    tools.call(self.sandbox, workspace, name, arguments)
            return scoring.read_module(workspace.directory, self.sources[task.module].path)
        finally:
            workspace.close()

    def score(self, prompt: Prompt, messages: list[dict[str, Any]], ending: Ending) -> Score:
        calls = [c for m in messages if m.get("role") == "assistant" for c in m.get("tool_calls") or []]
        metrics = {"turns": float(sum(m.get("role") == "assistant" for m in messages)),
                   "tool_calls": float(len(calls)),
                   "tool_errors": float(sum(bool(m.get("is_error")) for m in messages if m.get("role") == "tool"))}  # fmt: skip
        task = self.tasks.get(prompt.answer) if isinstance(prompt.answer, str) else None
        if task is None:  # no hidden tests (a prompt as leased to an outside worker)
            return Score(0.0, {"solved": 0.0}, metrics)
        data = self.final_module(task, messages)
        final = None if data is None else scoring.module_text(data)
        original, buggy = self.sources[task.module].code, self.buggy_code(task)
        if final is None:
            refused = ["unreadable"]
        elif len(final) > scoring.module_bound(original, buggy):  # before the host parses it
            refused = ["too large"]
        else:
            refused = scoring.new_capabilities(final, buggy, original)
        metrics |= {"refused": float(bool(refused)), "tests_fixed": 0.0, "tests_broken": 0.0, "no_report": 0.0}
        if refused:
            return Score(0.0, {"solved": 0.0}, metrics)
        run = source_tests(self.sandbox, self.sources[task.module], final, self.answer_keys[task.module])
        verdict = scoring.judge(run, task.fail_to_pass, task.pass_to_pass, self.expected[task.module])
        metrics |= {"tests_fixed": verdict.fixed / len(task.fail_to_pass), "tests_broken": float(verdict.broken),
                    "no_report": float(run.tests is None)}  # fmt: skip
        return Score(float(verdict.solved), {"solved": float(verdict.solved)}, metrics)

    def reward(self, prompt: Prompt, messages: list[dict[str, Any]]) -> float:
        return self.score(prompt, messages, Ending("agent_completed", "stop")).reward

    # ------------------------------------------------------------------ demonstrations, hints

    def demonstrations(self, rng: random.Random, n: int) -> list[TraceExample]:
        """Scripted solutions, written as Claude Code sessions and read back through the ingestion
        (`demos`); one per task drawn, each task's made once and reused."""
        return [self._demonstration(prompt) for prompt in self.sample_prompts(rng, n)]

    def _demonstration(self, prompt: Prompt) -> TraceExample:
        cache, task_id = self._demos, prompt.answer
        if task_id not in cache:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / f"{task_id}.jsonl"
                solution_session(self, self.prompt(task_id)).write(path)
                (example,) = ingest_claude_code([path]).examples
            system = Turn(role="system", content=SYSTEM)  # Claude Code's session files hold no system prompt
            cache[task_id] = example.model_copy(update={"turns": [system, *example.turns], "final_reward": 1.0})
        return cache[task_id].model_copy(update={"trace_id": prompt.prompt_id})

    def oracle_action(self, prompt: Prompt, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The scripted solution's next turn after the assistant turns `messages` hold (its last
        turn once they are more): what the oracle teachers answer."""
        steps = solution_steps(self, prompt.info["problem"])
        done = sum(m.get("role") == "assistant" for m in messages)
        step = steps[min(done, len(steps) - 1)]
        if step.name is None:
            return {"role": "assistant", "content": step.text}
        call = {"id": f"call_{done}", "type": "function", "function": {"name": step.name, "arguments": step.arguments}}
        return {"role": "assistant", "content": step.text, "tool_calls": [call]}

    def hint(self, error_kind: str, error_meta: dict[str, Any]) -> str | None:
        """The SDPO teacher's privileged context at a tool error: a failed Edit, a failing test run."""
        tool = error_meta.get("tool_name")
        if tool == "Edit":
            return HINTS["edit_failed"]
        if tool == "Bash":
            return HINTS["command_failed"]
        return None


def answered_calls(messages: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of each assistant call that a tool turn right after it answered, in order:
    what the episode ran. A turn cut at max_new_tokens keeps its parsed calls but ran none."""
    out = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        answered = set()
        for reply in messages[i + 1 :]:
            if reply.get("role") != "tool":
                break
            answered.add(reply.get("tool_call_id"))
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if (
                isinstance(function, dict)
                and call.get("id") in answered
                and isinstance(function.get("arguments"), dict)
            ):
                out.append((str(function.get("name")), function["arguments"]))
    return out


def interleaved(tasks: list[RepoTask]) -> list[str]:
    """Task ids with the modules taking turns (each module's in build order): the first n cover
    every module once n reaches their number."""
    by_module: dict[str, list[str]] = {}
    for task in tasks:
        by_module.setdefault(task.module, []).append(task.task_id)
    rounds = max((len(ids) for ids in by_module.values()), default=0)
    return [ids[r] for r in range(rounds) for ids in by_module.values() if r < len(ids)]
