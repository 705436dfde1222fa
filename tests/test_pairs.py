"""Teacher-replay pair mining: action keys, consensus rules and states built from a trace."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshrl.traces.pairs import DpoPair, ReplayState, mine, mine_pairs, normalize_action, outcome_key, trace_states
from meshrl.traces.schema import ToolCall, TraceExample, Turn


def act(content: str = "", *calls: tuple[str, dict]) -> Turn:
    tool_calls = [ToolCall(id=f"call_{i}", name=n, arguments=a) for i, (n, a) in enumerate(calls)]
    return Turn(role="assistant", content=content, tool_calls=tool_calls or None)


def state(student: Turn) -> ReplayState:
    messages = [{"role": "user", "content": "list the files"}]
    return ReplayState(trace_id="t1", turn_index=1, state_messages=messages, student_action=student)


LS = act("Listing.", ("bash", {"cmd": "ls", "timeout": 10}))
CAT = act("Reading.", ("read", {"path": "a.txt"}))
PWD = act("Where am I?", ("bash", {"cmd": "pwd"}))


# --- normalize_action: what compares equal ----------------------------------------------


def test_whitespace_in_text_collapses_and_strips():
    spaced = act("  Listing \n\t the  files. ")
    assert normalize_action(spaced) == normalize_action(act("Listing the files."))


def test_argument_key_order_numbers_and_ids_are_ignored():
    arguments = {"cmd": "ls", "timeout": 10, "opts": {"b": 2, "a": 1}}
    a = Turn(
        role="assistant",
        content="x",
        tool_calls=[ToolCall(id="toolu_01", name="bash", arguments=arguments)],
    )
    reordered = {"opts": {"a": 1.0, "b": 2}, "timeout": 10.0, "cmd": "ls"}
    b = {
        "role": "assistant",
        "content": "x",
        "tool_calls": [{"id": "call_zz", "name": "bash", "arguments": reordered}],
    }
    assert normalize_action(a) == normalize_action(b)


def test_json_string_arguments_with_any_spacing_match_dict_arguments():
    def wire(call_id: str, arguments: str) -> dict:
        call = {"id": call_id, "name": "bash", "arguments": arguments}
        return {"role": "assistant", "content": "x", "tool_calls": [call]}

    spaced = wire("1", '{ "cmd" :  "ls",\n "n": 1 }')
    tight = wire("2", '{"n":1.0,"cmd":"ls"}')
    as_dict = act("x", ("bash", {"cmd": "ls", "n": 1}))
    assert normalize_action(spaced) == normalize_action(tight) == normalize_action(as_dict)


def test_no_tool_calls_and_empty_tool_calls_agree():
    empty = {"role": "assistant", "content": "done", "tool_calls": []}
    assert normalize_action(empty) == normalize_action(act("done"))


# --- normalize_action: what stays different ---------------------------------------------


@pytest.mark.parametrize(
    "other",
    [
        act("Listing.", ("sh", {"cmd": "ls", "timeout": 10})),  # tool name
        act("Listing.", ("bash", {"cmd": "ls -a", "timeout": 10})),  # argument value
        act("Listing.", ("bash", {"cmd": "ls", "timeout": 10.5})),  # non-integral number
        act("Listing.", ("bash", {"cmd": "ls", "timeout": True})),  # bool is not a number
        act("Listing.", ("bash", {"cmd": "ls"})),  # missing argument
        act("Listing!", ("bash", {"cmd": "ls", "timeout": 10})),  # text
        act("listing.", ("bash", {"cmd": "ls", "timeout": 10})),  # text case
        act("Listing."),  # no call
    ],
)
def test_actions_that_differ(other: Turn):
    assert normalize_action(other) != normalize_action(LS)


def test_call_order_matters():
    first = act("", ("read", {"path": "a"}), ("read", {"path": "b"}))
    second = act("", ("read", {"path": "b"}), ("read", {"path": "a"}))
    assert normalize_action(first) != normalize_action(second)


def test_whitespace_inside_argument_values_is_kept():
    double = act("", ("write", {"text": "a  b"}))
    assert normalize_action(double) != normalize_action(act("", ("write", {"text": "a b"})))


def test_non_assistant_action_is_rejected():
    with pytest.raises(ValueError, match="assistant"):
        normalize_action({"role": "user", "content": "hi"})


# --- mine_pairs ---------------------------------------------------------------------------


def test_consensus_reaching_k_is_mined():
    call = {"id": "c9", "name": "read", "arguments": {"path": "a.txt"}}
    same_as_cat = {"role": "assistant", "content": " Reading. ", "tool_calls": [call]}
    teachers = {"opus": CAT, "gpt": same_as_cat, "gemini": PWD}
    pair = mine_pairs(state(LS), teachers, min_agree=2)
    assert pair == DpoPair(
        trace_id="t1",
        turn_index=1,
        state_messages=[{"role": "user", "content": "list the files"}],
        chosen=CAT.model_dump(exclude_none=True),
        rejected=LS.model_dump(exclude_none=True),
        n_teachers_agreeing=2,
        teachers=["gpt", "opus"],
        n_teachers=3,
    )


def test_chosen_is_the_first_agreeing_teachers_action():
    variant = act("Reading.  ", ("read", {"path": "a.txt"}))
    pair = mine_pairs(state(LS), {"zeta": variant, "alpha": CAT}, min_agree=2)
    assert pair is not None
    assert pair.chosen == variant.model_dump(exclude_none=True)
    assert pair.teachers == ["alpha", "zeta"]


def test_k_not_reached_gives_none():
    assert mine_pairs(state(LS), {"a": CAT, "b": CAT, "c": PWD}, min_agree=3) is None


def test_consensus_equal_to_student_gives_none():
    same_as_student = act(" Listing. ", ("bash", {"timeout": 10.0, "cmd": "ls"}))
    assert mine_pairs(state(LS), {"a": same_as_student, "b": LS, "c": CAT}, min_agree=1) is None


def test_reasoning_is_not_part_of_the_action():
    """A thinking student that makes the teachers' call is no pair (DPO would learn to drop its
    reasoning); one that thinks and makes another call still is."""
    thinking = act(
        "<think>\nThe user wants the files: ls.\n</think>\n\nListing.", ("bash", {"cmd": "ls", "timeout": 10})
    )
    assert normalize_action(thinking) == normalize_action(LS)
    assert normalize_action(act("<think></think>Listing.", ("bash", {"cmd": "ls", "timeout": 10}))) == normalize_action(
        LS
    )
    assert mine_pairs(state(thinking), {"a": LS, "b": LS}, min_agree=2) is None
    wrong = act("<think>\nmaybe pwd first\n</think>\n\nWhere am I?", ("bash", {"cmd": "pwd"}))
    pair = mine_pairs(state(wrong), {"a": LS, "b": LS}, min_agree=2)
    assert pair is not None and pair.rejected["content"] == wrong.content  # the student's turn as it was


def test_tie_for_largest_group_gives_none():
    assert mine_pairs(state(LS), {"a": CAT, "b": CAT, "c": PWD, "d": PWD}, min_agree=1) is None
    assert mine_pairs(state(LS), {"a": CAT, "b": PWD}, min_agree=1) is None


def test_tie_with_the_students_action_gives_none():
    assert mine_pairs(state(LS), {"a": CAT, "b": LS}, min_agree=1) is None


def test_failed_teachers_are_ignored():
    pair = mine_pairs(state(LS), {"a": CAT, "b": None, "c": CAT, "d": None}, min_agree=2)
    assert pair is not None
    assert (pair.n_teachers_agreeing, pair.teachers, pair.n_teachers) == (2, ["a", "c"], 2)
    assert mine_pairs(state(LS), {"a": None, "b": None}, min_agree=1) is None
    assert mine_pairs(state(LS), {}, min_agree=1) is None


def test_min_agree_below_one_raises():
    with pytest.raises(ValueError, match="min_agree"):
        mine_pairs(state(LS), {"a": CAT}, min_agree=0)


def test_rejected_and_chosen_keep_only_the_action():
    student = LS.model_copy(update={"tool_error": "command_not_found"})
    pair = mine_pairs(state(student), {"a": CAT}, min_agree=1)
    assert pair is not None
    assert pair.rejected == LS.model_dump(exclude_none=True)


def test_pair_json_round_trips():
    pair = mine_pairs(state(LS), {"a": CAT}, min_agree=1)
    assert pair is not None
    assert DpoPair.model_validate_json(pair.to_json()) == pair


def test_mining_says_why_a_state_gave_no_pair():
    assert mine(state(LS), {"a": None, "b": None}, min_agree=1).why == "no_answer"
    assert mine(state(LS), {"a": CAT, "b": PWD}, min_agree=1).why == "no_consensus"  # a tie
    assert mine(state(LS), {"a": CAT, "b": None}, min_agree=2).why == "no_consensus"  # too few agree
    assert mine(state(LS), {"a": LS, "b": LS, "c": CAT}, min_agree=2).why == "student_agrees"
    mined = mine(state(LS), {"a": CAT, "b": CAT}, min_agree=2)
    assert mined.why == "pair" and mined.pair == mine_pairs(state(LS), {"a": CAT, "b": CAT}, min_agree=2)


def test_by_outcome_actions_written_apart_agree_each_text_is_labelled_once_and_an_unlabelled_one_is_its_text():
    """`outcome_key`: the label of what an action does groups teachers and matches the student; a
    label is asked once per distinct text (a sandboxed run each); None leaves the action's text."""
    asked: list[str] = []

    def outcome(message: dict) -> str | None:
        cmd = message["tool_calls"][0]["arguments"].get("cmd", "") if message.get("tool_calls") else ""
        asked.append(cmd)
        return {"ls": "lists", "ls -1": "lists", "ls  -a": "lists"}.get(cmd)

    listing = act("Listing one a line.", ("bash", {"cmd": "ls -1"}))
    pair = mine_pairs(state(CAT), {"a": LS, "b": listing, "c": PWD}, min_agree=2, key=outcome_key(outcome))
    assert pair is not None and pair.teachers == ["a", "b"] and pair.chosen == LS.model_dump(exclude_none=True)
    assert mine_pairs(state(CAT), {"a": LS, "b": listing, "c": PWD}, min_agree=2) is None  # by text: three answers
    key = outcome_key(outcome)
    assert mine_pairs(state(listing), {"a": LS, "b": LS}, min_agree=2, key=key) is None  # the student lists too
    assert sorted(asked[-2:]) == ["ls", "ls -1"]  # LS asked once for two teachers
    assert key(PWD) == normalize_action(PWD) and key(CAT) != key(PWD)  # unlabelled: their texts


# --- trace_states -------------------------------------------------------------------------


def test_states_are_the_assistant_turns_with_their_prefixes():
    turns = [
        Turn(role="system", content="be brief"),
        Turn(role="user", content="list the files"),
        LS,
        Turn(role="tool", content="a.txt", tool_call_id="call_0"),
        CAT.model_copy(update={"tool_error": "file_not_found"}),
        Turn(role="tool", content="no such file", tool_call_id="call_0", is_error=True),
        act("It is missing."),
    ]
    example = TraceExample(trace_id="t7", source="run-1", turns=turns)
    states = trace_states(example)
    assert [s.turn_index for s in states] == [2, 4, 6]
    assert all(s.trace_id == "t7" for s in states)
    for s in states:
        assert s.student_action == turns[s.turn_index]
        assert s.state_messages == [t.model_dump(exclude_none=True) for t in turns[: s.turn_index]]
    assert states[0].state_messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "list the files"},
    ]
    assert states[2].state_messages[-1]["is_error"] is True


def test_trace_without_assistant_turns_has_no_states():
    example = TraceExample(trace_id="t", source="s", turns=[Turn(role="user", content="hi")])
    assert trace_states(example) == []


# --- property ----------------------------------------------------------------------------

BASES = [LS, CAT, PWD, act("Done.")]


@st.composite
def variants(draw: st.DrawFn) -> Turn:
    """One of a few base actions, reformatted: padded text, fresh ids, floats for ints."""
    base = draw(st.sampled_from(BASES))
    pad = draw(st.sampled_from(["", " ", "\n", "  \t"]))
    calls = []
    for c in base.tool_calls or []:
        arguments = {
            k: float(v) if type(v) is int and draw(st.booleans()) else v for k, v in reversed(c.arguments.items())
        }
        call_id = draw(st.text(min_size=1, max_size=4))
        calls.append(ToolCall(id=call_id, name=c.name, arguments=arguments))
    content = pad + base.content.replace(" ", "  ") + pad
    return Turn(role="assistant", content=content, tool_calls=calls or None)


@given(
    student=variants(),
    teachers=st.dictionaries(st.text(min_size=1, max_size=3), st.none() | variants(), max_size=7),
    min_agree=st.integers(1, 4),
)
def test_mined_pairs_reject_the_student_and_choose_the_consensus(student, teachers, min_agree):
    pair = mine_pairs(state(student), teachers, min_agree)
    if pair is None:
        return
    student_key = normalize_action(student)
    assert normalize_action(pair.rejected) == student_key
    assert normalize_action(pair.chosen) != student_key
    assert pair.n_teachers_agreeing >= min_agree
    assert pair.n_teachers_agreeing == len(pair.teachers) <= pair.n_teachers
    assert pair.teachers == sorted(pair.teachers)
    chosen_key = normalize_action(pair.chosen)
    assert all(normalize_action(teachers[name]) == chosen_key for name in pair.teachers)
