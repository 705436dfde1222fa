"""Tool-call parsers per chat-template family, and tool schemas reaching the chat template and
the collator (teachers: test_teachers)."""

from __future__ import annotations

import json
import random
from typing import get_args

import pytest

from meshrl.configs.schema import ToolParserName
from meshrl.inference.completion import Completion
from meshrl.inference.toolcalls import MALFORMED, PARSERS, decode_turn, parse_tool_calls
from meshrl.models.tiny import build_tokenizer
from meshrl.rollouts.batches import rollout_trace
from meshrl.rollouts.chat import ChatSettings
from meshrl.rollouts.episodes import EpisodeFormat
from meshrl.tasks.base import task_tools
from meshrl.tasks.toy import ToolTask
from meshrl.traces.collator import TraceCollator
from meshrl.traces.errors import ErrorClassifier


def _fn(call: dict) -> tuple[str, dict]:
    return call["function"]["name"], call["function"]["arguments"]


def test_hermes_reads_qwen_blocks_and_the_tiny_form():
    qwen = 'Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>\n<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
    content, calls = parse_tool_calls(qwen, "hermes")
    assert content == "Let me look." and [_fn(c) for c in calls] == [("lookup", {"key": "a"}), ("ls", {})]
    assert [c["id"] for c in calls] == ["call_0", "call_1"]
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>', "tiny") == parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>', "hermes"
    )
    assert parse_tool_calls("plain answer", "hermes") == ("plain answer", [])


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral"])
def test_a_call_nested_past_the_limit_is_malformed_in_every_parser(parser):
    """1,000 brackets made the decoder raise RecursionError on the host (the episode scheduler died);
    a call whose arguments nest past MAX_NESTING is malformed, answered with a tool error."""
    deep, shallow = "[" * 1000 + "]" * 1000, "[" * 8 + "]" * 8
    for arguments, name in ((deep, MALFORMED), ('{"a": ' + "[" * 40 + "]" * 40 + "}", MALFORMED),
                            ('{"a": ' + shallow + "}", "f")):  # fmt: skip
        call = f'{{"name": "f", "arguments": {arguments}}}'
        text = {"hermes": f"<tool_call>{call}</tool_call>", "llama3": call.replace('"arguments"', '"parameters"'),
                "mistral": f"[TOOL_CALLS][{call}]"}[parser]  # fmt: skip
        _, calls = parse_tool_calls(text, parser)
        assert [c["function"]["name"] for c in calls] == [name], (parser, arguments[:20])


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"name": "lookup", "parameters": {"key": "a"}}', [("lookup", {"key": "a"})]),
        ('<|python_tag|>{"name": "lookup", "parameters": {"key": "a"}}', [("lookup", {"key": "a"})]),
        ('{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}', [("a", {}), ("b", {"x": 1})]),
        ('{"name": "a", "parameters": "{\\"x\\": 2}"}', [("a", {"x": 2})]),  # arguments as a JSON string
        ('{"name": "a", "parameters": {', [(MALFORMED, {})]),  # cut off
        ('{"name": 3, "parameters": {}}', [(MALFORMED, {})]),
        ("<|python_tag|>print(1)", [(MALFORMED, {})]),  # code, not a JSON call
    ],
)
def test_llama3_json_calls(text, expected):
    content, calls = parse_tool_calls(text, "llama3")
    assert content == "" and [_fn(c) for c in calls] == expected


def test_llama3_plain_text_is_content():
    assert parse_tool_calls("The value is 42.", "llama3") == ("The value is 42.", [])


@pytest.mark.parametrize(
    "text, content, expected",
    [
        ('ok [TOOL_CALLS] [{"name": "lookup", "arguments": {"key": "a"}}, {"name": "ls", "arguments": {}}]', "ok",
         [("lookup", {"key": "a"}), ("ls", {})]),
        ('[TOOL_CALLS]lookup[ARGS]{"key": "a"}[TOOL_CALLS]ls[ARGS]{}', "", [("lookup", {"key": "a"}), ("ls", {})]),
        ('[TOOL_CALLS] [{"name": "lookup", "arguments": {"key"', "", [(MALFORMED, {})]),
        ("[TOOL_CALLS]lookup{}", "", [(MALFORMED, {})]),  # no [ARGS]
        ("just text", "just text", []),
    ],
)  # fmt: skip
def test_mistral_calls_both_tokenizer_versions(text, content, expected):
    parsed = parse_tool_calls(text, "mistral")
    assert parsed.content == content and [_fn(c) for c in parsed.tool_calls] == expected


def test_decode_keeps_the_parsers_special_markers_and_drops_the_rest():
    tok = build_tokenizer(512)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"]})
    call = '[TOOL_CALLS]lookup[ARGS]{"key": "a"}'
    ids = tok(call, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert tok.decode(ids, skip_special_tokens=True) == 'lookup{"key": "a"}'  # what a plain decode would parse
    parsed = decode_turn(tok, ids, "mistral")
    assert [_fn(c) for c in parsed.tool_calls] == [("lookup", {"key": "a"})]
    ids = tok('<|python_tag|>{"name": "f", "parameters": {}}', add_special_tokens=False)["input_ids"]
    assert [_fn(c) for c in decode_turn(tok, ids, "llama3").tool_calls] == [("f", {})]


def test_the_config_offers_exactly_the_parsers():
    assert set(get_args(ToolParserName)) == set(PARSERS)


def test_task_tools_are_checked():
    class Bad:
        tools = [{"type": "function", "function": {"parameters": {}}}]

    with pytest.raises(ValueError, match=r"Bad.tools\[0\] is not an OpenAI function schema"):
        task_tools(Bad())
    assert task_tools(object()) is None
    assert task_tools(ToolTask())[0]["function"]["name"] == "lookup"


def test_tool_schemas_reach_the_prompt_and_the_collator_renders_what_was_sampled():
    """Hermes template: the task's schemas are in the rollout's system turn, and the collator (with
    the task's tools) renders the finished episode to exactly the ids the policy saw."""
    tok, task = build_tokenizer(512, "hermes"), ToolTask()
    episodes = EpisodeFormat(tok, task)
    (prompt,) = task.sample_prompts(random.Random(0), 1)
    rollout = episodes.start(prompt)
    text = tok.decode(rollout.token_ids)
    assert json.dumps(task.tools[0]) in text and "<tools>" in text
    key = prompt.info["key"]
    sampled = f'<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{key}"}}}}\n</tool_call><|im_end|>'
    ids = tok(sampled, add_special_tokens=False)["input_ids"]
    calls = episodes.add_turn(rollout, Completion(rollout.token_ids, ids, [-1.0] * len(ids), "stop", [0] * len(ids)))
    assert [_fn(c) for c in calls] == [("lookup", {"key": key})]
    episodes.add_tool_results(rollout, calls, [episodes.call_tool(rollout, c) for c in calls])
    answer = tok(f"{prompt.answer}<|im_end|>", add_special_tokens=False)["input_ids"]
    episodes.add_turn(rollout, Completion(rollout.token_ids, answer, [-1.0] * len(answer), "stop", [0] * len(answer)))
    trace = rollout_trace(rollout, ErrorClassifier())
    batch = TraceCollator(tok, tools=task_tools(task))([trace]).batch
    assert batch["input_ids"][0][: len(rollout.token_ids)].tolist() == rollout.token_ids
    without = TraceCollator(tok)([trace]).batch
    assert without["input_ids"].shape[1] < len(rollout.token_ids)  # the bug this guards: schemas left out


LONE = "\\ud800"  # JSON's escape of a lone surrogate: plain ASCII to write, a str UTF-8 cannot encode


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral"])
@pytest.mark.parametrize(
    "name, arguments",
    [(f"f{LONE}", '{"a": 1}'), ("f", f'{{"a{LONE}": 1}}'), ("f", f'{{"a": [{{"b": "x{LONE}"}}]}}')],
    ids=["name", "key", "nested value"],
)
def test_a_lone_surrogate_anywhere_in_a_call_makes_it_malformed_in_every_parser(parser, name, arguments):
    """A tool result echoing such a name or key made the tokenizer raise TypeError on the host, and
    run_python's code the program file's write UnicodeEncodeError (the episode scheduler died)."""
    call = f'{{"name": "{name}", "arguments": {arguments}}}'
    texts = {"hermes": [f"<tool_call>{call}</tool_call>"], "llama3": [call.replace('"arguments"', '"parameters"')],
             "mistral": [f"[TOOL_CALLS][{call}]"]}[parser]  # fmt: skip
    if parser == "mistral" and LONE not in name:  # v11 writes the name as plain text, never JSON-decoded
        texts.append(f"[TOOL_CALLS]{name}[ARGS]{arguments}")
    for text in texts:
        assert [_fn(c) for c in parse_tool_calls(text, parser).tool_calls] == [(MALFORMED, {})], text
    pair = '{"name": "f", "arguments": {"a": "\\ud83d\\ude00"}}'  # an escaped surrogate pair is one valid character
    assert [_fn(c) for c in parse_tool_calls(f"<tool_call>{pair}</tool_call>").tool_calls] == [("f", {"a": "😀"})]


@pytest.mark.parametrize(
    "settings", [ChatSettings("template", "hermes"), ChatSettings("qwen3")], ids=["template", "renderer"]
)
def test_a_call_named_with_a_lone_surrogate_is_answered_with_a_tool_error(settings):
    """Through the episode's own path, the template's parser and a `renderers` renderer's alike: the
    toy task echoes an unknown tool's name, which made building the tool turn raise TypeError."""
    tok, task = build_tokenizer(512, "qwen3" if settings.renderer == "qwen3" else "hermes"), ToolTask()
    episodes = EpisodeFormat(tok, task, settings)
    (prompt,) = task.sample_prompts(random.Random(0), 1)
    rollout = episodes.start(prompt)
    sampled = f'<tool_call>\n{{"name": "lookup{LONE}", "arguments": {{"key": "a"}}}}\n</tool_call>'
    ids = tok(sampled, add_special_tokens=False)["input_ids"] + episodes.stop_ids[:1]
    calls = episodes.add_turn(rollout, Completion(rollout.token_ids, ids, [-1.0] * len(ids), "stop", [0] * len(ids)))
    assert [_fn(c) for c in calls] == [(MALFORMED, {})]
    episodes.add_tool_results(rollout, calls, [episodes.call_tool(rollout, c) for c in calls])
    assert rollout.messages[-1]["is_error"] and MALFORMED in rollout.messages[-1]["content"]
    assert rollout.tool_errors == 1 and len(rollout.token_ids) == len(rollout.loss_mask) == len(rollout.logprobs)
