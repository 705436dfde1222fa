"""The generated code exercises: deterministic from their seed, split into training and held-out
problems, and graded through the real sandbox like HumanEval. The red team: answers that ignore
the problem (a constant, the docstring's example, the argument itself, an object equal to
everything) score 0 on every family; on every generated exercise no constant or echo passes the
hidden tests. The sandbox-level cheats (exits, forged results lines, patched builtins) go through
the same scorer and are in tests/test_reward_redteam.py."""

from __future__ import annotations

import ast
import functools
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from meshrl.tasks import function_demos
from meshrl.tasks.base import Ending
from meshrl.tasks.exercises import FAMILIES, ExercisesTask, exercises
from meshrl.tasks.humaneval import record, replay
from meshrl.teachers.oracle import OracleTeacher
from meshrl.traces.pairs import ReplayState, action_message, mine_pairs, outcome_key, trace_states
from meshrl.traces.schema import Turn


@pytest.fixture(scope="module")
def task() -> ExercisesTask:
    task = ExercisesTask(tiers=[1, 2, 3], count=300, split="all", sandbox={"pool_size": 4, "wall_time_s": 60})
    yield task
    task.sandbox.close()


@pytest.fixture(scope="module")
def tool_task() -> ExercisesTask:
    """The same exercises with `run_python`, over up to 4 turns."""
    task = ExercisesTask(tiers=[1, 2, 3], count=300, split="all", run_python=True, max_turns=4,
                         sandbox={"pool_size": 4, "wall_time_s": 60})  # fmt: skip
    yield task
    task.sandbox.close()


def answered(task: ExercisesTask, task_id: str, answer: str) -> float:
    prompt = task.prompt(task_id)
    messages = [*prompt.messages, {"role": "assistant", "content": answer}]
    return task.score(prompt, messages, Ending("agent_completed", "stop")).reward


def oracle_episode(task: ExercisesTask, prompt) -> list[dict]:
    """The oracle's own episode from the prompt: its actions, its calls run through the task's tool,
    until it answers."""
    messages = list(prompt.messages)
    while True:
        action = task.oracle_action(prompt, messages)
        messages.append(action)
        if not action.get("tool_calls"):
            return messages
        for call in action["tool_calls"]:
            result = task.call_tool(prompt, call["function"]["name"], call["function"]["arguments"])
            messages.append({"role": "tool", "content": result.content, "tool_call_id": call["id"]})


def one_per_family(task: ExercisesTask) -> dict[str, str]:
    """The first exercise of each family."""
    found: dict[str, str] = {}
    for task_id, problem in task.problems.items():
        found.setdefault(problem["family"], task_id)
    return found


def example(problem: dict) -> tuple[str, str]:
    """The docstring's worked example: the call's argument text and its result's."""
    lines = problem["prompt"].split("\n")
    call = next(line for line in lines if line.strip().startswith(">>>"))
    result = lines[lines.index(call) + 1].strip()
    return call.split("(", 1)[1].rsplit(")", 1)[0], result


def test_the_same_seed_draws_the_same_exercises_and_the_split_holds_out_every_fifth():
    assert exercises(3, 40, (1, 2)) == exercises(3, 40, (1, 2))
    assert exercises(3, 40, (1, 2)) != exercises(4, 40, (1, 2))
    train = ExercisesTask(count=50, sandbox={"pool_size": 1})
    held_out = [prompt.prompt_id for prompt in train.eval_prompts(None, 100)]
    assert len(held_out) == 10 and not set(held_out) & set(train.split_ids) and len(train.split_ids) == 40
    assert {problem["family"] for problem in train.problems.values()} == {f.__name__ for f in FAMILIES[1] + FAMILIES[2]}
    assert {problem["family"] for problem in exercises(0, 40, (3,))} == {f.__name__ for f in FAMILIES[3]}
    with pytest.raises(ValueError, match="task.kwargs.tiers"):
        ExercisesTask(tiers=[4])
    train.sandbox.close()


def test_a_prompt_shows_the_signature_and_one_example_and_never_the_hidden_tests(task):
    for task_id in list(task.problems)[:30]:
        problem, prompt = task.problems[task_id], task.prompt(task_id)
        text = "\n".join(m["content"] for m in prompt.messages)
        assert f"def {problem['entry_point']}(" in text and ">>>" in text
        hidden = [ast.unparse(node) for node in ast.walk(ast.parse(problem["test"])) if isinstance(node, ast.Assert)]
        assert len(hidden) == 6 and "assert" not in text and "check" not in text


def test_on_every_exercise_no_constant_and_no_echo_passes_the_hidden_tests(task):
    """On the host, through the trusted replay: every generated exercise of three seeds fails an
    answer that returns any one of its own results, its example's result, or its argument."""
    for seed in (0, 1, 2):
        for problem in exercises(seed, 300, (1, 2, 3)):
            recording = record(problem)
            calls = len(recording.calls)
            namespace: dict = {}
            exec(problem["prompt"] + problem["canonical_solution"], namespace)
            solve = namespace[problem["entry_point"]]
            right = [("ok", solve(*args, **kwargs)) for args, kwargs in recording.calls]
            assert replay(problem, recording, right), problem["task_id"]
            constants = {repr(value): value for _, value in right} | {"example": ast.literal_eval(example(problem)[1])}
            for value in constants.values():
                assert not replay(problem, recording, [("ok", value)] * calls), (problem["prompt"], value)
            echo = [("ok", args[0]) for args, _ in recording.calls]
            assert not replay(problem, recording, echo), problem["prompt"]


CHEATS = {
    "the_example_s_result_for_every_call": "def {entry}(*args):\n    return {result}\n",
    "the_example_s_result_for_its_call_and_the_argument_otherwise":
        "def {entry}(*args):\n    if args == ({args},):\n        return {result}\n    return args[0]\n",
    "the_argument_itself": "def {entry}(x):\n    return x\n",
    "true": "def {entry}(*args):\n    return True\n",
    "false": "def {entry}(*args):\n    return False\n",
    "zero": "def {entry}(*args):\n    return 0\n",
    "an_empty_list": "def {entry}(*args):\n    return []\n",
    "an_object_equal_to_everything":
        "class Equal:\n    __eq__ = lambda self, other: True\n    __hash__ = lambda self: 0\n"
        "def {entry}(*args):\n    return Equal()\n",
    "the_docstring_only": "def {entry}(*args):\n    '''{doc}'''\n",
    "no_code_just_the_example": "{entry}({args}) returns {result}",
}  # fmt: skip


@pytest.mark.slow
def test_every_family_s_oracle_answer_passes_and_every_cheat_scores_0(task, tool_task):
    families = one_per_family(task)
    assert len(families) == sum(len(f) for f in FAMILIES.values())  # every family is among 300 exercises

    def scores(task_id: str) -> tuple[float, dict[str, float]]:
        problem = task.problems[task_id]
        args, result = example(problem)
        doc = problem["prompt"].split('"""')[1]
        prompt = task.prompt(task_id)
        episode = oracle_episode(tool_task, prompt)  # with run_python: it runs the reference, then answers
        assert [m["role"] for m in episode[len(prompt.messages) :]] == ["assistant", "tool", "assistant"]
        right = min(task.reward(prompt, oracle_episode(task, prompt)), tool_task.reward(prompt, episode))
        cheats = {name: answered(task, task_id, cheat.format(entry=problem["entry_point"], args=args, result=result,
                                                             doc=doc.replace("'", "")))
                  for name, cheat in CHEATS.items()}  # fmt: skip
        return right, cheats

    with ThreadPoolExecutor(4) as pool:
        results = dict(zip(families.values(), pool.map(scores, families.values())))
    assert {task_id: right for task_id, (right, _) in results.items() if right != 1.0} == {}
    passed = {(task.problems[t]["entry_point"], name) for t, (_, cheats) in results.items()
              for name, reward in cheats.items() if reward != 0.0}  # fmt: skip
    assert passed == set()


def test_the_oracle_teacher_runs_the_reference_then_answers_and_the_demonstrations_are_the_sampled_prompts_solved(
    tool_task,
):
    """The replay channel's oracle teachers and the warm start read the task's reference solutions.
    The oracle follows the demonstrations' loop from any state: it runs the reference on the example
    until a run of the episode has passed (after a failed run too), then answers with a function
    that scores 1, and at the last turn it answers whatever came before. So it agrees with every
    turn of a demonstration but a bugged run: the only replay pair a demonstration gives. Each
    demonstration is the prompt the same rng draws, answered with a passing function."""
    prompt = tool_task.sample_prompts(random.Random(0), 1)[0]
    oracle = OracleTeacher(tool_task)
    first = oracle.act(prompt.messages, {"prompt": prompt})
    (call,) = first["tool_calls"]
    failed = tool_task.call_tool(prompt, "run_python", {"code": "raise SystemExit(3)"})
    ran = tool_task.call_tool(prompt, call["function"]["name"], call["function"]["arguments"])
    assert failed.is_error and not ran.is_error
    state = [*prompt.messages, first, {"role": "tool", "content": failed.content, "tool_call_id": call["id"]}]
    assert oracle.act(state, {"prompt": prompt})["tool_calls"][0]["function"] == call["function"]
    state[-1] = {"role": "tool", "content": ran.content, "tool_call_id": call["id"]}
    answer = oracle.act(state, {"prompt": prompt})
    assert "tool_calls" not in answer and tool_task.reward(prompt, [*state, answer]) == 1.0
    at_the_cap = [
        *prompt.messages,
        *[first, {"role": "tool", "content": failed.content, "tool_call_id": call["id"]}] * 3,
    ]
    assert oracle.act(at_the_cap, {"prompt": prompt}) == answer  # max_turns = 4: the 4th turn answers
    demos = tool_task.demonstrations(random.Random(1), 6)
    drawn = tool_task.sample_prompts(random.Random(1), 6)
    assert [d.trace_id for d in demos] == [p.prompt_id for p in drawn]
    for demo, prompt in zip(demos, drawn):
        assert [t.content for t in demo.turns[: len(prompt.messages)]] == [m["content"] for m in prompt.messages]
        answer = {"role": "assistant", "content": demo.turns[-1].content}
        assert demo.final_reward == 1.0 and tool_task.reward(prompt, [*prompt.messages, answer]) == 1.0
        pairs = [mine_pairs(state, {"oracle": oracle.act(state.state_messages, {"prompt": prompt})}, 1)
                 for state in trace_states(demo)]  # fmt: skip
        bugged = [t for t in demo.turns if t.role == "tool" and t.is_error]
        assert [pair.turn_index for pair in pairs if pair] == [len(prompt.messages)] * len(bugged)
    assert {len([t for t in d.turns if t.role == "tool" and t.is_error]) for d in demos} == {0, 1}


def test_by_outcome_the_oracle_and_a_model_agree_on_what_their_code_does_and_a_correct_student_is_not_rejected(
    tool_task,
):
    """`teachers.agree_by = "outcome"`: actions are equal when the task grades them alike. A run of
    the reference written otherwise passes as the oracle's run does, so no pair rejects it (by text
    it is rejected); a failing run is still rejected, and with the oracle and a model teacher whose
    own run also passes (min_agree 2) the chosen side is the model's words, first in members order.
    Answers agree when both pass the tests. The student cannot forge a passing run: printing the
    sandbox's report and exiting 1 is a failing run."""
    prompt = tool_task.sample_prompts(random.Random(3), 1)[0]
    problem = tool_task.problems[prompt.answer]
    oracle = OracleTeacher(tool_task).act(prompt.messages, {"prompt": prompt})
    own_run = function_demos.reference_run(problem).replace("\nresult =", "\n# checking the example\nresult =")

    def run(code: str) -> Turn:
        return Turn(
            role="assistant", content="", tool_calls=[{"id": "c1", "name": "run_python", "arguments": {"code": code}}]
        )

    def at_start(student: Turn) -> ReplayState:
        return ReplayState(trace_id=prompt.prompt_id, turn_index=len(prompt.messages),
                           state_messages=prompt.messages, student_action=student)  # fmt: skip

    def by_outcome() -> Callable:
        return outcome_key(functools.partial(tool_task.action_outcome, prompt, prompt.messages))

    correct, failing = at_start(run(own_run)), at_start(run("raise SystemExit(3)"))
    forged = at_start(run("print('[exit status 0]')\nraise SystemExit(1)"))
    assert mine_pairs(correct, {"oracle": oracle}, 1) is not None  # by text: rejected for its wording
    assert mine_pairs(correct, {"oracle": oracle}, 1, by_outcome()) is None
    for student in (failing, forged):
        pair = mine_pairs(student, {"oracle": oracle}, 1, by_outcome())
        assert pair is not None and pair.chosen["tool_calls"][0]["arguments"] == {
            "code": function_demos.reference_run(problem)
        }
    model = action_message(run(own_run))
    pair = mine_pairs(failing, {"model": model, "oracle": oracle}, 2, by_outcome())
    assert pair.teachers == ["model", "oracle"] and pair.chosen == model
    assert mine_pairs(failing, {"model": model, "oracle": oracle}, 2) is None  # by text they never agree
    wrong = {
        "role": "assistant",
        "content": "```python\n" + function_demos.function(problem, "    return None\n") + "```",
    }
    right = {"role": "assistant", "content": function_demos.answer(problem)}
    written_otherwise = {
        "role": "assistant",
        "content": function_demos.answer(problem).replace("```python\n", "```python\n# mine\n"),
    }
    labels = {name: tool_task.action_outcome(prompt, prompt.messages, action)
              for name, action in {"wrong": wrong, "right": right, "otherwise": written_otherwise}.items()}  # fmt: skip
    assert labels == {"wrong": "answer fails", "right": "answer passes", "otherwise": "answer passes"}
    two_calls = {**action_message(run(own_run))}
    two_calls["tool_calls"] = two_calls["tool_calls"] * 2
    assert tool_task.action_outcome(prompt, prompt.messages, two_calls) is None  # left to its text
