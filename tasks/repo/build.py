"""Fix-the-failing-tests tasks built from real code and its real tests, offline and cached.

A source (`sources`) is a pure-Python module with its own unittest suite: of the standard library
(the interpreter meshrl runs on ships both; nothing is fetched) or of a repository. Each task is that module with one
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
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from meshrl.sandbox import Sandbox
from meshrl.sandbox.copies import readable_copies
from meshrl.sandbox.view import standard_library
from meshrl.tasks.repo.mutations import Mutation, apply, sites
from meshrl.tasks.repo.runner import TestRun, run_tests
from meshrl.tasks.repo.sources import Source

BUILD_VERSION = 8  # bumped whenever what a build makes changes: older caches are not read


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


def buggy_code(source: Source, task: RepoTask) -> str:
    """The module with the task's bug (the task holds the one line that differs)."""
    lines = source.code.splitlines(keepends=True)
    ending = lines[task.line - 1][len(task.original_line) :]
    lines[task.line - 1] = task.buggy_line + ending
    return "".join(lines)


def answer_key(source: Source, python: str) -> list[Path]:
    """Every copy of the source's module and of its tests (sources and bytecode) in the standard
    library of `python`, the one library a sandbox call reads: the calls of the source's tasks hide
    them (7 of the 11 default modules were byte-identical there, so copying one back was a fix)."""
    found = set()
    for wanted in (source.path, source.test_path):
        stem, name = Path(wanted).stem, Path(wanted).name
        module_dir = str(Path(wanted).parent) if "/" in wanted and wanted != source.test_path else ""
        for lib in standard_library(python):
            for path in lib.rglob(name):
                if path.is_file() and not path.is_symlink() and str(path.parent).endswith(module_dir):
                    found.add(path)
                    found.update(p for p in (path.parent / "__pycache__").glob(f"{stem}.*.pyc") if p.is_file())
    return sorted(found)


def refuse_readable_copies(sandbox: Sandbox, sources: Sequence[Source], answer_keys: dict[str, list[Path]]) -> None:
    """Walk what a call of `sandbox` can read (`copies`) and refuse, naming each, any file or archive
    member sharing most of a source module's lines (or its bytecode) that its answer key does not
    hide: a task whose answer is readable is no task."""
    walk = readable_copies(sandbox, {source.module: source.code for source in sources})
    found = [c for c in walk.copies if Path(c.path) not in answer_keys.get(c.name, ())]
    if found:
        listed = "; ".join(f"{c.name}: {c.path} ({c.shared:.0%} shared)" for c in found[:20])
        raise ValueError(
            f"task.kwargs: a copy of a task's module is readable in the sandbox, so its answer is too ({listed}). "
            "Point sandbox.python at an interpreter whose standard library holds no copy of it, or drop the module"
        )


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
    left_out: dict[str, str] = field(default_factory=dict)  # tests in neither list: test id -> why

    def said(self) -> str:
        """The build's line for the module: what it kept, and which tests it left out and why."""
        line = f"{self.kept} kept of {self.tried} mutations tried ({self.tests} tests"
        if self.left_out:
            named = ", ".join(
                f"{'.'.join(test.split('.')[-2:])} ({why})" for test, why in list(self.left_out.items())[:4]
            )
            more = f" and {len(self.left_out) - 4} more" if len(self.left_out) > 4 else ""
            line += f"; {len(self.left_out)} left out: {named}{more}"
        return line + ")"


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


def source_tests(sandbox: Sandbox, source: Source, code: str | None = None, hidden: Sequence[Path] = ()) -> TestRun:
    """The source's tests on `code` in its place (the original when None)."""
    return run_tests(sandbox, source.files(code), source.test_module, source.import_name, hidden)


LEFT_OUT = {"fail": "fails on the original here", "skip": "skipped here", "unstable": "observes differently run to run"}


def expected_observations(
    sandbox: Sandbox, source: Source, hidden: Sequence[Path] = ()
) -> tuple[dict[str, str], dict[str, str]]:
    """Test id -> digest of every test that passes on the original twice with the same observations,
    run as the reward runs them (`hidden`: the answer key unreadable; a test that starts a fresh
    interpreter on the library's copy of the module fails there, so it is in neither list), and
    test id -> why of the others; a clear error when the module's own tests do not run here (or run
    another copy of it)."""
    runs = [source_tests(sandbox, source, hidden=hidden) for _ in range(2)]
    where = f"/work/{source.path}"
    for run in runs:
        if run.tests is None or run.load_error or run.module_file != where:
            raise ValueError(
                f"{source.key}: {source.module!r}'s own tests do not run here (load error "
                f"{run.load_error}, {run.error or 'a report'}, module imported from {run.module_file}, not {where})"
            )
    first, second = runs
    expected, left_out = {}, {}
    for test, (outcome, digest) in sorted(first.tests.items()):
        if outcome == "pass" and second.tests.get(test) == (outcome, digest):
            expected[test] = digest
        else:
            left_out[test] = LEFT_OUT["unstable" if outcome == "pass" else outcome]
    if not expected:
        raise ValueError(f"{source.key}: {source.module!r}: {source.test_path} gave no passing unittest test "
                         "(suites are run with unittest: pytest-style test functions are not collected)")  # fmt: skip
    return expected, left_out


def build_module(
    sandbox: Sandbox, source: Source, seed: int, tries: int, keep: int, hidden: Sequence[Path] = ()
) -> tuple[list[RepoTask], BuildStats, dict[str, str]]:
    """Up to `keep` tasks of one module from at most `tries` mutations drawn with `seed` (`tried`
    counts those whose tests ran: a batch at a time, until `keep` are kept), and the module's
    expected observations; every run with `hidden` unreadable, as the reward runs the tests."""
    stats = BuildStats(source.module)
    expected, stats.left_out = expected_observations(sandbox, source, hidden)
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
            runs = pool.map(lambda m: source_tests(sandbox, source, m.source, hidden), chunk)
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


def build_tasks(
    sandbox: Sandbox,
    sources_list: list[Source],
    seed: int,
    tries: int,
    keep: int,
    cache_dir: str | Path,
    answer_keys: dict[str, list[Path]] | None = None,
) -> Build:
    """Every source's tasks, from the cache when a build of the same sources and settings (the
    sandbox's time limits among them: they decide which mutations report) is there.
    The cache file is written whole (a temporary file renamed over it), so concurrent builders agree."""
    sources = {source.module: source for source in sources_list}
    key = hashlib.sha256(
        json.dumps(
            [
                BUILD_VERSION,
                seed,
                tries,
                keep,
                sandbox.config.cpu_time_s,
                sandbox.config.wall_time_s,
                [(s.module, s.path, s.test_path, s.code, s.tests, s.extra, s.added) for s in sources.values()],
                {module: sorted(map(str, paths)) for module, paths in sorted((answer_keys or {}).items())},
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
    print(f"repository tasks: building {len(sources)} source(s) into {cache} (once; later starts read it)", flush=True)
    for source in sources.values():
        start = time.perf_counter()
        hidden = (answer_keys or {}).get(source.module, ())
        built, module_stats, expected[source.module] = build_module(sandbox, source, seed, tries, keep, hidden)
        tasks += built
        stats.append(module_stats)
        print(
            f"repository tasks: {source.module}: {module_stats.said()}, {time.perf_counter() - start:.0f} s", flush=True
        )
        if source.left_out:
            print(f"repository tasks: {source.module}: not carried into workspaces (not UTF-8 text): "
                  f"{', '.join(source.left_out[:8])}{' and more' if len(source.left_out) > 8 else ''}", flush=True)  # fmt: skip
    cache.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{cache.name}.", dir=cache.parent)
    with os.fdopen(fd, "w") as out:
        json.dump({"tasks": [asdict(t) for t in tasks], "stats": [asdict(s) for s in stats], "expected": expected}, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, cache)
    return Build(sources, tasks, stats, expected)
