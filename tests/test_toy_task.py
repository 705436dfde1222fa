from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.inference.toolcalls import MALFORMED, parse_tool_calls
from meshrl.models.tiny import build_tokenizer
from meshrl.tasks.base import Demonstrating, Hinting, Prompt, Task, task_tools
from meshrl.tasks.toy import LOOKUP, LOOKUP_SCHEMA, ToolTask
from meshrl.traces.collator import to_message
from meshrl.traces.schema import TraceExample
from tests.episode_play import play

Message = dict[str, Any]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(512)


@pytest.fixture(scope="module")
def hermes():
    return build_tokenizer(512, "hermes")


def _prompt(seed: int = 0, **kwargs: Any) -> tuple[ToolTask, Prompt]:
    task = ToolTask(**kwargs)
    return task, task.sample_prompts(random.Random(seed), 1)[0]


def _call(key: Any, name: str = LOOKUP, call_id: str = "call_0") -> Message:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": {"key": key}}}]}  # fmt: skip


def _oracle(task: ToolTask, prompt: Prompt) -> Callable[[list[Message]], Message]:
    return lambda messages: task.oracle_action(prompt, messages)


def test_implements_the_protocols():
    task = ToolTask()
    assert isinstance(task, Task) and isinstance(task, Demonstrating) and isinstance(task, Hinting)
    assert task.max_turns == 3


def test_prompts_are_deterministic_in_the_rng():
    task = ToolTask()
    a, b = task.sample_prompts(random.Random(7), 50), task.sample_prompts(random.Random(7), 50)
    assert a == b
    assert a != task.sample_prompts(random.Random(8), 50)


@pytest.mark.parametrize("key_len", [1, 2])
def test_prompts_are_well_formed(key_len):
    task = ToolTask(n_keys=5, key_len=key_len)
    prompts = task.sample_prompts(random.Random(0), 500)
    assert len({p.prompt_id for p in prompts}) == 500
    for p in prompts:
        store, key = p.info["store"], p.info["key"]
        assert len(store) == 5 and len(set(store.values())) == 5
        assert all(len(k) == key_len and k.isalpha() for k in store)
        assert all(len(v) == 2 and v.isdigit() for v in store.values())
        assert p.answer == store[key]
        assert [m["role"] for m in p.messages] == ["system", "user"]
        assert LOOKUP in p.messages[0]["content"] and f'"{key}"' in p.messages[1]["content"]


@pytest.mark.parametrize("kwargs", [{"n_keys": 0}, {"n_keys": 60}, {"max_turns": 1}, {"value_len": 0},
                                    {"recovery_rate": 1.5}, {"max_turns": 2}, {"guess_rate": -0.1}])  # fmt: skip
def test_rejects_impossible_settings(kwargs):
    with pytest.raises(ValueError):
        ToolTask(**kwargs)


def test_oracle_episode_scores_one():
    task = ToolTask()
    for prompt in task.sample_prompts(random.Random(1), 50):
        messages = play(task, prompt, _oracle(task, prompt))
        assert [m["role"] for m in messages[2:]] == ["assistant", "tool", "assistant"]
        assert messages[-1]["content"] == prompt.answer
        assert task.reward(prompt, messages) == 1.0


def test_rubric_gives_partial_credit():
    task, prompt = _prompt()
    key, answer = prompt.info["key"], prompt.answer
    other = next(k for k in prompt.info["store"] if k != key)
    wrong = str(int(answer) % 90 + 10)  # another two-digit number
    start = list(prompt.messages)
    tool = {"role": "tool", "content": answer, "tool_call_id": "call_0"}
    wrong_reply = {"role": "assistant", "content": wrong}

    assert task.reward(prompt, start) == 0.0
    assert task.reward(prompt, [*start, wrong_reply]) == 0.0
    assert task.reward(prompt, [*start, _call(key, name="lookp"), wrong_reply]) == 0.0
    assert task.reward(prompt, [*start, _call(7), wrong_reply]) == 0.0
    assert task.reward(prompt, [*start, _call(other), wrong_reply]) == pytest.approx(0.1)
    assert task.reward(prompt, [*start, _call(key), tool, wrong_reply]) == pytest.approx(0.4)
    assert task.reward(prompt, [*start, _call(key), tool]) == pytest.approx(0.4)  # ran out of turns
    assert task.reward(prompt, [*start, _call(key), tool, {"role": "assistant", "content": f" {answer}\n"}]) == 1.0
    assert task.reward(prompt, [*start, {"role": "assistant", "content": answer}]) == 1.0  # a lucky guess still counts


def test_tool_errors_are_results_not_exceptions():
    task, prompt = _prompt()
    store = prompt.info["store"]
    listing = ", ".join(f'"{k}"' for k in store)

    unknown = task.call_tool(prompt, "search", {"key": prompt.info["key"]})
    assert unknown.is_error and '"search"' in unknown.content and LOOKUP in unknown.content

    missing = task.call_tool(prompt, LOOKUP, {"key": "zzz"})
    assert missing.is_error and missing.content == f'error: no such key "zzz"; keys: {listing}'

    for bad in ({}, {"name": "x"}, {"key": 3}, {"key": None}, "kb", None, ["kb"]):
        result = task.call_tool(prompt, LOOKUP, bad)  # type: ignore[arg-type]
        assert result.is_error and listing in result.content

    ok = task.call_tool(prompt, LOOKUP, {"key": prompt.info["key"]})
    assert not ok.is_error and ok.content == prompt.answer


def test_recovery_after_a_bad_key():
    task, prompt = _prompt(seed=3)
    key = prompt.info["key"]
    error = task.call_tool(prompt, LOOKUP, {"key": key.upper()})
    assert error.is_error and f'"{key}"' in error.content  # the listing shows the key to copy

    def sloppy_first(messages: list[Message]) -> Message:
        return _call(key.upper()) if len(messages) == 2 else task.oracle_action(prompt, messages)

    messages = play(task, prompt, sloppy_first)
    assert [m["role"] for m in messages[2:]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert messages[3]["content"].startswith("error: no such key")
    assert messages[4]["tool_calls"][0]["id"] == "call_1"
    assert task.reward(prompt, messages) == 1.0


def test_hints_point_at_the_fix():
    task = ToolTask()
    bad_key = task.hint("tool_error", {"tool_name": LOOKUP, "excerpt": 'error: no such key "kx"; keys: "kb"'})
    bad_tool = task.hint("tool_error", {"tool_name": "search", "excerpt": 'error: unknown tool "search"'})
    assert bad_key and bad_key.startswith("Hint:") and "listed keys" in bad_key
    assert bad_tool and bad_tool.startswith("Hint:") and "lookup" in bad_tool


def test_demonstrations_replay_and_score_one():
    task = ToolTask()
    demos = task.demonstrations(random.Random(0), 200)
    assert [d.to_json() for d in demos] == [d.to_json() for d in task.demonstrations(random.Random(0), 200)]
    prompts = task.sample_prompts(random.Random(0), 200)  # the demos are episodes of these
    recoveries = 0
    for demo, prompt in zip(demos, prompts):
        assert demo.trace_id == prompt.prompt_id
        assert [to_message(t) for t in demo.turns[:2]] == prompt.messages
        assert TraceExample.model_validate_json(demo.to_json()) == demo
        assert demo.final_reward == 1.0
        episode, key = demo.turns[2:], prompt.info["key"]
        assert sum(t.role == "assistant" for t in episode) <= task.max_turns
        for turn, result in zip(episode, episode[1:]):
            if turn.tool_calls:
                (call,) = turn.tool_calls
                replayed = task.call_tool(prompt, call.name, call.arguments)
                assert (result.role, result.tool_call_id) == ("tool", call.id)
                assert (result.content, bool(result.is_error)) == (replayed.content, replayed.is_error)
        errors = [i for i, t in enumerate(episode) if t.is_error]
        if errors:
            recoveries += 1
            site = episode[errors[0] + 1]
            assert site.tool_error == "tool_error" and site.error_meta is not None
            assert site.error_meta.tool_name == LOOKUP and site.error_meta.excerpt == episode[errors[0]].content
            assert f'"{key}"' in episode[errors[0]].content
        assert [t.tool_error for t in demo.turns].count(None) == len(demo.turns) - len(errors)
        assert task.reward(prompt, [to_message(t) for t in demo.turns]) == 1.0
    assert 0.2 < recoveries / len(demos) < 0.4


def test_guessing_demonstrations_answer_at_once_and_carry_their_reward():
    task = ToolTask(guess_rate=0.5)
    rng = random.Random(3)
    demos = task.demonstrations(rng, 400)
    guesses = [d for d in demos if [t.role for t in d.turns] == ["system", "user", "assistant"]]
    assert 0.4 < len(guesses) / len(demos) < 0.6
    for demo, prompt in zip(demos, task.sample_prompts(random.Random(3), 400)):
        assert demo.final_reward == task.reward(prompt, [to_message(t) for t in demo.turns])
    assert sum(d.final_reward == 1.0 for d in guesses) < 0.1 * len(guesses)  # a guess is rarely the value
    assert all(d.final_reward == 1.0 for d in demos if d not in guesses)
    assert task.demonstrations(random.Random(3), 5) == ToolTask(guess_rate=0.5).demonstrations(random.Random(3), 5)


def test_demonstration_is_short(tokenizer):
    task = ToolTask(recovery_rate=0.0)
    (demo,) = task.demonstrations(random.Random(0), 1)
    text = tokenizer.apply_chat_template([to_message(t) for t in demo.turns], tokenize=False)
    assert len(tokenizer(text)["input_ids"]) < 120


# --------------------------------------------------------------------------- parse_tool_calls

_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30).filter(
    lambda s: "<tool_call>" not in s and "<|" not in s
)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=8,
)
_CALLS = st.lists(st.tuples(_TEXT.filter(bool), st.dictionaries(_TEXT, _JSON, max_size=3)), max_size=3)


def _rendered_completion(tokenizer, content: str, calls: list[tuple[str, dict[str, Any]]]) -> tuple[Message, str]:
    """An assistant message and its completion text as the tiny chat template renders it."""
    message: Message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, (n, a) in enumerate(calls)]  # fmt: skip
    text = tokenizer.apply_chat_template([message], tokenize=False)
    head, foot = "<|im_start|>assistant\n", "<|im_end|>\n"
    assert text.startswith(head) and text.endswith(foot)
    return message, text[len(head) : -len(foot)]


@settings(max_examples=200, deadline=None)
@given(content=_TEXT, calls=_CALLS)
@pytest.mark.parametrize("template", ["chatml", "hermes"])
def test_parse_inverts_the_tiny_templates(tokenizer, hermes, template, content, calls):
    message, completion = _rendered_completion(hermes if template == "hermes" else tokenizer, content, calls)
    if any("</tool_call>" in json.dumps(a, ensure_ascii=False) or "</tool_call>" in n for n, a in calls):
        return  # a closing tag inside the JSON is ambiguous in the template's own format
    parsed_content, parsed_calls = parse_tool_calls(completion)
    assert parsed_content == content
    assert parsed_calls == message.get("tool_calls", [])


def test_parse_round_trips_the_toy_episode(tokenizer):
    task, prompt = _prompt()
    action = task.oracle_action(prompt, prompt.messages)
    _, completion = _rendered_completion(tokenizer, "", [(LOOKUP, {"key": prompt.info["key"]})])
    assert (
        completion == f'\n<tool_call>{{"name": "lookup", "arguments": {{"key": "{prompt.info["key"]}"}}}}</tool_call>'
    )
    assert parse_tool_calls(completion) == ("", action["tool_calls"])
    sampled = tokenizer(completion + "<|im_end|>", add_special_tokens=False)["input_ids"]  # as the rollout decodes
    assert parse_tool_calls(tokenizer.decode(sampled, skip_special_tokens=True)) == ("", action["tool_calls"])
    assert parse_tool_calls(prompt.answer) == (prompt.answer, [])


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "lookup", "arguments": {"key": "kb"}',  # truncated JSON
        "lookup(kb)",
        '["lookup", {"key": "kb"}]',
        '{"name": "lookup"}',
        '{"name": "lookup", "arguments": "kb"}',
        '{"name": 3, "arguments": {}}',
        "",
    ],
)
def test_malformed_calls_become_error_results(body):
    good = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(f"ok\n<tool_call>{body}</tool_call>\n{good}")
    assert content == "ok"
    assert [c["id"] for c in calls] == ["call_0", "call_1"]
    assert calls[0]["function"] == {"name": MALFORMED, "arguments": {}}
    assert calls[1]["function"] == {"name": LOOKUP, "arguments": {}}
    task, prompt = _prompt()
    assert task.call_tool(prompt, calls[0]["function"]["name"], calls[0]["function"]["arguments"]).is_error


def test_unclosed_call_is_still_a_call():
    content, calls = parse_tool_calls('\n<tool_call>{"name": "lookup", "arguments": {"key": "kb"}}')
    assert content == "" and calls[0]["function"] == {"name": LOOKUP, "arguments": {"key": "kb"}}
    content, calls = parse_tool_calls('\n<tool_call>{"name": "lookup", "argum')
    assert content == "" and calls[0]["function"]["name"] == MALFORMED


def test_hermes_renders_tools_in_the_system_turn_and_results_in_one_user_turn(hermes):
    task, prompt = _prompt()
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": LOOKUP, "arguments": {"key": k}}}
             for i, k in enumerate(["a", "b"])]  # fmt: skip
    messages = [*prompt.messages, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "content": "v1", "tool_call_id": "call_0"},
                {"role": "tool", "content": "v2", "tool_call_id": "call_1"}]  # fmt: skip
    schema = {"type": "function", "function": {"name": LOOKUP, "parameters": {"type": "object"}}}
    text = hermes.apply_chat_template(messages, tools=[schema], tokenize=False, add_generation_prompt=True)
    system = f"<|im_start|>system\n{prompt.messages[0]['content']}\n\n# Tools\n"
    assert text.startswith(system) and json.dumps(schema) in text.split("<|im_end|>")[0]
    assert text.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "lookup", "arguments": {"key": "b"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nv1\n</tool_response>\n<tool_response>\nv2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert len(hermes("<tool_response>", add_special_tokens=False)["input_ids"]) == 1
    no_tools = hermes.apply_chat_template(prompt.messages, tokenize=False)
    assert no_tools.startswith(f"<|im_start|>system\n{prompt.messages[0]['content']}<|im_end|>\n")


def test_the_lookup_schema_can_be_left_out_of_the_template():
    assert task_tools(ToolTask()) == [LOOKUP_SCHEMA] and task_tools(ToolTask(declare_tools=False)) is None


def test_thinking_demonstrations_reason_before_every_action():
    assert all(t.reasoning_content is None for d in ToolTask().demonstrations(random.Random(4), 50) for t in d.turns)
    task = ToolTask(guess_rate=0.5, think_words=6)
    demos = task.demonstrations(random.Random(4), 200)
    replies = [t for d in demos for t in d.turns if t.role == "assistant"]
    assert {len(t.reasoning_content.split()) for t in replies} == set(range(1, 7))  # 1 to think_words words
    answers = [t for d in demos for t in d.turns if t.role == "assistant" and not t.tool_calls and t.content.isdigit()]
    after_lookup = [t for t in answers if t.reasoning_content.startswith("The")]  # guesses think "I remember ..."
    assert after_lookup and {len(t.reasoning_content.split()) for t in after_lookup} == {1, 2}  # a short thought
    for demo, prompt in zip(demos, task.sample_prompts(random.Random(4), 200)):  # what it does is scored as before
        assert demo.final_reward == task.reward(prompt, [to_message(t) for t in demo.turns])
