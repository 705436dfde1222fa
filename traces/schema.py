"""The trace-example schema every ingester writes and the collator reads (one JSON object per line).

    {"trace_id", "source", "turns": [{"role", "content", "reasoning_content"?, "tool_calls"?, "tool_call_id"?,
     "is_error"?, "tool_error"?, "error_meta"?, "token_span"?}], "final_reward", "token_ids"?}

Roles: system, user, assistant (its tool calls are part of its action), tool (a tool
result, a turn of its own). An assistant turn that follows an error tool result carries
`tool_error` (a kind: command_not_found, file_not_found, ...) and `error_meta` (tool name
and an excerpt of the error): these are the SDPO error sites.

A trace the policy sampled (a rollout) also keeps its exact ids (`token_ids`) and, on each
assistant turn, where that turn's sampled ids lie in them (`token_span`): replay and SDPO rows
train on those ids, never on a re-rendering of the parsed turn.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolCall(_Strict):
    id: str = Field(description="Call id a tool turn answers with tool_call_id.")
    name: str = Field(description="Tool name.")
    arguments: dict[str, Any] = Field(default_factory=dict, description="Tool input.")


class TokenSpan(_Strict):
    """Positions [start, end) of a turn's sampled ids in its trace's `token_ids`."""

    start: int = Field(ge=0)
    end: int = Field(gt=0)


class ErrorMeta(_Strict):
    tool_name: str = Field(description="The tool whose result was an error.")
    excerpt: str = Field(description="The start of the error text.")


class Turn(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    reasoning_content: str | None = Field(
        None, description="Assistant turns: the reasoning before the answer (shown to rubrics, not part of the action)."
    )
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(None, description="Tool turns: the call this result answers.")
    is_error: bool | None = Field(None, description="Tool turns: the tool reported an error.")
    tool_error: str | None = Field(None, description="Assistant turns after an error result: the error kind.")
    error_meta: ErrorMeta | None = None
    logprobs: list[float] | None = Field(
        None, description="Assistant turns sampled by the policy: the sampler's logprob of each token of the turn."
    )
    token_span: TokenSpan | None = Field(
        None, description="Assistant turns sampled by the policy: where its sampled ids lie in the trace's token_ids."
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
    token_ids: list[int] | None = Field(
        None, description="A sampled episode's exact ids: prompt, sampled turns and tool turns, as trained on."
    )
    # A rollout's mixture-of-experts routing of token_ids (`models.routing`): its SDPO student rows
    # replay it. Never in a trace file: only the run that sampled the episode has it.
    _routing: Any = PrivateAttr(default=None)

    def with_routing(self, routing: Any) -> TraceExample:
        """The example, carrying the sampler's routing of its ids (a numpy record, or None)."""
        self._routing = routing
        return self

    @property
    def routing(self) -> Any:
        return self._routing

    @model_validator(mode="after")
    def _spans_in_ids(self) -> TraceExample:
        for index, turn in enumerate(self.turns):
            span = turn.token_span
            if span is None:
                continue
            if turn.role != "assistant" or self.token_ids is None or not span.start < span.end <= len(self.token_ids):
                raise ValueError(
                    f"turns[{index}].token_span [{span.start}, {span.end}) is not an assistant turn's span "
                    f"within the trace's {len(self.token_ids or [])} token_ids"
                )
        return self

    def sampled_ids(self, turn: Turn) -> tuple[list[int], list[int]] | None:
        """(the exact ids before `turn`, the ids it sampled) when it was sampled, else None."""
        if turn.token_span is None or self.token_ids is None:
            return None
        return self.token_ids[: turn.token_span.start], self.token_ids[turn.token_span.start : turn.token_span.end]

    def to_json(self) -> str:
        return self.model_dump_json(exclude_none=True)
