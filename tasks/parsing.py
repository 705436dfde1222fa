"""Parsing Python that a policy wrote, on the host: one thread at a time, and total.

CPython 3.11's AST conversion keeps one recursion counter per interpreter: scorer threads parsing
at once failed with "SystemError: AST constructor recursion depth mismatch" (the HumanEval scorer
on 4 threads; the repository scan likewise). A 200,000-term expression or 1,000 nested brackets
raise RecursionError, MemoryError or SystemError rather than SyntaxError: `parse` turns each into
None, so a policy's code can never raise on the host.
"""

from __future__ import annotations

import ast
import threading
from typing import Any

_PARSING = threading.Lock()
FAILURES = (SyntaxError, ValueError, RecursionError, MemoryError, SystemError, OverflowError)


def parse(source: str) -> ast.Module | None:
    """`ast.parse(source)`, or None where it does not parse (or is too deep to)."""
    with _PARSING:
        try:
            return ast.parse(source)
        except FAILURES:
            return None


def literal(text: str) -> Any:
    """`ast.literal_eval(text)`, one thread at a time (raises as it does)."""
    with _PARSING:
        return ast.literal_eval(text)
