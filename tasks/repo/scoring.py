"""The hidden-test reward of a repository task: a verdict the code under test cannot reach.

1. The episode's state is rebuilt, not trusted: the calls of the tools that write (Edit, Write,
   Bash) that the episode ran (those its tool turns answered) run again, in order, in a fresh
   workspace holding the buggy repository. The same scoring serves an outside worker's episode.
2. Only the module under test is taken from that state (read without following links, at most
   `MAX_MODULE_BYTES`), as the bytes Python will run: a coding cookie other than UTF-8, bytes
   that are not UTF-8, or a NUL byte refuse it (a cookie made the scan read other text than Python
   ran). Everything else the policy wrote is left behind: the pristine tests and repository are used.
3. The tests run in a fresh sandbox call (`runner`), which reports what each test observed (a
   digest of the values its assertions were given, canonicalised without calling their methods).
   The host decides: reward 1 when every FAIL_TO_PASS and PASS_TO_PASS test passed observing
   exactly what it observed on the original module (`solved`). The expected digests were recorded
   at build time and never enter the sandbox; the original module, its bytecode and its tests are
   hidden there (`answer_key`). A report the host cannot read as data of its shape is a 0.
4. Defence in depth, not the guarantee: the module may not use more of what reaches the test
   runner's process (imports, names such as `sys`, `getattr`, `_getframe`, any dunder attribute,
   `match` statements, strings naming them) than the buggy and the original module did together
   (`new_capabilities`: counts, so one more `getattr` call than there was is refused).
"""

from __future__ import annotations

import ast
import io
import os
import re
import stat
import tokenize
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from meshrl.tasks.parsing import parse
from meshrl.tasks.repo.runner import TestRun

MAX_MODULE_BYTES = 1 << 20
# Names that reach the interpreter, the process or the files rather than the module's own data.
SENSITIVE = frozenset({
    "open", "exec", "eval", "compile", "__import__", "globals", "locals", "vars", "getattr", "setattr", "delattr",
    "breakpoint", "input", "exit", "quit", "help", "memoryview", "modules", "_getframe", "settrace", "setprofile",
    "f_back", "f_globals", "f_locals", "f_code", "f_builtins", "gi_frame", "cr_frame", "ag_frame", "tb_frame",
    "tb_next", "attrgetter", "methodcaller", "_exit", "system", "popen", "kill", "abort", "fork", "execv", "execve",
    "stdout", "stderr", "sys", "os", "builtins", "importlib", "ctypes", "gc", "inspect", "unittest", "atexit",
    "signal", "subprocess", "threading", "runpy", "traceback", "types", "operator",
})  # fmt: skip
_WORDS = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _sensitive(name: str) -> bool:
    return name in SENSITIVE or (name.startswith("__") and name.endswith("__") and len(name) > 4)


def capabilities(code: str) -> Counter[str] | None:
    """How often `code` uses each import and sensitive name (None: it does not parse)."""
    tree = parse(code)
    if tree is None:
        return None
    used: Counter[str] = Counter()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            used.update(f"import {alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            used.update(f"from {'.' * node.level}{node.module or ''} import {alias.name}" for alias in node.names)
        elif isinstance(node, ast.Name) and _sensitive(node.id):
            used[node.id] += 1
        elif isinstance(node, ast.Attribute) and _sensitive(node.attr):
            used[f".{node.attr}"] += 1
        elif isinstance(node, ast.Match):
            used["match"] += 1
        elif isinstance(node, ast.MatchClass):  # `case object(tb_frame=f)` reads attributes by name
            used.update(f".{name}" for name in node.kwd_attrs)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
            text = node.value if isinstance(node.value, str) else node.value.decode("latin-1")
            used.update(repr(word) for word in _WORDS.findall(text) if _sensitive(word))
    return used


def new_capabilities(final: str, *allowed: str) -> list[str]:
    """What `final` uses more often than any of `allowed` did (a module that does not parse: ["syntax"])."""
    after = capabilities(final)
    if after is None:
        return ["syntax"]
    most: Counter[str] = Counter()
    for code in allowed:
        most |= capabilities(code) or Counter()  # |: the larger count of each
    return sorted(name for name, count in after.items() if count > most[name])


def module_text(data: bytes) -> str | None:
    """The text Python runs from `data`, when that is `data` read as UTF-8; else None (another
    coding cookie, bytes that are not UTF-8, a NUL byte)."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        if encoding not in ("utf-8", "utf-8-sig") or b"\0" in data:
            return None
        return data.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return None


def read_module(directory: Path, name: str) -> bytes | None:
    """`directory/name` (a relative path) when it is a regular file of at most MAX_MODULE_BYTES,
    reached without following any link the policy put on the way (each part opened with
    O_NOFOLLOW from its parent); else None."""
    parts = Path(name).parts
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | (os.O_NONBLOCK if last else os.O_DIRECTORY)
            parent, fd = fd, -1
            try:
                fd = os.open(part, flags, dir_fd=parent)
            finally:
                os.close(parent)
        with os.fdopen(fd, "rb") as f:
            fd = -1
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_MODULE_BYTES:
                return None
            return f.read(MAX_MODULE_BYTES + 1)[:MAX_MODULE_BYTES]
    except OSError:
        return None
    finally:
        if fd >= 0:
            os.close(fd)


@dataclass(frozen=True)
class Verdict:
    """FAIL_TO_PASS tests that now pass as on the original, PASS_TO_PASS tests that no longer do."""

    fixed: int
    broken: int
    solved: bool


def judge(run: TestRun, fail_to_pass: tuple[str, ...], pass_to_pass: tuple[str, ...],
          expected: dict[str, str]) -> Verdict:  # fmt: skip
    """A test counts when it passed observing what it observed on the original (`expected`)."""

    def held(test: str) -> bool:
        got = None if run.tests is None or run.load_error else run.tests.get(test)
        return got is not None and got == ("pass", expected.get(test))

    fixed = sum(held(t) for t in fail_to_pass)
    broken = sum(not held(t) for t in pass_to_pass)
    return Verdict(fixed, broken, fixed == len(fail_to_pass) and broken == 0)
