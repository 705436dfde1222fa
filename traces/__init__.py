"""Traces: the trace-example schema, ingestion of agent sessions, teacher-replay pair mining,
and the collator that turns traces into batches for all three loss channels."""

from meshrl.traces.schema import ErrorMeta, ToolCall, TraceExample, Turn

__all__ = ["ErrorMeta", "ToolCall", "TraceExample", "Turn"]
