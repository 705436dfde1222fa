"""Teacher rounds without Monarch: which states a step's rollouts send to the teachers.

States are drawn evenly from every imperfect rollout's turns. Taking the worst rollouts first sent
only the turns of episodes that failed earliest (a guess where a lookup was due): every pair was
mined at a first turn, none where the teachers answer, and replay pushed the policy off answering."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from meshrl.actors.teacher import TeacherAnswers
from meshrl.configs.loader import load_config
from meshrl.rollouts.episodes import Rollout
from meshrl.run.record import Timeline
from meshrl.run.teachers import TeacherRounds
from meshrl.tasks import function_demos
from meshrl.tasks.base import Prompt
from meshrl.tasks.exercises import ExercisesTask
from meshrl.teachers.oracle import OracleTeacher


def _rollout(name: str, turns: int, reward: float) -> Rollout:
    """An episode of `turns` assistant turns: lookups, then an answer."""
    prompt = Prompt(name, [{"role": "user", "content": 'Value of "a"?'}])
    messages, ids, mask = list(prompt.messages), [1], [False]
    for t in range(turns - 1):
        call = {"id": f"c{t}", "type": "function", "function": {"name": "lookup", "arguments": {"key": "a"}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "content": "12", "tool_call_id": f"c{t}"}]  # fmt: skip
        ids, mask = ids + [5, 6, 7], mask + [True, True, False]
    messages.append({"role": "assistant", "content": "12"})
    ids, mask = ids + [8], mask + [True]
    return Rollout(prompt, messages, ids, mask, [0.0] * len(ids), [0] * sum(mask), reward=reward)


class FakeTeacher:
    """A teacher actor that keeps the states of each round it is sent (and never answers)."""

    def __init__(self) -> None:
        self.rounds: list[tuple[list[Any], list[dict[str, Any]]]] = []
        self.replay = self

    def call_one(self, states: list[Any], contexts: list[dict[str, Any]], elsewhere: float) -> None:
        self.rounds.append((states, contexts))


class FakeMeshes:
    def __init__(self) -> None:
        self.teachers = [FakeTeacher()]


def test_states_are_drawn_from_every_imperfect_rollout_not_the_worst_first(tmp_path):
    config = load_config(["--output-dir", str(tmp_path), "--teachers.states_per_step", "8"])
    meshes = FakeMeshes()
    rounds = TeacherRounds(config, meshes, offline=[], timeline=Timeline())
    guesses = [_rollout(f"guess{i}", turns=1, reward=0.0) for i in range(8)]  # answered at once, wrong
    looked_up = [_rollout(f"lookup{i}", turns=2, reward=0.4) for i in range(8)]  # looked up, answered wrong
    solved = [_rollout(f"solved{i}", turns=2, reward=1.0) for i in range(8)]
    rounds.round(guesses + looked_up + solved, step=0)
    ((states, contexts),) = meshes.teachers[0].rounds
    assert len(states) == 8
    assert [s for s in states if any(m["role"] == "tool" for m in s)]  # a state where the teachers answer
    drawn_from = {c["prompt"].prompt_id.rstrip("0123456789") for c in contexts}
    assert "solved" not in drawn_from and drawn_from <= {"guess", "lookup"}


class AnsweringTeacher:
    """A teacher actor whose one teacher is the task's oracle, answering each round at once."""

    def __init__(self, task: ExercisesTask) -> None:
        self.oracle = OracleTeacher(task)
        self.replay = self

    def call_one(self, states: list[Any], contexts: list[dict[str, Any]], elsewhere: float) -> Any:
        answers = TeacherAnswers([{"oracle": self.oracle.act(s, c)} for s, c in zip(states, contexts)], {})
        return SimpleNamespace(get=lambda timeout: answers)


@pytest.mark.parametrize("agree_by", ["text", "outcome"])
def test_by_outcome_a_round_is_mined_with_the_task_s_labels_of_the_student_s_and_the_oracle_s_actions(
    tmp_path, agree_by
):
    """An exercise's episode that ran the reference written its own way (a passing run), then answered
    wrong. By text the oracle's run rejects the student's; by outcome only the wrong answer is a pair."""
    task = ExercisesTask(tiers=[1], count=20, split="all", run_python=True, max_turns=4,
                         sandbox={"pool_size": 2, "wall_time_s": 60})  # fmt: skip
    prompt = task.sample_prompts(random.Random(0), 1)[0]
    own_run = function_demos.reference_run(task.problems[prompt.answer]).replace(
        "\nresult =", "\n# the example\nresult ="
    )
    call = {"id": "c0", "type": "function", "function": {"name": "run_python", "arguments": {"code": own_run}}}
    ran = task.call_tool(prompt, "run_python", {"code": own_run})
    messages = [*prompt.messages, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": ran.content, "tool_call_id": "c0"},
                {"role": "assistant", "content": "```python\ndef nothing():\n    return None\n```"}]  # fmt: skip
    episode = Rollout(prompt, messages, [1, 5, 6, 7, 8], [False, True, True, False, True], [0.0] * 5, [0, 0, 0],
                      reward=0.0)  # fmt: skip
    config = load_config(["--output-dir", str(tmp_path), "--teachers.agree_by", agree_by,
                          "--teachers.members", '[{"backend": "oracle"}]', "--teachers.min_agree", "1"])  # fmt: skip
    meshes = FakeMeshes()
    meshes.teachers = [AnsweringTeacher(task)]
    rounds = TeacherRounds(config, meshes, [], Timeline(), task if agree_by == "outcome" else None)
    rounds.round([episode], step=0)
    rounds.round([], step=1)
    rejected = [pair.rejected for pair in rounds.take_pairs()]
    counts = {key: value for key, value in rounds.round([], step=2).items() if key.startswith("teacher/mined_")}
    task.sandbox.close()
    assert ran.is_error is False
    assert [bool(r.get("tool_calls")) for r in rejected] == ([True, False] if agree_by == "text" else [False])
    pairs, agrees = (2, 0) if agree_by == "text" else (1, 1)  # by outcome the student's run is the oracle's
    assert counts == {"teacher/mined_pair": pairs, "teacher/mined_student_agrees": agrees,
                      "teacher/mined_no_consensus": 0, "teacher/mined_no_answer": 0}  # fmt: skip
