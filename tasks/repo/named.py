"""The easy tier of repository tasks: the prompt names the function that holds the bug and shows one
failing test's code, so a small model starts from reading one function instead of exploring.

A task has a tier-easy form (`Pointer`) when its bug sits in a function of at most `MAX_FUNCTION`
lines and one of its FAIL_TO_PASS tests is a test method of at most `MAX_TEST` lines; the others
are left out of the tier.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from meshrl.tasks.repo.build import RepoTask
from meshrl.tasks.repo.sources import Source

MAX_FUNCTION = 40
MAX_TEST = 20


@dataclass(frozen=True)
class Pointer:
    """Where to look: the function (`name`, lines `start`-`end` of the module) and one failing test
    (`test_id`, `test_code`, its method's source)."""

    name: str
    start: int
    end: int
    test_id: str
    test_code: str


def enclosing_function(code: str, line: int) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The innermost function whose body holds `line` (1-based)."""
    found = None
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.lineno <= line <= (node.end_lineno or 0):
            if found is None or node.lineno >= found.lineno:
                found = node
    return found


def test_method(tests: str, test_id: str) -> str | None:
    """The source of the test method `test_id` (`pkg.test_mod.Class.test_x`) in the suite `tests`."""
    *_, class_name, method_name = test_id.split(".")
    for node in ast.parse(tests).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method_name:
                    return ast.get_source_segment(tests, item, padded=True)
    return None


def pointer(source: Source, task: RepoTask) -> Pointer | None:
    """The task's easy form, or None when its bug is not in a short function or no failing test is a
    short test method."""
    function = enclosing_function(source.code, task.line)
    if function is None or (function.end_lineno or 0) - function.lineno + 1 > MAX_FUNCTION:
        return None
    for test_id in task.fail_to_pass:
        if test_id.count(".") < 2:
            continue
        code = test_method(source.tests, test_id)
        if code is not None and len(code.splitlines()) <= MAX_TEST:
            return Pointer(function.name, function.lineno, function.end_lineno or function.lineno, test_id, code)
    return None
