"""Teacher rounds without Monarch: which states a step's rollouts send to the teachers.

States are drawn evenly from every imperfect rollout's turns. Taking the worst rollouts first sent
only the turns of episodes that failed earliest (a guess where a lookup was due): every pair was
mined at a first turn, none where the teachers answer, and replay pushed the policy off answering."""

from __future__ import annotations

from typing import Any

from meshrl.configs.loader import load_config
from meshrl.rollouts.episodes import Rollout
from meshrl.run.record import Timeline
from meshrl.run.teachers import TeacherRounds
from meshrl.tasks.base import Prompt


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
