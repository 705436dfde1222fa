"""Teacher-replay pair mining: where teachers agree on a better action than the student's.

Each assistant turn of a trace is a state (the turns before it) and the student's action
there. Teachers replay the state; when enough of them agree on one action that differs
from the student's, that action is `chosen` and the student's is `rejected`. One pair is
one JSON object per line (`DpoPair.to_json()`):

    {"trace_id", "turn_index", "state_messages": [turn, ...],
     "chosen": {"role": "assistant", "content", "tool_calls"?},
     "rejected": {"role": "assistant", "content", "tool_calls"?},
     "n_teachers_agreeing", "teachers": [name, ...], "n_teachers",
     "prompt_token_ids"?, "rejected_token_ids"?}

Turns are the schema's `Turn` dumped without None fields; `chosen` and `rejected` keep
only the action (content and tool calls), none of a turn's annotations. `teachers` are
the agreeing teachers' names, sorted; `n_teachers` counts the teachers that answered.
When the student's turn was sampled by the policy (a rollout), the pair also keeps the exact
ids before that turn and the ids it sampled: the rejected row is those ids, not a re-rendering
of the parsed action (which would push down a string the policy never wrote).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from meshrl.inference.toolcalls import REASONING
from meshrl.traces.schema import TraceExample, Turn

Action = Turn | Mapping[str, Any]


class ReplayState(BaseModel):
    """One assistant turn of a trace: what the teachers replay, and what the student did."""

    model_config = ConfigDict(extra="forbid")

    trace_id: str
    turn_index: int
    state_messages: list[dict[str, Any]]
    student_action: Turn
    prompt_token_ids: list[int] | None = None  # sampled turns: the exact ids before it
    student_token_ids: list[int] | None = None  # sampled turns: the ids the policy sampled


class DpoPair(BaseModel):
    model_config = ConfigDict(extra="forbid")

    trace_id: str
    turn_index: int
    state_messages: list[dict[str, Any]]
    chosen: dict[str, Any]
    rejected: dict[str, Any]
    n_teachers_agreeing: int
    teachers: list[str]
    n_teachers: int
    prompt_token_ids: list[int] | None = None
    rejected_token_ids: list[int] | None = None

    def to_json(self) -> str:
        return self.model_dump_json()


def _as_action(action: Action) -> Turn:
    """The assistant `Turn` an action denotes (tool-call arguments may be a JSON string, the
    OpenAI wire form: parsed, so argument spacing never reaches the key)."""
    turn = Turn.from_message(action)
    if turn.role != "assistant":
        raise ValueError(f"an action is an assistant turn, got role {turn.role!r}")
    return turn


def _canonical(value: Any) -> Any:
    """Integral floats become ints so 1 and 1.0 agree; bools stay bools."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, Mapping):
        return {key: _canonical(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_canonical(item) for item in value]
    return value


def normalize_action(turn: Action) -> str:
    """A key equal for actions that differ only in formatting or in reasoning.

    Reasoning (`<think>…</think>`, an unclosed one to the end) is how the action was reached,
    not the action: a thinking student and non-thinking teachers that make the same call agree.
    Text: whitespace runs collapse to one space and the ends are stripped; case is kept.
    Tool calls: name and arguments in call order; argument keys sorted, integral floats
    as ints, call ids dropped. Whitespace inside argument values is data and is kept.
    """
    action = _as_action(turn)
    calls = [[call.name, _canonical(call.arguments)] for call in action.tool_calls or []]
    key = {"content": " ".join(REASONING.sub("", action.content).split()), "tool_calls": calls}
    return json.dumps(key, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def outcome_key(outcome: Callable[[dict[str, Any]], str | None]) -> Callable[[Action], str]:
    """A key for `mine_pairs` that tells actions apart by what they do at one state: `outcome`'s
    label of the action's message, asked once per distinct text (a label may cost a sandboxed
    run); where it returns None, the action's text stands for it."""
    labels: dict[str, str] = {}

    def key(action: Action) -> str:
        text = normalize_action(action)
        if text not in labels:
            label = outcome(action_message(action))
            labels[text] = text if label is None else f"outcome: {label}"
        return labels[text]

    return key


def action_message(action: Action) -> dict[str, Any]:
    """An action as an assistant chat message (flat tool calls), without a trace turn's annotations."""
    turn = _as_action(action)
    return Turn(role="assistant", content=turn.content, tool_calls=turn.tool_calls).model_dump(exclude_none=True)


def trace_states(example: TraceExample) -> list[ReplayState]:
    """One state per assistant turn, its messages being every turn before it (and, for a sampled
    turn, the exact ids before it and the ids it sampled). In a sampled trace (one with its ids)
    only the sampled turns are the student's: its prompt's assistant turns (few-shot examples)
    are context."""
    states = []
    for index, turn in enumerate(example.turns):
        if turn.role != "assistant" or (example.token_ids is not None and turn.token_span is None):
            continue
        prompt_ids, sampled = example.sampled_ids(turn) or (None, None)
        states.append(
            ReplayState(
                trace_id=example.trace_id,
                turn_index=index,
                state_messages=[t.model_dump(exclude_none=True, exclude={"token_span"}) for t in example.turns[:index]],
                student_action=turn,
                prompt_token_ids=prompt_ids,
                student_token_ids=sampled,
            )
        )
    return states


Why = Literal["pair", "student_agrees", "no_consensus", "no_answer"]  # what mining a state gave


@dataclass(frozen=True)
class Mined:
    """What mining one state gave: its pair, or why none (`teacher/mined_<why>` counts them)."""

    pair: DpoPair | None
    why: Why


def mine_pairs(
    state: ReplayState,
    teacher_actions: Mapping[str, Action | None],
    min_agree: int,
    key: Callable[[Action], str] = normalize_action,
) -> DpoPair | None:
    """The pair at this state when at least `min_agree` teachers agree on another action (`mine`)."""
    return mine(state, teacher_actions, min_agree, key).pair


def mine(
    state: ReplayState,
    teacher_actions: Mapping[str, Action | None],
    min_agree: int,
    key: Callable[[Action], str] = normalize_action,
) -> Mined:
    """The pair at this state when at least `min_agree` teachers agree on another action, or why
    there is none: every teacher failed (`no_answer`), no action has `min_agree` teachers or two
    tie for largest (`no_consensus`), or the consensus is the student's own action
    (`student_agrees`).

    Teachers that failed (None) are left out. Actions are equal when `key` says so (their text,
    by default; the task's outcome with `teachers.agree_by = "outcome"`), the student's too. The
    largest group of equal actions is the consensus; a tie for largest gives no pair, since no
    action is the teachers' answer. `chosen` is the first agreeing teacher's action (in mapping
    order).
    """
    if min_agree < 1:
        raise ValueError(f"min_agree must be at least 1, got {min_agree}")
    groups: dict[str, list[tuple[str, Turn]]] = {}
    for name, action in teacher_actions.items():
        if action is not None:
            turn = _as_action(action)
            groups.setdefault(key(turn), []).append((name, turn))
    if not groups:
        return Mined(None, "no_answer")
    sizes = sorted((len(members) for members in groups.values()), reverse=True)
    consensus, members = max(groups.items(), key=lambda item: len(item[1]))
    if (len(sizes) > 1 and sizes[0] == sizes[1]) or len(members) < min_agree:
        return Mined(None, "no_consensus")
    if consensus == key(state.student_action):
        return Mined(None, "student_agrees")
    pair = DpoPair(
        trace_id=state.trace_id,
        turn_index=state.turn_index,
        state_messages=state.state_messages,
        chosen=action_message(members[0][1]),
        rejected=action_message(state.student_action),
        n_teachers_agreeing=len(members),
        teachers=sorted(name for name, _ in members),
        n_teachers=sum(len(m) for m in groups.values()),
        prompt_token_ids=state.prompt_token_ids,
        rejected_token_ids=state.student_token_ids,
    )
    return Mined(pair, "pair")
