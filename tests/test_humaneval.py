"""HumanEval through the real sandbox: the harness passes every canonical solution and fails a wrong
one; a scripted two-turn episode (run code, then answer) goes through the run's chat format, its
tool call runs sandboxed, and the hidden tests reach no message."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from meshrl.inference.completion import Completion
from meshrl.models.tiny import build_tokenizer
from meshrl.rollouts.episodes import EpisodeFormat
from meshrl.sandbox import SandboxUnavailable
from meshrl.tasks.base import Ending
from meshrl.tasks.humaneval import HumanEvalTask

FIRST = "HumanEval/0"


@pytest.fixture(scope="module")
def task() -> HumanEvalTask:
    """A generous wall time: the suite's meshes share the cores, and HumanEval/75's canonical
    solution (a triple loop, 0.5 s alone) once passed the default 10 s under that load."""
    return HumanEvalTask(split="all", sandbox={"pool_size": 4, "wall_time_s": 60})


def answered(task: HumanEvalTask, task_id: str, answer: str) -> float:
    prompt = task.prompt(task_id)
    return task.score(prompt, [*prompt.messages, {"role": "assistant", "content": answer}], Ending("agent_completed", "stop")).reward  # fmt: skip


def test_every_canonical_solution_passes_and_a_wrong_answer_fails(task):
    def check(task_id: str) -> tuple[float, float]:
        problem = task.problems[task_id]
        body = answered(task, task_id, f"Here it is:\n```python\n{problem['canonical_solution']}```")
        wrong = answered(task, task_id, f"def {problem['entry_point']}(*args):\n    return None\n")
        return body, wrong

    with ThreadPoolExecutor(4) as pool:
        results = dict(zip(task.problems, pool.map(check, task.problems)))
    assert len(results) == 164
    assert [k for k, (body, _) in results.items() if body != 1.0] == []
    assert [k for k, (_, wrong) in results.items() if wrong != 0.0] == []
    whole = task.problems[FIRST]
    assert answered(task, FIRST, whole["prompt"] + whole["canonical_solution"]) == 1.0  # a complete function too


@pytest.mark.parametrize(
    "answer",
    ["raise SystemExit(0)", "import sys\nsys.exit(0)", "import os\nos._exit(0)", "exit()",
     "import os\nos.execv('/bin/true', ['true'])", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
     "import subprocess\nsubprocess.run(['kill', '-9', str(__import__('os').getppid())])",
     "import threading, os\nthreading.Thread(target=lambda: os._exit(0)).start()",
     "import __main__\n__main__._exit(0)", "import posix\nposix._exit(0)",
     "class A:\n    __eq__ = lambda s, o: True\ndef has_close_elements(*args):\n    return A()",
     "abs = lambda x: 0\ndef has_close_elements(*args):\n    return True",
     "import builtins\nbuiltins.abs = lambda x: 0\ndef has_close_elements(*args):\n    return True"],
)  # fmt: skip
def test_an_answer_that_ends_the_program_early_or_games_the_comparison_does_not_pass(task, answer):
    assert answered(task, FIRST, answer) == 0.0


def test_an_answer_that_names_the_scorer_s_placeholders_is_still_just_its_text(task):
    body = task.problems[FIRST]["canonical_solution"]
    assert answered(task, FIRST, body + "    # ANSWER TESTS PROMPT ENTRY\n") == 1.0


def test_the_splits_are_disjoint_and_evaluation_takes_the_held_out_problems(task):
    train = HumanEvalTask(split="train", sandbox={"backend": "none"})
    assert (len(train.split_ids), len(train.eval_ids)) == (131, 33) and not set(train.split_ids) & set(train.eval_ids)
    drawn = {p.prompt_id for p in train.sample_prompts(random.Random(0), 200)}
    assert drawn <= set(train.split_ids)
    assert [p.prompt_id for p in train.eval_prompts(random.Random(1), 100)] == train.eval_ids
    assert train.eval_ids[:2] == ["HumanEval/0", "HumanEval/5"]
    with pytest.raises(ValueError, match="task.kwargs.split 'dev'"):
        HumanEvalTask(split="dev")
    one_turn = HumanEvalTask(run_python=False, sandbox={"backend": "none"})
    assert (one_turn.tools, one_turn.max_turns) == ([], 1)


def test_a_coding_episode_runs_its_code_in_the_sandbox_and_is_scored_on_hidden_tests(task):
    tokenizer = build_tokenizer(512, "hermes")
    episodes = EpisodeFormat(tokenizer, task)
    prompt = task.prompt(FIRST)
    problem = task.problems[FIRST]
    rollout = episodes.start(prompt)
    probe = "import os\nprint(sorted(os.listdir('/')), 6 * 7)\nopen('/etc/x', 'w')"
    turns = [
        "<tool_call>\n" + json.dumps({"name": "run_python", "arguments": {"code": probe}}) + "\n</tool_call>",
        f"```python\n{problem['prompt']}{problem['canonical_solution']}```",
    ]
    for text in turns:
        ids = [*tokenizer(text, add_special_tokens=False)["input_ids"], *episodes.stop_ids]
        calls = episodes.add_turn(rollout, Completion(rollout.token_ids, ids, [0.0] * len(ids), "stop"))
        if episodes.goes_on(rollout, calls):
            episodes.add_tool_results(rollout, calls, [episodes.call_tool(rollout, c) for c in calls])
    episodes.score(rollout)
    tool = rollout.messages[3]
    assert tool["role"] == "tool" and tool["is_error"]  # it wrote outside its directory: an error result
    assert "42" in tool["content"] and "'home'" not in tool["content"]  # it ran, sandboxed
    assert rollout.reward == 1.0 and rollout.score.metrics == {"compiles": 1.0, "tool_calls": 1.0}
    hidden = problem["test"].strip().splitlines()[-1].strip()  # a line of the hidden tests
    assert not any(hidden in (m.get("content") or "") for m in rollout.messages)
    assert prompt.info == {}  # a lease carries messages and info only


def test_without_a_sandbox_the_task_refuses_to_start():
    with pytest.raises(SandboxUnavailable, match="sandbox.python '/no/python3'"):
        HumanEvalTask(sandbox={"python": "/no/python3"})
