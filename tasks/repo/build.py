"""Fix-the-failing-tests tasks built from real code and its real tests, offline and cached.

A source is a pure-Python module of the standard library with its own `test_<module>.py` (the
interpreter meshrl runs on ships both; nothing is fetched). Each task is that module with one
injected bug (`mutations`), kept only when some tests that pass on the original fail on it:
those are its FAIL_TO_PASS tests, the ones that pass on both its PASS_TO_PASS (SWE-bench's names).
The tests run in the sandbox, one program per run (`runner.run_tests`). The original runs twice:
what each test observed there (its digest) is the expected observation the reward compares with,
and a test that observes differently from one run to the next is in neither list. Building is
deterministic given the seed and the sources, and the result is cached as one JSON file keyed by both.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from meshrl.sandbox import Sandbox
from meshrl.tasks.repo.mutations import Mutation, apply, sites
from meshrl.tasks.repo.runner import run_tests

BUILD_VERSION = 4  # bumped whenever what a build makes changes: older caches are not read


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


def answer_key(modules: list[str], python: str) -> list[Path]:
    """Every copy of `modules` and of their tests (sources and bytecode) in the Python libraries a
    sandbox running `python` sees (its prefix, and /usr's): 7 of the 11 default modules were
    byte-identical in /usr/lib/python3.11, so copying one back was a fix."""
    roots = {Path("/usr"), Path(python).resolve().parent.parent}
    libraries = sorted({lib for root in roots for pattern in ("lib/python3*", "local/lib/python3*")
                        for lib in root.glob(pattern) if lib.is_dir()})  # fmt: skip
    patterns = [p for m in modules for p in (f"{m}.py", f"__pycache__/{m}.*.pyc", f"test/test_{m}.py",
                                             f"test/__pycache__/test_{m}.*.pyc")]  # fmt: skip
    return sorted({path for lib in libraries for p in patterns for path in lib.glob(p)
                   if path.is_file() and not path.is_symlink()})  # fmt: skip


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


@dataclass
class Build:
    """The sources, their tasks and build statistics, and per module what each stable passing test
    observes on the original (test id -> digest): the expected observations the reward compares with."""

    sources: dict[str, Source]
    tasks: list[RepoTask]
    stats: list[BuildStats]
    expected: dict[str, dict[str, str]]


def expected_observations(sandbox: Sandbox, source: Source) -> dict[str, str]:
    """Test id -> digest of every test that passes on the original twice with the same observations;
    a clear error when the module's own tests do not run here (or run another copy of it)."""
    runs = [run_tests(sandbox, source.files(), source.module) for _ in range(2)]
    where = f"/work/{source.module}.py"
    for run in runs:
        if run.tests is None or run.load_error or run.module_file != where:
            raise ValueError(
                f"task.kwargs.modules: {source.module!r}'s own tests do not run here (load error "
                f"{run.load_error}, {run.error or 'a report'}, module imported from {run.module_file}, not {where})"
            )
    first, second = runs
    return {test: digest for test, (outcome, digest) in sorted(first.tests.items())
            if outcome == "pass" and second.tests.get(test) == (outcome, digest)}  # fmt: skip


def build_module(
    sandbox: Sandbox, source: Source, seed: int, tries: int, keep: int
) -> tuple[list[RepoTask], BuildStats, dict[str, str]]:
    """Up to `keep` tasks of one module from at most `tries` mutations drawn with `seed` (`tried`
    counts those whose tests ran: a batch at a time, until `keep` are kept), and the module's
    expected observations."""
    stats = BuildStats(source.module)
    expected = expected_observations(sandbox, source)
    passing = list(expected)
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
                if run.tests is None:
                    stats.no_report += 1
                    continue
                broken = tuple(t for t in passing if run.load_error or run.outcome(t) != "pass")
                if not broken:
                    stats.no_test_broke += 1
                elif len(tasks) < keep:
                    kept = tuple(t for t in passing if t not in broken)
                    tasks.append(RepoTask(task_id(source.module, mutation), source.module, mutation.operator,
                                          mutation.line, mutation.after, mutation.before, broken, kept))  # fmt: skip
                    stats.by_operator[mutation.operator] = stats.by_operator.get(mutation.operator, 0) + 1
    stats.kept = len(tasks)
    return tasks, stats, expected


def build_tasks(sandbox: Sandbox, modules: list[str], seed: int, tries: int, keep: int, cache_dir: str | Path) -> Build:
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
        return Build(sources, tasks, [BuildStats(**s) for s in data["stats"]], data["expected"])
    tasks, stats, expected = [], [], {}
    for source in sources.values():
        start = time.perf_counter()
        built, module_stats, expected[source.module] = build_module(sandbox, source, seed, tries, keep)
        tasks += built
        stats.append(module_stats)
        print(f"repository tasks: {source.module}: {module_stats.kept} kept of {module_stats.tried} mutations tried "
              f"({module_stats.tests} tests, {time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    cache.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{cache.name}.", dir=cache.parent)
    with os.fdopen(fd, "w") as out:
        json.dump({"tasks": [asdict(t) for t in tasks], "stats": [asdict(s) for s in stats], "expected": expected}, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, cache)
    return Build(sources, tasks, stats, expected)
