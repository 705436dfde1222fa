"""Assistant completion text back to a chat message: tool-call parsers, one per chat-template family.

Which parser a run uses is `model.tool_parser` (the family of the policy's chat template):

- `hermes` (Hermes, Qwen2.5/Qwen3, and the tiny template, which writes the same form): the content,
  then one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block per call (Qwen puts the
  JSON on lines of its own). `tiny` names the same parser.
- `llama3` (Llama 3.1-3.3 JSON tool calling): the whole turn is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`, several calls separated by `;`; such a turn has no content.
- `mistral`: the content, then `[TOOL_CALLS]` and either a JSON list of `{"name", "arguments"}`
  (v3 tokenizers) or `name[ARGS]{...}` per call (v11+ tokenizers).

A call the model botched (bad JSON, no string name, arguments that are not an object or nest
deeper than `MAX_NESTING`, a name, key or string value that is not valid text, a block never
closed) still counts as a call, named `<malformed>` with no arguments: the task answers it
with an error result the model can learn from, where an exception would end the episode. Text
after the calls is not part of any template's form and is dropped.

Not valid text: JSON's escapes let a policy write a lone surrogate (`"\\ud800"`) in plain ASCII,
a str that UTF-8 cannot encode. Echoed in a tool result it made the tokenizer raise `TypeError`;
as run_python's code, the sandbox's program-file write `UnicodeEncodeError`. Completions decoded
from token ids are valid text: these JSON-decoded strings are the only route.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from transformers import PreTrainedTokenizerBase

MALFORMED = "<malformed>"
MAX_NESTING = 32  # a call's arguments nested deeper are malformed: every later render and dump stays shallow


class ParsedTurn(NamedTuple):
    content: str
    tool_calls: list[dict[str, Any]]  # OpenAI form, ids call_0, call_1, ...


def tool_call(index: int, parsed: Any, arguments_key: str = "arguments") -> dict[str, Any]:
    """One parsed call in OpenAI form (id `call_<index>`); `<malformed>` unless `parsed` is a dict
    with a string name and object arguments (a JSON string of one is accepted)."""
    arguments = parsed.get(arguments_key) if isinstance(parsed, dict) else None
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _loads(arguments)
    well_formed = (isinstance(parsed, dict) and isinstance(parsed.get("name"), str) and isinstance(arguments, dict)
                   and nesting(arguments) <= MAX_NESTING
                   and is_text(parsed["name"]) and is_text(arguments))  # fmt: skip
    name, arguments = (parsed["name"], arguments) if well_formed else (MALFORMED, {})
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


def nesting(value: Any) -> int:
    """How deeply lists and objects nest in a JSON value (iteratively: no recursion to exhaust)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


_SURROGATE = re.compile("[\ud800-\udfff]")  # the only code points UTF-8 cannot encode


def is_text(value: Any) -> bool:
    """Whether every string in a JSON value, object keys included, encodes as UTF-8: holds no lone
    surrogate (the decoder joins a valid escaped pair into one code point). Iterative, as `nesting`."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return False
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


def _loads(text: str) -> Any:
    """JSON, or None (malformed, or nested past the decoder's recursion limit: a policy's
    1,000 brackets raised RecursionError here)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


_HERMES_BLOCK = re.compile(r"\n?<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    blocks = list(_HERMES_BLOCK.finditer(text))
    content = text[: blocks[0].start()] if blocks else text
    return ParsedTurn(content, [tool_call(i, _loads(block.group(1))) for i, block in enumerate(blocks)])


_PYTHON_TAG = "<|python_tag|>"


def parse_llama3(text: str) -> ParsedTurn:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    body = body.removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return ParsedTurn("", [tool_call(0, None)]) if tagged else ParsedTurn(text, [])
    calls, decoder, rest = [], json.JSONDecoder(), body
    while rest:
        try:
            parsed, end = decoder.raw_decode(rest)
        except (ValueError, RecursionError):
            calls.append(tool_call(len(calls), None))
            break
        key = "parameters" if isinstance(parsed, dict) and "parameters" in parsed else "arguments"
        calls.append(tool_call(len(calls), parsed, key))
        rest = rest[end:].lstrip()
        if not rest.startswith(";"):
            break
        rest = rest[1:].lstrip()
    return ParsedTurn("", calls)


_MISTRAL_CALLS, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


def parse_mistral(text: str) -> ParsedTurn:
    if _MISTRAL_CALLS not in text:
        return ParsedTurn(text, [])
    content, _, rest = text.partition(_MISTRAL_CALLS)
    rest = rest.strip()
    if rest.startswith("["):  # v3: one JSON list of calls
        try:
            parsed, _ = json.JSONDecoder().raw_decode(rest)
        except (ValueError, RecursionError):
            parsed = None
        items = parsed if isinstance(parsed, list) and parsed else [None]
        return ParsedTurn(content.rstrip(), [tool_call(i, item) for i, item in enumerate(items)])
    calls = []  # v11+: name[ARGS]{...}, repeated after further [TOOL_CALLS]
    for chunk in rest.split(_MISTRAL_CALLS):
        name, found, arguments = chunk.partition(_MISTRAL_ARGS)
        parsed = {"name": name.strip(), "arguments": _loads(arguments.strip())} if found else None
        calls.append(tool_call(len(calls), parsed))
    return ParsedTurn(content.rstrip(), calls)


REASONING = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)


def split_reasoning(content: str, opened: bool = False) -> tuple[str | None, str]:
    """(the reasoning, the content after it) of a turn that opens with `<think>` (an unclosed one
    runs to the end), or whose prompt `opened` the block; (None, content) for a turn without."""
    stripped = content.lstrip()
    if opened and not stripped.startswith("<think>"):
        stripped = "<think>" + stripped
    found = REASONING.match(stripped)
    if not found:
        return None, content
    reasoning = found.group(0).removeprefix("<think>").removesuffix("</think>").strip("\n")
    return reasoning, stripped[found.end() :].lstrip("\n")


class ToolParser(NamedTuple):
    parse: Callable[[str], ParsedTurn]
    markers: tuple[str, ...]  # special tokens the parser reads, kept when a completion is decoded


PARSERS: dict[str, ToolParser] = {
    "hermes": ToolParser(parse_hermes, ()),
    "tiny": ToolParser(parse_hermes, ()),
    "llama3": ToolParser(parse_llama3, (_PYTHON_TAG,)),
    "mistral": ToolParser(parse_mistral, (_MISTRAL_CALLS, _MISTRAL_ARGS)),
}


def parse_tool_calls(text: str, parser: str = "hermes") -> ParsedTurn:
    """Content and OpenAI-style tool calls of one decoded assistant completion."""
    return PARSERS[parser].parse(text)


def decode_turn(tokenizer: PreTrainedTokenizerBase, ids: list[int], parser: str = "hermes") -> ParsedTurn:
    """Parse sampled ids: decoded without special tokens, except the markers the parser reads
    (Mistral's `[TOOL_CALLS]` and Llama's `<|python_tag|>` are special tokens in their vocabularies)."""
    markers = PARSERS[parser].markers
    text = tokenizer.decode(ids, skip_special_tokens=not markers)
    if markers:
        for token in tokenizer.all_special_tokens:
            if token not in markers:
                text = text.replace(token, "")
    return parse_tool_calls(text, parser)
