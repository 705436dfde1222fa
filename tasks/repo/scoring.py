"""The hidden-test reward of a repository task, which the policy can neither see nor reach.

1. The episode's state is rebuilt, not trusted: its calls of the tools that write (Edit, Write,
   Bash) run again, in order, in a fresh workspace holding the buggy repository. The same scoring
   serves an outside worker's episode, whose workspace the controller never had.
2. Only the module under test is taken from that state (read without following links, at most
   `MAX_MODULE_BYTES`). Test files, new files (a `unittest.py`, a `sitecustomize.py`, a
   `conftest.py`) and everything else the policy wrote are left behind: the pristine tests and
   repository are used.
3. The module may not use what it would need to reach the test runner: an import, or a name
   such as `sys.modules`, `open`, `getattr`, `__subclasses__`, `_getframe`, that the buggy module
   did not already use (`new_capabilities`). A fix that does is refused, with reward 0.
4. The tests run in a fresh sandbox call; their report follows a nonce the module's code cannot
   read (3). Reward 1 when every FAIL_TO_PASS test passes and every PASS_TO_PASS test still does.
"""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

MAX_MODULE_BYTES = 1 << 20
# Names that reach the interpreter, the process or the files rather than the module's own data.
SENSITIVE = frozenset({
    "open", "exec", "eval", "compile", "__import__", "globals", "locals", "vars", "getattr", "setattr", "delattr",
    "breakpoint", "input", "exit", "quit", "help", "memoryview", "modules", "_getframe", "settrace", "setprofile",
    "f_back", "f_globals", "f_locals", "f_code", "f_builtins", "gi_frame", "cr_frame", "tb_frame", "tb_next",
    "__globals__", "__builtins__", "__subclasses__", "__code__", "__dict__", "__class__", "__bases__", "__base__",
    "__mro__", "__loader__", "__spec__", "__reduce__", "__reduce_ex__", "__getattribute__", "__closure__",
    "_exit", "system", "popen", "kill", "abort", "fork", "stdout", "stderr", "__stdout__", "__stderr__",
    "__main__", "sys", "os", "builtins", "importlib", "ctypes", "gc", "inspect", "unittest", "atexit", "signal",
})  # fmt: skip


def capabilities(code: str) -> set[str] | None:
    """The imports and sensitive names `code` uses (None: it does not parse)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return None
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            used |= {f"import {alias.name}" for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            used |= {f"from {'.' * node.level}{node.module or ''} import {alias.name}" for alias in node.names}
        elif isinstance(node, ast.Name) and node.id in SENSITIVE:
            used.add(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in SENSITIVE:
            used.add(f".{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in SENSITIVE:
            used.add(repr(node.value))
    return used


def new_capabilities(final: str, given: str) -> list[str]:
    """What `final` uses that `given` did not (a module that does not parse: ["syntax"])."""
    after, before = capabilities(final), capabilities(given)
    if after is None:
        return ["syntax"]
    return sorted(after - (before or set()))


def read_module(directory: Path, name: str) -> str | None:
    """`directory/name` when it is a regular file of at most MAX_MODULE_BYTES, read without following
    a link the policy put there; else None."""
    try:
        fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_MODULE_BYTES:
            return None
        return f.read(MAX_MODULE_BYTES + 1)[:MAX_MODULE_BYTES].decode("utf-8", "replace")
