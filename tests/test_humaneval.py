"""HumanEval through the real sandbox: the harness passes every canonical solution and fails a wrong
one; a scripted two-turn episode (run code, then answer) goes through the run's chat format, its
tool call runs sandboxed, and the hidden tests reach no message."""

from __future__ import annotations

import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from meshrl.inference.completion import Completion
from meshrl.inference.toolcalls import MALFORMED
from meshrl.models.tiny import build_tokenizer
from meshrl.rollouts.episodes import EpisodeFormat, Rollout
from meshrl.sandbox import SandboxUnavailable
from meshrl.tasks.base import Ending, Prompt
from meshrl.tasks.humaneval import HumanEvalTask, Refused, bounded, claimed_results, program, record, replay

FIRST = "HumanEval/0"


@pytest.fixture(scope="module")
def task() -> HumanEvalTask:
    """A generous wall time: the suite's meshes share the cores, and HumanEval/75's canonical
    solution (a triple loop, 0.5 s alone) once passed the default 10 s under that load."""
    return HumanEvalTask(split="all", sandbox={"pool_size": 4, "wall_time_s": 60})


def answered(task: HumanEvalTask, task_id: str, answer: str) -> float:
    prompt = task.prompt(task_id)
    return task.score(prompt, [*prompt.messages, {"role": "assistant", "content": answer}], Ending("agent_completed", "stop")).reward  # fmt: skip


def _diagnosis(task: HumanEvalTask, task_id: str) -> str:
    """How a canonical solution's scoring goes when run again, step by step (for a failure's report)."""
    problem, recording = task.problems[task_id], task.recording(task_id)
    run = task.sandbox.run_python(
        program(task.source(task_id, problem["canonical_solution"]), problem["entry_point"], recording)
    )
    results = claimed_results(run, len(recording.calls))
    passes = results is not None and replay(problem, recording, results)
    return f"again: parsed {results is not None}, passes {passes}; {run.report()[:1500]}"


@pytest.mark.slow
def test_every_canonical_solution_passes_and_a_wrong_answer_fails(task):
    def check(task_id: str) -> float:
        problem = task.problems[task_id]
        return answered(task, task_id, f"Here it is:\n```python\n{problem['canonical_solution']}```")

    with ThreadPoolExecutor(4) as pool:
        results = dict(zip(task.problems, pool.map(check, task.problems)))
    assert len(results) == 164
    failed = [k for k, body in results.items() if body != 1.0]
    assert failed == [], {k: _diagnosis(task, k) for k in failed}
    # A wrong answer (None for every call) fails every problem's check: through the sandbox once, and
    # for all 164 as the host scores what a sandbox run returns (`replay` of its claimed results).
    whole = task.problems[FIRST]
    assert answered(task, FIRST, f"def {whole['entry_point']}(*args):\n    return None\n") == 0.0
    nones = [
        k for k in task.problems if replay(task.problems[k], rec := task.recording(k), [("ok", None)] * len(rec.calls))
    ]
    assert nones == []
    assert answered(task, FIRST, whole["prompt"] + whole["canonical_solution"]) == 1.0  # a complete function too
    prompt = task.prompt(FIRST)
    assert task.reward(prompt, [*prompt.messages, task.oracle_action(prompt, prompt.messages)]) == 1.0


def test_compiles_is_measured_in_the_sandbox_before_the_answer_runs(task):
    prompt = task.prompt(FIRST)
    for answer, compiles in (("def has_close_elements(:\n", 0.0), ("def has_close_elements(*a):\n    return 1\n", 1.0)):
        messages = [*prompt.messages, {"role": "assistant", "content": answer}]
        assert task.score(prompt, messages, Ending("agent_completed", "stop")).metrics["compiles"] == compiles


def test_an_answer_that_prints_or_returns_subclasses_of_literals_still_passes(task):
    """What the reference harness passes: output on stdout (even without a newline), a Counter for
    a dict, a float subclass for a float. (Cheats: tests/test_reward_redteam.py.)"""

    def wrapped(task_id: str, wrap: str, before: str) -> float:
        problem = task.problems[task_id]
        entry = problem["entry_point"]
        answer = (f"{before}\n{problem['prompt']}{problem['canonical_solution']}\n_solved = {entry}\n"
                  f"def {entry}(*args):\n    print('thinking', end='')\n    return {wrap}(_solved(*args))\n")  # fmt: skip
        return answered(task, task_id, answer)

    assert wrapped("HumanEval/111", "Counter", "from collections import Counter") == 1.0
    assert wrapped("HumanEval/4", "F", "class F(float):\n    pass") == 1.0


def test_recording_draws_its_own_random_and_is_the_same_every_time(task):
    """HumanEval/53 draws 100 inputs from `random`: every pass draws the same ones, and the host's
    global stream is untouched (the replay runs in many threads at once)."""
    problem = task.problems["HumanEval/53"]
    state = random.getstate()
    first, second = record(problem), record(problem)
    assert random.getstate() == state
    assert first == second and len(first.calls) == 105


def test_the_sandboxed_program_holds_the_inputs_and_nothing_else_of_the_tests(task):
    problem = task.problems[FIRST]
    text = program(task.source(FIRST, "pass"), problem["entry_point"], record(problem))
    assert "[1.0, 2.0, 3.9, 4.0, 5.0, 2.2]" in text  # an input of the first assert
    asserts = [line.strip() for line in problem["test"].splitlines() if "assert" in line]
    assert len(asserts) == 7 and "def check" not in text and not [line for line in asserts if line in text]


def test_the_trusted_replay_is_bounded_in_cpu_time_not_in_a_busy_hosts_wall_time():
    before, started = sys.gettrace(), time.monotonic()
    with pytest.raises(Refused):
        bounded(lambda: [None for _ in iter(int, 1)], 0.2)  # a loop that never ends
    assert time.monotonic() - started < 2 and sys.gettrace() is before
    bounded(lambda: [time.sleep(0.15) for _ in range(3)], 0.2)  # 0.45 s waited (a starved thread), no CPU used


def test_the_splits_are_disjoint_and_evaluation_takes_the_held_out_problems(task):
    train = HumanEvalTask(split="train", sandbox={"backend": "none"})
    assert (len(train.split_ids), len(train.eval_ids)) == (131, 33) and not set(train.split_ids) & set(train.eval_ids)
    drawn = train.sample_prompts(random.Random(0), 200)
    assert {p.info["problem"] for p in drawn} <= set(train.split_ids)
    assert all(p.answer == p.info["problem"] and p.prompt_id.startswith(p.answer + "#") for p in drawn)
    assert len({p.prompt_id for p in drawn}) == 200  # two draws of one problem are two groups
    assert [p.prompt_id for p in train.sample_prompts(random.Random(0), 200)] == [p.prompt_id for p in drawn]
    assert [p.prompt_id for p in train.eval_prompts(random.Random(1), 100)] == train.eval_ids
    assert train.eval_ids[:2] == ["HumanEval/0", "HumanEval/5"]
    with pytest.raises(ValueError, match="task.kwargs.split 'dev'"):
        HumanEvalTask(split="dev")
    one_turn = HumanEvalTask(run_python=False, sandbox={"backend": "none"})
    assert (one_turn.tools, one_turn.max_turns) == ([], 1)


def play(task: HumanEvalTask, prompt: Prompt, call: dict) -> Rollout:
    """An episode of two scripted turns, scored: `call` as a run_python tool call, then the canonical
    solution as the answer."""
    tokenizer = build_tokenizer(512, "hermes")
    episodes = EpisodeFormat(tokenizer, task)
    problem = task.problems[prompt.info["problem"]]
    rollout = episodes.start(prompt)
    turns = [
        f"<tool_call>\n{json.dumps(call)}\n</tool_call>",
        f"```python\n{problem['prompt']}{problem['canonical_solution']}```",
    ]
    for text in turns:
        ids = [*tokenizer(text, add_special_tokens=False)["input_ids"], *episodes.stop_ids]
        calls = episodes.add_turn(rollout, Completion(rollout.token_ids, ids, [0.0] * len(ids), "stop"))
        if episodes.goes_on(rollout, calls):
            episodes.add_tool_results(rollout, calls, [episodes.call_tool(rollout, c) for c in calls])
    episodes.score(rollout)
    return rollout


def test_a_coding_episode_runs_its_code_in_the_sandbox_and_is_scored_on_hidden_tests(task):
    prompt = task.prompt(FIRST)
    problem = task.problems[FIRST]
    probe = "import os\nprint(sorted(os.listdir('/')), 6 * 7)\nopen('/etc/x', 'w')"
    rollout = play(task, prompt, {"name": "run_python", "arguments": {"code": probe}})
    tool = rollout.messages[3]
    assert tool["role"] == "tool" and tool["is_error"]  # it wrote outside its directory: an error result
    assert "42" in tool["content"] and "'home'" not in tool["content"]  # it ran, sandboxed
    assert rollout.reward == 1.0 and rollout.score.metrics == {"compiles": 1.0, "tool_calls": 1.0}
    hidden = problem["test"].strip().splitlines()[-1].strip()  # a line of the hidden tests
    assert not any(hidden in (m.get("content") or "") for m in rollout.messages)
    assert prompt.info == {"problem": FIRST}  # a lease carries messages and info: the id, never the tests


@pytest.mark.parametrize(
    "call",
    [{"name": "run_python\ud800", "arguments": {"code": "print(1)"}},
     {"name": "run_python", "arguments": {"code\udc00": "print(1)"}},
     {"name": "run_python", "arguments": {"code": "print('\ud800')"}}],
    ids=["name", "key", "code"],
)  # fmt: skip
def test_a_run_python_call_holding_a_lone_surrogate_is_a_tool_error_and_the_episode_goes_on(task, call):
    """JSON lets the policy write `"\\ud800"` in plain ASCII: echoed as an unknown tool's name it made
    the tokenizer raise TypeError, and as code the sandbox's program-file write UnicodeEncodeError."""
    rollout = play(task, task.prompt(FIRST), call)
    assert rollout.messages[2]["tool_calls"][0]["function"] == {"name": MALFORMED, "arguments": {}}
    assert rollout.messages[3]["is_error"] and MALFORMED in rollout.messages[3]["content"]
    assert rollout.reward == 1.0 and rollout.stop_condition == "agent_completed"


def test_without_a_sandbox_the_task_refuses_to_start():
    with pytest.raises(SandboxUnavailable, match="sandbox.python '/no/python3'"):
        HumanEvalTask(sandbox={"python": "/no/python3"})
