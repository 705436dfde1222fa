"""What of the host a bubblewrap call can read: the interpreter and what it loads, nothing more.

A policy optimises against whatever answer it can read. A host's `/usr` holds far more than the
interpreter needs: other interpreters' standard libraries (an SDK's bundled CPython), packages with
vendored copies of libraries (setuptools vendors more-itertools), wheels and zips of them. So a call
sees only:

- the interpreter's own standard library (`sysconfig`'s `stdlib` and `platstdlib`, `lib-dynload`
  within), with its `site-packages` (or `dist-packages`) inside it read as an empty directory;
- the directory of programs that holds `bash` (the Bash tool's commands and `python3` itself);
- the directories of the shared objects the interpreter, its extension modules and `bash` load (as
  `ldd` lists them), and the `C.utf8` locale.

A directory that also holds the standard library (a prefix built with `--enable-shared`) is not
bound whole: its shared objects are bound one by one. What is readable is then checked, not assumed:
`meshrl.sandbox.copies` walks it from inside a call (a repository task refuses to build while a copy
of its module is readable).
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshrl.sandbox.core import ENV, SandboxUnavailable

PROBE = """
import glob, json, os, sys, sysconfig
paths = sysconfig.get_paths()
dynload = [p for p in sys.path if os.path.basename(p) == "lib-dynload"]
print(json.dumps({"executable": os.path.realpath(sys.executable),
                  "libraries": sorted({os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib")}),
                  "packages": sorted({os.path.realpath(paths[k]) for k in ("purelib", "platlib")}),
                  "extensions": sorted(glob.glob(os.path.join(dynload[0], "*.so"))) if dynload else []}))
"""
_LIBRARY = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x")
LOCALE = Path("/usr/lib/locale/C.utf8")  # LANG=C.UTF-8 in every call
CALLS_OWN = tuple(map(Path, ("/tmp", "/dev", "/proc", "/work", "/run/meshrl")))  # made by bwrap for the call


@dataclass(frozen=True)
class View:
    """`binds`: host paths bound read-only at the same place; `empty`: directories inside them that read
    as empty (the interpreter's third-party packages); `libraries`: its standard library directories."""

    binds: tuple[Path, ...]
    empty: tuple[Path, ...]
    libraries: tuple[Path, ...]


@functools.cache
def _probe(python: str) -> dict[str, Any]:
    if not Path(python).is_file():
        raise SandboxUnavailable(f"sandbox.python {python!r}: no such interpreter")
    try:
        probe = subprocess.run([python, "-I", "-S", "-c", PROBE], capture_output=True, text=True, timeout=60, env=ENV)
        return json.loads(probe.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired) as error:
        raise SandboxUnavailable(f"sandbox.python {python!r} did not answer what it loads: {error}") from error


def standard_library(python: str) -> tuple[Path, ...]:
    """The directories of `python`'s own standard library."""
    return tuple(Path(p) for p in _probe(python)["libraries"])


@functools.cache
def interpreter_view(python: str) -> View:
    """The view of a call running `python` (resolved once per interpreter); SandboxUnavailable names
    what failed (an interpreter that does not start, no `ldd`)."""
    found = _probe(python)
    bash = shutil.which("bash")
    ldd = shutil.which("ldd")
    if bash is None or ldd is None:
        raise SandboxUnavailable("the bwrap sandbox needs bash and ldd (Debian/Ubuntu: bash, libc-bin)")
    libraries = standard_library(python)
    programs = Path(bash).resolve().parent
    # the call's own environment (no LD_LIBRARY_PATH of this process: the loader inside sees none)
    loaded = subprocess.run(
        [ldd, found["executable"], bash, *found["extensions"]], capture_output=True, text=True, env=ENV
    )
    binds: set[Path] = {*libraries, programs}
    for match in _LIBRARY.finditer(loaded.stdout):
        path = Path(match.group(1))
        for directory, file in ((path.parent.resolve(), path.name), (path.resolve().parent, path.resolve().name)):
            holds_stdlib = any(lib.is_relative_to(directory) for lib in libraries)
            binds.add(directory / file if holds_stdlib else directory)
    if LOCALE.is_dir():
        binds.add(LOCALE)
    binds = {b for b in binds if b.exists() and not any(b != o and b.is_relative_to(o) for o in binds)}
    made = [b for b in binds if any(b.is_relative_to(p) for p in CALLS_OWN)]
    if made:
        raise SandboxUnavailable(f"sandbox.python {python!r} loads from {made[0]}, where each call has its own files")
    inside = [Path(p) for p in found["packages"]]
    inside += [p for lib in libraries for name in ("site-packages", "dist-packages") if (p := lib / name).is_dir()]
    empty = {p for p in inside if p.is_dir() and any(p.is_relative_to(b) for b in binds)}
    return View(tuple(sorted(binds)), tuple(sorted(empty)), libraries)
