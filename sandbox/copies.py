"""Find, from inside a call, every readable file or archive member that shares most of a text's lines.

A task whose answer is a file (a repository task's original module) is only as safe as the sandbox
is blind to that file and to every copy of it: another interpreter's library, a package's vendored
copy, a wheel or a tarball holding one. `readable_copies` runs a program in the sandbox that walks
all it can read (skipping `/proc`, `/dev` and the call's own files), opens zip archives (wheels,
eggs) and tar archives, nested ones included, and reports each file or member holding more than
`SHARED` of a text's distinct lines (stripped, of `MIN_LINE` characters or more), and each bytecode
file (`.pyc`) holding more than `SHARED` of the function and class names and the strings (of
`MIN_LINE` characters or more) the text compiles to.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from meshrl.sandbox.core import Sandbox

SHARED = 0.5  # "most of its lines": more than half of the text's distinct lines
MIN_LINE = 4  # shorter stripped lines (`else:`, `)`) say nothing of where a text came from
MAX_HITS = 1000
RESULTS = "#meshrl-copies "

WALKER = r"""
import hashlib, io, json, marshal, os, stat, tarfile, types, zipfile

SKIP = ("/proc", "/sys", "/dev", "/work", "/tmp", "/run/meshrl")
MAX_FILE, MAX_MEMBER, MAX_DEPTH = 256 << 20, 32 << 20, 3
WHOLE = (".pyc", ".tar", ".tgz", ".gz", ".bz2", ".xz")  # binary files read whole: bytecode and archives
hits, counts = [], {"files": 0, "members": 0, "unreadable": 0}


def lines_of(data):
    text = data.decode("utf-8", "replace")
    return {hashlib.sha256(s.encode("utf-8", "surrogatepass")).hexdigest()[:16]
            for line in text.splitlines() if len(s := line.strip()) >= MIN_LINE}


def tokens_of(code):
    found, todo = set(), [code]
    while todo:
        code = todo.pop()
        found.add("q:" + code.co_qualname)
        for const in code.co_consts:
            if type(const) is str and len(const) >= MIN_LINE:
                found.add("s:" + const)
            elif type(const) is types.CodeType:
                todo.append(const)
    return {hashlib.sha256(t.encode("utf-8", "surrogatepass")).hexdigest()[:16] for t in found}


def matches(where, wanted_by_name, found):
    for module, wanted in wanted_by_name.items():
        shared = len(wanted & found) / len(wanted)
        if shared > SHARED and len(hits) < MAX_HITS:
            hits.append([module, where, round(shared, 3)])


def compare(where, name, data, depth):
    if data[:4] == b"PK\x03\x04" or data[257:262] == b"ustar" or data[:2] == b"\x1f\x8b" or data[:3] == b"BZh" \
            or data[:6] == b"\xfd7zXZ\x00":
        if depth < MAX_DEPTH:
            archive(where, data, depth + 1)
        return
    if name.endswith(".pyc"):
        try:
            code = marshal.loads(data[16:])
        except Exception:  # another interpreter's bytecode: this one cannot run it
            counts["unreadable"] += 1
            return
        if type(code) is types.CodeType:
            matches(where, TOKENS, tokens_of(code))
    elif b"\0" not in data[:8192]:
        matches(where, TEXTS, lines_of(data))


def archive(where, data, depth):
    try:
        if data[:4] == b"PK\x03\x04":
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                for info in z.infolist():
                    if not info.is_dir() and info.file_size <= MAX_MEMBER:
                        counts["members"] += 1
                        compare(where + "!" + info.filename, info.filename, z.read(info), depth)
        else:
            with tarfile.open(fileobj=io.BytesIO(data)) as t:
                for member in t:
                    if member.isfile() and member.size <= MAX_MEMBER:
                        counts["members"] += 1
                        compare(where + "!" + member.name, member.name, t.extractfile(member).read(), depth)
    except Exception:
        counts["unreadable"] += 1


TEXTS = {name: lines_of(text.encode("utf-8", "surrogatepass")) for name, text in SOURCES.items()}
TOKENS = {name: tokens_of(compile(text, name, "exec")) for name, text in SOURCES.items()}
for folder, dirs, names in os.walk("/"):
    dirs[:] = sorted(d for d in dirs if os.path.join(folder, d) not in SKIP)
    for name in sorted(names):
        path = os.path.join(folder, name)
        try:
            info = os.stat(path, follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_FILE:
                continue
            with open(path, "rb") as f:
                head = f.read(8192)
                if head[:4] == b"PK\x03\x04" or b"\0" not in head or name.endswith(WHOLE):
                    head += f.read()
        except OSError:
            counts["unreadable"] += 1
            continue
        counts["files"] += 1
        compare(path, name, head, 0)
print("\n" + RESULTS + json.dumps({"hits": hits, "counts": counts}), flush=True)
"""


@dataclass(frozen=True)
class Copy:
    """A readable file (or `archive!member`) holding `shared` of the text `name`'s distinct lines."""

    name: str
    path: str
    shared: float


@dataclass(frozen=True)
class Walk:
    copies: list[Copy]
    files: int
    members: int


def readable_copies(sandbox: Sandbox, texts: dict[str, str], hidden: Sequence[Path] = ()) -> Walk:
    """Every readable copy of each text (name -> Python source) in a call of `sandbox` (`hidden`
    unreadable); RuntimeError when the walk reports nothing (a limit it broke)."""
    program = (f"RESULTS, SHARED, MIN_LINE, MAX_HITS = {RESULTS!r}, {SHARED!r}, {MIN_LINE!r}, {MAX_HITS!r}\n"
               f"SOURCES = {texts!r}\n" + WALKER)  # fmt: skip
    run = sandbox.run_python(program, hidden=hidden)
    lines = run.marked(RESULTS)
    if run.limit is not None or len(lines) != 1:
        raise RuntimeError(f"the walk of what the sandbox can read gave no report: {run.report()[-2000:]}")
    report = json.loads(lines[0])
    copies = [Copy(name, path, shared) for name, path, shared in report["hits"]]
    return Walk(copies, report["counts"]["files"], report["counts"]["members"])
