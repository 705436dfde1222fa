"""Traces: the trace-example schema (`schema`), Claude Code ingestion (`claude_code`),
teacher-replay pair mining (`pairs`) and the collator for all three loss channels
(`collator`, which needs torch). Import those from their modules; this package stays light
so the CLI starts fast."""

from meshrl.traces.schema import ErrorMeta, ToolCall, TraceExample, Turn

__all__ = ["ErrorMeta", "ToolCall", "TraceExample", "Turn"]
