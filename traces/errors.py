"""Tool errors: classifying an error result into a kind, and marking the SDPO error sites.

Shared by ingestion (agent sessions) and the run's own rollouts, so both mark sites alike.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from meshrl.traces.schema import ErrorMeta, Turn

EXCERPT_CHARS = 300

DEFAULT_RULES: tuple[tuple[str, str], ...] = (
    (
        "command_not_found",
        r"command not found|not recognized as an internal or external command"
        r"|executable file not found|\bexit code 127\b",
    ),
    (
        "file_not_found",
        r"no such file or directory|\bENOENT\b|file does not exist|FileNotFoundError"
        r"|path does not exist|directory does not exist",
    ),
    ("permission_denied", r"permission denied|\bEACCES\b|\bEPERM\b|operation not permitted|PermissionError"),
    ("syntax_error", r"syntax ?error|IndentationError|unexpected token|unexpected end of input"),
    (
        "connection_error",
        r"connection refused|\bECONNREFUSED\b|\bECONNRESET\b|connection reset"
        r"|timed out|\bETIMEDOUT\b|could not resolve host|name or service not known|network is unreachable",
    ),
)


class ErrorClassifier:
    """Error kind of a tool result: the first rule whose regex matches the text, else `tool_error`.

    Rules are an ordered list so a project can put its own kinds ahead of the defaults.
    """

    fallback = "tool_error"

    def __init__(self, rules: Iterable[tuple[str, str | re.Pattern[str]]] = DEFAULT_RULES) -> None:
        self.rules: list[tuple[str, re.Pattern[str]]] = []
        for kind, pattern in rules:
            self.add_rule(kind, pattern, first=False)

    def add_rule(self, kind: str, pattern: str | re.Pattern[str], first: bool = True) -> None:
        """Add a rule ahead of the others (or after them); string patterns match case-insensitively."""
        compiled = re.compile(pattern, re.IGNORECASE) if isinstance(pattern, str) else pattern
        if first:
            self.rules.insert(0, (kind, compiled))
        else:
            self.rules.append((kind, compiled))

    def classify(self, text: str) -> str:
        return next((kind for kind, regex in self.rules if regex.search(text)), self.fallback)


def mark_error_sites(turns: list[Turn], classifier: ErrorClassifier) -> None:
    """The assistant turn right after an error result (no user turn between) is an error site.

    With several errors before it, the first one is the site's cause.
    """
    tool_names: dict[str, str] = {}
    error: Turn | None = None
    for turn in turns:
        if turn.role == "tool" and turn.is_error and error is None:
            error = turn
        elif turn.role == "user":
            error = None
        elif turn.role == "assistant":
            if error is not None:
                tool_name = tool_names.get(error.tool_call_id or "", "unknown")
                turn.tool_error = classifier.classify(error.content)
                turn.error_meta = ErrorMeta(tool_name=tool_name, excerpt=error.content.strip()[:EXCERPT_CHARS])
                error = None
            tool_names.update((call.id, call.name) for call in turn.tool_calls or [])
