"""The trace-example schema every ingester writes and the collator reads (one JSON object per line).

    {"trace_id", "source", "turns": [{"role", "content", "tool_calls"?, "tool_call_id"?,
     "is_error"?, "tool_error"?, "error_meta"?}], "final_reward"}

Roles: system, user, assistant (its tool calls are part of its action), tool (a tool
result, a turn of its own). An assistant turn that follows an error tool result carries
`tool_error` (a kind: command_not_found, file_not_found, ...) and `error_meta` (tool name
and an excerpt of the error): these are the SDPO error sites.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolCall(_Strict):
    id: str = Field(description="Call id a tool turn answers with tool_call_id.")
    name: str = Field(description="Tool name.")
    arguments: dict[str, Any] = Field(default_factory=dict, description="Tool input.")


class ErrorMeta(_Strict):
    tool_name: str = Field(description="The tool whose result was an error.")
    excerpt: str = Field(description="The start of the error text.")


class Turn(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(None, description="Tool turns: the call this result answers.")
    is_error: bool | None = Field(None, description="Tool turns: the tool reported an error.")
    tool_error: str | None = Field(None, description="Assistant turns after an error result: the error kind.")
    error_meta: ErrorMeta | None = None
    logprobs: list[float] | None = Field(
        None, description="Assistant turns sampled by the policy: the sampler's logprob of each token of the turn."
    )

    @classmethod
    def from_message(cls, message: Any) -> Turn:
        """A turn from a chat message: flat tool calls or OpenAI's `{"function": {...}}` form,
        arguments as a dict or a JSON string. Bookkeeping keys beyond the schema's are dropped."""
        if isinstance(message, Turn):
            return message
        data = {k: message[k] for k in cls.model_fields if k in message and message[k] is not None}
        calls = []
        for call in data.get("tool_calls") or []:
            body = call.get("function", call)
            arguments = body.get("arguments", {})
            calls.append({"id": call.get("id", ""), "name": body.get("name", ""),
                          "arguments": json.loads(arguments) if isinstance(arguments, str) else arguments})  # fmt: skip
        if calls:
            data["tool_calls"] = calls
        return cls.model_validate(data)


class TraceExample(_Strict):
    trace_id: str
    source: str = Field(description="Where the trace came from (a file path, a run id).")
    turns: list[Turn]
    final_reward: float | None = Field(None, description="Episode reward in [0, 1] when known.")

    def to_json(self) -> str:
        return self.model_dump_json(exclude_none=True)
