"""Assistant completion text back to a chat message: the inverse of the tiny chat template.

The template renders an assistant turn as its content followed by one
`\\n<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block per call, so a sampled
completion (without its end token) is split the same way. A block the model botched
(bad JSON, not `{"name": str, "arguments": object}`, or never closed) still counts as a
call, named `<malformed>` with no arguments: the task answers it with an error result the
model can learn from, where an exception would end the episode.

Text between or after blocks is not part of the template's form and is dropped; content
that itself contains `<tool_call>` cannot round-trip.
"""

from __future__ import annotations

import json
import re
from typing import Any

MALFORMED = "<malformed>"

_BLOCK = re.compile(r"\n?<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def _call(index: int, body: str) -> dict[str, Any]:
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    well_formed = (
        isinstance(parsed, dict) and isinstance(parsed.get("name"), str) and isinstance(parsed.get("arguments"), dict)
    )
    name, arguments = (parsed["name"], parsed["arguments"]) if well_formed else (MALFORMED, {})
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Content and OpenAI-style tool calls (ids `call_0`, `call_1`, ...) of one assistant completion."""
    blocks = list(_BLOCK.finditer(text))
    content = text[: blocks[0].start()] if blocks else text
    return content, [_call(i, block.group(1)) for i, block in enumerate(blocks)]
