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
4. Defence in depth, not the guarantee: the scan allows rather than forbids. The module may use
   only the names, attribute names and imports the buggy or the original module already used, plus
   a small fixed set (`SAFE_NAMES`, `SAFE_ATTRIBUTES`) and names it binds itself that are no
   builtin: a library the original imports cannot lend its own attributes (`enum.bltns`, the
   builtins module) to reach `getattr` or `__import__`. Sensitive names (`sys`, `getattr`,
   `_getframe`, dunders, `match`, strings naming them) are also counted: one more `getattr` call
   than there was is refused. The runner keeps what it records out of the module's reach by
   construction (`runner`).
"""

from __future__ import annotations

import ast
import builtins
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
_BUILTINS = frozenset(dir(builtins))
# What any fix may use besides what the buggy and the original module use: builtins and methods of
# builtin values that reach nothing beyond the values they are given (no `type`, `object`, `print`,
# `str.format`, which reads attributes by the names in its format string).
SAFE_NAMES = frozenset({
    "abs", "all", "any", "bool", "bytes", "chr", "dict", "divmod", "enumerate", "filter", "float", "frozenset",
    "int", "isinstance", "issubclass", "iter", "len", "list", "map", "max", "min", "next", "ord", "pow", "range",
    "repr", "reversed", "round", "set", "slice", "sorted", "str", "sum", "tuple", "zip", "bin", "hex", "oct",
    "ArithmeticError", "AssertionError", "Exception", "IndexError", "KeyError", "LookupError", "NotImplemented",
    "NotImplementedError", "OverflowError", "RuntimeError", "StopIteration", "TypeError", "ValueError",
    "ZeroDivisionError", "self", "cls",
})  # fmt: skip
SAFE_ATTRIBUTES = frozenset({
    "append", "extend", "insert", "pop", "remove", "sort", "reverse", "copy", "clear", "index", "count",
    "get", "items", "keys", "values", "setdefault", "update", "add", "discard", "union", "intersection",
    "difference", "issubset", "issuperset", "join", "split", "rsplit", "strip", "lstrip", "rstrip", "startswith",
    "endswith", "find", "rfind", "rindex", "replace", "lower", "upper", "splitlines", "partition", "rpartition",
    "isdigit", "isalpha", "isalnum", "isspace", "encode", "decode", "zfill", "ljust", "rjust", "center",
    "real", "imag", "numerator", "denominator", "is_integer", "bit_length",
})  # fmt: skip


def _sensitive(name: str) -> bool:
    return name in SENSITIVE or (name.startswith("__") and name.endswith("__") and len(name) > 4)


def _bound(tree: ast.Module) -> set[str]:
    """Names the module binds itself (assignments, parameters, defs, classes, imports, handlers)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            out.add(node.id)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.alias):
            out.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and node.name:
            out.add(node.name)
    return out


@dataclass(frozen=True)
class Uses:
    """What a module's code uses: `counted` imports and sensitive names (how often), and every name
    it reads and attribute name it touches (an attribute or a `match` keyword)."""

    counted: Counter[str]
    names: frozenset[str]
    attributes: frozenset[str]
    bound: frozenset[str]


def uses(code: str) -> Uses | None:
    """What `code` uses (None: it does not parse)."""
    tree = parse(code)
    if tree is None:
        return None
    used: Counter[str] = Counter()
    names: set[str] = set()
    attributes: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            used.update(f"import {alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            used.update(f"from {'.' * node.level}{node.module or ''} import {alias.name}" for alias in node.names)
        elif isinstance(node, ast.Name):
            names.add(node.id)
            if _sensitive(node.id):
                used[node.id] += 1
        elif isinstance(node, ast.Attribute):
            attributes.add(node.attr)
            if _sensitive(node.attr):
                used[f".{node.attr}"] += 1
        elif isinstance(node, ast.Match):
            used["match"] += 1
        elif isinstance(node, ast.MatchClass):  # `case object(tb_frame=f)` reads attributes by name
            attributes.update(node.kwd_attrs)
            used.update(f".{name}" for name in node.kwd_attrs)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
            text = node.value if isinstance(node.value, str) else node.value.decode("latin-1")
            used.update(repr(word) for word in _WORDS.findall(text) if _sensitive(word))
    return Uses(used, frozenset(names), frozenset(attributes), frozenset(_bound(tree)))


def new_capabilities(final: str, *allowed: str) -> list[str]:
    """What `final` uses that none of `allowed` did: an import or sensitive name more often, a name
    that is neither its own (bound in it, and no builtin) nor theirs nor `SAFE_NAMES`, an attribute
    name that is neither theirs nor `SAFE_ATTRIBUTES` (a module that does not parse: ["syntax"])."""
    after = uses(final)
    if after is None:
        return ["syntax"]
    most: Counter[str] = Counter()
    names, attributes = set(SAFE_NAMES), set(SAFE_ATTRIBUTES)
    for code in allowed:
        before = uses(code)
        if before is not None:
            most |= before.counted  # |: the larger count of each
            names |= before.names | before.bound
            attributes |= before.attributes
    own = {name for name in after.bound if name not in _BUILTINS and not _sensitive(name)}
    refused = [name for name, count in after.counted.items() if count > most[name]]
    refused += [f"name {name}" for name in after.names - names - own]
    refused += [f"attribute .{name}" for name in after.attributes - attributes]
    return sorted(set(refused))


def module_bound(*given: str) -> int:
    """The most characters a fixed module may hold: twice the longer of the given modules and 16 KiB
    more. A fix is a few lines; the host's parse of a 1 MiB module took ~6.5 s of CPU and ~650 MB."""
    return 2 * max(map(len, given)) + (16 << 10)


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
