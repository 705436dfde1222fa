"""Fix-the-failing-tests tasks built from real code and its real tests, offline and cached.

A source is a pure-Python module of the standard library with its own `test_<module>.py` (the
interpreter meshrl runs on ships both; nothing is fetched). Each task is that module with one
injected bug (`mutations`), kept only when some tests that pass on the original fail on it:
those are its FAIL_TO_PASS tests, the ones that pass on both its PASS_TO_PASS (SWE-bench's names).
The tests run in the sandbox, one program per run (`run_tests`). Building is deterministic given
the seed and the sources, and the result is cached as one JSON file keyed by both.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import secrets
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from meshrl.sandbox import Sandbox
from meshrl.tasks.repo.mutations import Mutation, apply, sites

BUILD_VERSION = 3  # bumped whenever what a build makes changes: older caches are not read
RESULTS = "#meshrl-tests "
# Runs in the sandbox: writes the repository's files, runs every test of the test module one by one
# (their output discarded: only the outcomes come back), and prints the outcomes on one line after
# a nonce the code under test never sees (the scorer refuses code that could look for it: `scoring`).
RUNNER = """
import io, json, os, sys, unittest


def tests_of(suite):
    for test in suite:
        if isinstance(test, unittest.TestSuite):
            yield from tests_of(test)
        else:
            yield test


def outcome(result):
    if result.errors or result.failures or result.unexpectedSuccesses:
        return "fail"
    return "skip" if result.skipped else "pass"


def main(files, test_module, module, nonce):
    for name, text in files.items():
        os.makedirs(os.path.dirname(name) or ".", exist_ok=True)
        with open(name, "w") as out:
            out.write(text)
    sys.path.insert(0, os.getcwd())
    report = {"outcomes": {}, "load_error": None, "module_file": None}
    real_out, real_err = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = io.StringIO()
    try:
        suite = unittest.defaultTestLoader.loadTestsFromName(test_module)
        for test in tests_of(suite):
            result = unittest.TestResult()
            test.run(result)
            report["outcomes"][test.id()] = outcome(result)
            sys.stdout.seek(0)
            sys.stdout.truncate()
    except BaseException as error:
        report["load_error"] = type(error).__name__
    finally:
        sys.stdout, sys.stderr = real_out, real_err
    report["module_file"] = getattr(sys.modules.get(module), "__file__", None)
    print("\\n" + RESULTS + nonce + " " + json.dumps(report), flush=True)
"""


@dataclass(frozen=True)
class TestRun:
    """A run of a repository's tests: each test's outcome (`pass`, `fail`, `skip`), or None when the
    run gave no report (a limit, a crash); `load_error` when the test module did not import."""

    outcomes: dict[str, str] | None
    load_error: str | None = None
    module_file: str | None = None
    limit: str | None = None


def run_tests(sandbox: Sandbox, files: dict[str, str], module: str) -> TestRun:
    """Run `tests/test_<module>.py` against `files` in a fresh sandbox call."""
    nonce = secrets.token_hex(16)
    program = f"RESULTS = {RESULTS!r}\n" + RUNNER + f"\nmain({files!r}, 'tests.test_{module}', {module!r}, {nonce!r})\n"
    run = sandbox.run_python(program)
    lines = [line for line in run.stdout.split("\n") if line.startswith(RESULTS + nonce + " ")]
    if run.limit is not None or len(lines) != 1:
        return TestRun(None, limit=run.limit or f"exit status {run.exit_code}")
    report = json.loads(lines[0][len(RESULTS) + len(nonce) + 1 :])
    return TestRun(report["outcomes"], report["load_error"], report["module_file"])


@dataclass(frozen=True)
class RepoTask:
    """One task: `module` with one bug, the lines the bug changed, and the hidden tests."""

    task_id: str
    module: str
    operator: str
    line: int
    buggy_line: str
    original_line: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]


@dataclass
class Source:
    """A module and its tests, as the interpreter ships them."""

    module: str
    code: str
    tests: str

    def files(self, code: str | None = None) -> dict[str, str]:
        """The repository: the module (or `code` in its place), its tests, an empty test package."""
        return {f"{self.module}.py": self.code if code is None else code, "tests/__init__.py": "",
                f"tests/test_{self.module}.py": self.tests}  # fmt: skip

    def buggy(self, task: RepoTask) -> str:
        """The module with the task's bug (the task holds the one line that differs)."""
        lines = self.code.splitlines(keepends=True)
        ending = lines[task.line - 1][len(task.original_line) :]
        lines[task.line - 1] = task.buggy_line + ending
        return "".join(lines)


def load_source(module: str) -> Source:
    """The standard library's `module.py` and `test/test_module.py`; a clear error when either is missing."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    code, tests = lib / f"{module}.py", lib / "test" / f"test_{module}.py"
    for path in (code, tests):
        if not path.is_file():
            raise ValueError(
                f"task.kwargs.modules: {module!r} needs {path}, which this interpreter does not ship "
                "(a pure-Python standard library module with its tests)"
            )
    return Source(module, code.read_text(), tests.read_text())


@dataclass
class BuildStats:
    """What a module's build tried and kept (reported in the guide)."""

    module: str
    tests: int = 0
    sites: int = 0
    tried: int = 0
    kept: int = 0
    no_test_broke: int = 0
    no_report: int = 0
    by_operator: dict[str, int] = field(default_factory=dict)


def task_id(module: str, mutation: Mutation) -> str:
    """A task's id from its bug alone (module, line, operator and the buggy line's text), so that two
    builds name the same bug alike whatever else each kept: an outside worker builds its own."""
    digest = hashlib.sha256(f"{mutation.line}\n{mutation.after}".encode()).hexdigest()[:6]
    return f"{module}-L{mutation.line}-{mutation.operator}-{digest}"


def build_module(
    sandbox: Sandbox, source: Source, seed: int, tries: int, keep: int
) -> tuple[list[RepoTask], BuildStats]:
    """Up to `keep` tasks of one module from at most `tries` mutations drawn with `seed` (`tried`
    counts those whose tests ran: a batch at a time, until `keep` are kept)."""
    stats = BuildStats(source.module)
    original = run_tests(sandbox, source.files(), source.module)
    expected = f"/work/{source.module}.py"
    if original.outcomes is None or original.load_error or original.module_file != expected:
        raise ValueError(
            f"task.kwargs.modules: {source.module!r}'s own tests do not run here (load error "
            f"{original.load_error}, limit {original.limit}, module imported from {original.module_file}, not {expected})"
        )
    passing = sorted(t for t, o in original.outcomes.items() if o == "pass")
    stats.tests = len(passing)
    candidates = sites(source.code)
    stats.sites = len(candidates)
    random.Random(f"{seed}:{source.module}").shuffle(candidates)
    mutations = [m for m in (apply(source.code, site) for site in candidates[:tries]) if m is not None]
    tasks: list[RepoTask] = []
    batch = 2 * sandbox.config.pool_size
    with ThreadPoolExecutor(sandbox.config.pool_size) as pool:
        for at in range(0, len(mutations), batch):  # in batches: the build stops once `keep` are kept
            if len(tasks) >= keep:
                break
            chunk = mutations[at : at + batch]
            runs = pool.map(lambda m: run_tests(sandbox, source.files(m.source), source.module), chunk)
            for mutation, run in zip(chunk, runs):
                stats.tried += 1
                if run.outcomes is None:
                    stats.no_report += 1
                    continue
                broken = tuple(t for t in passing if run.load_error or run.outcomes.get(t) != "pass")
                if not broken:
                    stats.no_test_broke += 1
                elif len(tasks) < keep:
                    kept = tuple(t for t in passing if t not in broken)
                    tasks.append(RepoTask(task_id(source.module, mutation), source.module, mutation.operator,
                                          mutation.line, mutation.after, mutation.before, broken, kept))  # fmt: skip
                    stats.by_operator[mutation.operator] = stats.by_operator.get(mutation.operator, 0) + 1
    stats.kept = len(tasks)
    return tasks, stats


def build_tasks(
    sandbox: Sandbox, modules: list[str], seed: int, tries: int, keep: int, cache_dir: str | Path
) -> tuple[dict[str, Source], list[RepoTask], list[BuildStats]]:
    """Every module's tasks, from the cache when a build of the same sources and settings (the
    sandbox's time limits among them: they decide which mutations report) is there.
    The cache file is written whole (a temporary file renamed over it), so concurrent builders agree."""
    sources = {module: load_source(module) for module in modules}
    key = hashlib.sha256(
        json.dumps(
            [
                BUILD_VERSION,
                seed,
                tries,
                keep,
                sandbox.config.cpu_time_s,
                sandbox.config.wall_time_s,
                [(s.module, s.code, s.tests) for s in sources.values()],
            ]
        ).encode()  # fmt: skip
    ).hexdigest()[:16]
    cache = Path(cache_dir).expanduser() / f"repo_tasks-{key}.json"
    if cache.is_file():
        data = json.loads(cache.read_text())
        tasks = [RepoTask(**{**t, "fail_to_pass": tuple(t["fail_to_pass"]), "pass_to_pass": tuple(t["pass_to_pass"])})
                 for t in data["tasks"]]  # fmt: skip
        return sources, tasks, [BuildStats(**s) for s in data["stats"]]
    tasks, stats = [], []
    for source in sources.values():
        start = time.perf_counter()
        built, module_stats = build_module(sandbox, source, seed, tries, keep)
        tasks += built
        stats.append(module_stats)
        print(f"repository tasks: {source.module}: {module_stats.kept} kept of {module_stats.tried} mutations tried "
              f"({module_stats.tests} tests, {time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    cache.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{cache.name}.", dir=cache.parent)
    with os.fdopen(fd, "w") as out:
        json.dump({"tasks": [asdict(t) for t in tasks], "stats": [asdict(s) for s in stats]}, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, cache)
    return sources, tasks, stats
