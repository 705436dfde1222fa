"""Where a repository task's code comes from: a standard-library module, or a module of a repository
(a directory, a git checkout, a source distribution), with the files its tests need and a record of
its origin that a harness outside meshrl can rebuild the same tree from (`Provenance`).

A source's tree is every regular file of the repository (paths relative to its top folder; a
path with a part that starts with `.` or is `__pycache__` left out). Its workspace carries the
tree's text files but `setup.py` and the top `docs/` folder; a file that is not UTF-8 text is left
out and named. What meshrl adds (an empty `__init__.py` so that the tests' folder imports as a
package) is kept apart (`added`): the export hands it over as the test patch.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import platform
import subprocess
import sysconfig
import tarfile
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path, PurePosixPath

from meshrl.sandbox.copies import MIN_LINE, SHARED

MAX_REPO_BYTES = 8 << 20  # the text files a repository source carries into its workspace, in all
MAX_TREE_BYTES = 256 << 20  # a repository's tree, read once at start-up for its digest


@dataclass(frozen=True)
class Provenance:
    """A source's origin: `kind` (stdlib, sdist, git, directory), the project's `name` and `version`
    (an sdist's PKG-INFO, the interpreter's version, `git describe`), `location` (the path given,
    or a checkout's remote URL), `commit` (a git checkout's HEAD), `tree_digest` (`tree_digest` of
    the tree) and, for the standard library, `layout`: each workspace path's path under its folder."""

    kind: str
    name: str
    version: str
    location: str
    commit: str = ""
    tree_digest: str = ""
    layout: dict[str, str] = field(default_factory=dict)


@dataclass
class Source:
    """A module under test and the repository it lives in: `path` (the module's file), `test_path`
    (its unittest suite), `extra` (every other file the tests may need, the package's own modules
    among them) and `added` (files meshrl adds, not the repository's). `module` names the source:
    task ids, splits and the build cache use it."""

    module: str
    code: str
    tests: str
    path: str = ""
    test_path: str = ""
    extra: dict[str, str] = field(default_factory=dict)
    added: dict[str, str] = field(default_factory=dict)
    provenance: Provenance | None = None
    left_out: tuple[str, ...] = ()  # files of the tree not carried (not UTF-8 text)
    key: str = "task.kwargs.modules"  # the kwarg that named it, for errors

    def __post_init__(self) -> None:
        self.path = self.path or f"{self.module}.py"
        self.test_path = self.test_path or f"tests/test_{self.module}.py"

    @property
    def test_module(self) -> str:
        """The tests' dotted name, as `python3 -m unittest` takes it."""
        return self.test_path.removesuffix(".py").replace("/", ".")

    @property
    def import_name(self) -> str:
        return self.path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")

    def files(self, code: str | None = None) -> dict[str, str]:
        """The repository: the module (or `code` in its place), its tests and the rest."""
        return {**self.extra, **self.added, self.path: self.code if code is None else code, self.test_path: self.tests}


def tree_digest(files: dict[str, bytes]) -> str:
    """SHA-256 of the lines `<sha256 of a file>  <its path>`, sorted by path (what `sha256sum` prints
    for the tree, sorted, then hashed): a rebuilt tree is the same tree when its digest is."""
    lines = "".join(f"{hashlib.sha256(data).hexdigest()}  {name}\n" for name, data in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def in_tree(name: str) -> bool:
    """A path a source's tree keeps: none of its parts starts with `.` or is `__pycache__`."""
    return not any(part.startswith(".") or part == "__pycache__" for part in PurePosixPath(name).parts)


def load_source(module: str, key: str = "task.kwargs.modules") -> Source:
    """The standard library's `module.py` and `test/test_module.py`; an error naming `key` when either is missing."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    code, tests = lib / f"{module}.py", lib / "test" / f"test_{module}.py"
    for path in (code, tests):
        if not path.is_file():
            raise ValueError(
                f"{key}: {module!r} needs {path}, which this interpreter does not ship "
                "(a pure-Python standard library module with its tests)"
            )
    source = Source(module, code.read_text(), tests.read_text(), added={"tests/__init__.py": ""}, key=key)
    layout = {source.path: f"{module}.py", source.test_path: f"test/test_{module}.py"}
    digest = tree_digest({source.path: code.read_bytes(), source.test_path: tests.read_bytes()})
    source.provenance = Provenance("stdlib", "cpython", platform.python_version(), str(lib), "", digest, layout)
    return source


def repo_specs(repos: list[dict[str, str]] | None) -> list[dict[str, str]]:
    """`task.kwargs.repos`, checked: each a table of `repo`, `module` and `tests` (strings)."""
    specs = []
    for i, spec in enumerate(repos or []):
        if (
            not isinstance(spec, dict)
            or set(spec) != {"repo", "module", "tests"}
            or not all(isinstance(v, str) for v in spec.values())
        ):
            raise ValueError(f"task.kwargs.repos[{i}]: a table of repo, module and tests (strings), got {spec!r}")
        specs.append(spec)
    return specs


def repository_source(repo: str, module: str, tests: str, key: str = "task.kwargs.repos") -> Source:
    """`module` (a path such as `more_itertools/recipes.py`) of the repository `repo` (a directory,
    or a source distribution `.tar.gz` as `pip download --no-binary :all:` saves it), its unittest
    suite `tests`, and the rest of its tree that a workspace carries. Errors name `key`, what was
    looked for where, and the likely fix."""
    where = Path(repo).expanduser()
    top = ""  # an sdist's top folder, which its paths are relative to
    if where.is_dir():
        tree, provenance = _directory_tree(where, repo, key)
    elif where.is_file() and where.name.endswith((".tar.gz", ".tgz")):
        tree, provenance, top = _sdist_tree(where, repo, key)
    elif where.is_file():
        raise ValueError(f"{key}.repo: {repo!r} is a file but not a .tar.gz source distribution (a wheel or zip "
                         "ships no tests: `pip download --no-binary :all: NAME==VERSION` saves the sdist)")  # fmt: skip
    else:
        resolved = f" (resolved against the current directory, {Path.cwd()})" if not where.is_absolute() else ""
        fix = ("the set-up installs it: make setup" if "meshrl-sources" in repo
               else "give a directory or a .tar.gz source distribution; an absolute path does not depend on where meshrl runs")  # fmt: skip
        raise ValueError(
            f"{key}.repo: {repo!r}: no such directory or .tar.gz file at {where.absolute()}{resolved}; {fix}"
        )
    for name, wanted in (("module", module), ("tests", tests)):
        if wanted not in tree:
            raise ValueError(f"{key}.{name}: {repo!r} has no {wanted!r}{_missing_hint(wanted, tree, top)}")
    carried, left_out = {}, []
    for name, data in tree.items():
        if name == "setup.py" or name.startswith("docs/"):
            continue
        try:
            carried[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            left_out.append(name)
    for name, wanted in (("module", module), ("tests", tests)):
        if wanted in left_out:
            raise ValueError(f"{key}.{name}: {wanted!r} in {repo!r} is not UTF-8 text")
    if sum(len(text) for text in carried.values()) > MAX_REPO_BYTES:
        raise ValueError(f"{key}.repo: {repo!r} carries over {MAX_REPO_BYTES >> 20} MiB of text files into a workspace")
    _refuse_copies_of(module, carried, repo, key)
    added = {}
    if "/" in tests and f"{tests.rsplit('/', 1)[0]}/__init__.py" not in carried:
        added[f"{tests.rsplit('/', 1)[0]}/__init__.py"] = ""  # `python3 -m unittest tests.test_x` imports the folder
    name = module.removesuffix(".py").replace("/", ".")
    extra = {k: v for k, v in carried.items() if k not in (module, tests)}
    return Source(name, carried[module], carried[tests], module, tests, extra, added, provenance, tuple(left_out), key)


def _refuse_copies_of(module: str, carried: dict[str, str], repo: str, key: str) -> None:
    """A workspace file holding most of the module's lines (a `build/lib/` copy, a backup) would be
    the answer in reach of the policy: refused by name, as the sandbox's readable copies are."""
    wanted = _lines(carried[module])
    for name, text in carried.items():
        shared = len(wanted & _lines(text)) / max(1, len(wanted))
        if name != module and shared > SHARED:
            raise ValueError(f"{key}.repo: {repo!r}: {name!r} holds {shared:.0%} of the lines of {module!r}, so a task's "
                             "answer would be in its workspace; remove that copy from the repository")  # fmt: skip


def _lines(text: str) -> set[str]:
    return {stripped for line in text.splitlines() if len(stripped := line.strip()) >= MIN_LINE}


def _missing_hint(wanted: str, tree: dict[str, bytes], top: str) -> str:
    """Why a path is not in the tree: an sdist's paths start below its top folder; else the nearest."""
    if top and wanted.startswith(f"{top}/") and wanted.removeprefix(f"{top}/") in tree:
        return f" (paths inside a source distribution are relative to its top folder {top!r}: write {wanted.removeprefix(f'{top}/')!r})"
    close = difflib.get_close_matches(wanted, [n for n in tree if n.endswith(".py")], n=2, cutoff=0.5)
    where = f"relative to its top folder {top!r}" if top else "relative to the repository's folder"
    return f" (paths are {where}" + (f"; did you mean {' or '.join(map(repr, close))}?)" if close else ")")


def _bounded(total: int, repo: str, key: str) -> None:
    if total > MAX_TREE_BYTES:
        raise ValueError(f"{key}.repo: {repo!r} is over {MAX_TREE_BYTES >> 20} MiB (its files are read at every start)")


# Folders of a directory's tree that are built or installed, not written: never read.
BUILT = frozenset({"build", "dist", "node_modules", "venv", "env", "site-packages"})


def _directory_tree(where: Path, repo: str, key: str) -> tuple[dict[str, bytes], Provenance]:
    """A directory's tree: a git checkout's tracked files when its tracked files are as committed
    (then `base_commit` rebuilds it); otherwise every file but hidden, `__pycache__`, built and
    installed folders (BUILT, `*.egg-info`)."""
    git = _git(where) if (where / ".git").exists() else None
    if git is not None and not git.dirty:
        names = git.tracked
    else:
        names = []
        for folder, dirs, files in os.walk(where):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__" and d not in BUILT
                             and not d.endswith(".egg-info"))  # fmt: skip
            names += [(Path(folder) / f).relative_to(where).as_posix() for f in files]
    tree, total = {}, 0
    for name in sorted(names):
        path = where / name
        if path.is_file() and not path.is_symlink() and in_tree(name):
            tree[name] = path.read_bytes()
            total += len(tree[name])
            _bounded(total, repo, key)
    title, location = where.resolve().name, str(where.resolve())
    if git is not None and not git.dirty:
        return tree, Provenance("git", title, git.described, git.url or location, git.commit, tree_digest(tree))
    return tree, Provenance("directory", title, git.described if git else "", location, tree_digest=tree_digest(tree))


@dataclass(frozen=True)
class Checkout:
    """A git checkout: its remote, HEAD, `git describe --tags --always --dirty`, tracked files, and
    whether a tracked file differs from HEAD (then HEAD does not rebuild the tree)."""

    url: str
    commit: str
    described: str
    tracked: list[str]
    dirty: bool


def _git(where: Path) -> Checkout | None:
    """The checkout at `where`, None without git (or not one)."""

    def ask(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=60)
        return done.stdout.strip() if done.returncode == 0 else ""

    try:
        commit = ask("rev-parse", "HEAD")
        if not commit:
            return None
        tracked = [name for name in ask("ls-files", "-z").split("\0") if name]
        dirty = bool(ask("status", "--porcelain", "--untracked-files=no"))
        return Checkout(ask("remote", "get-url", "origin"), commit, ask("describe", "--tags", "--always", "--dirty"),
                        tracked, dirty)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None


def _sdist_tree(where: Path, repo: str, key: str) -> tuple[dict[str, bytes], Provenance, str]:
    """The sdist's files below its top folder, its name and version (PKG-INFO, else the file's name)
    and that folder."""
    with tarfile.open(where) as archive:
        members = [m for m in archive.getmembers() if m.isfile()]
        top = os.path.commonpath([m.name for m in members]) if len(members) > 1 else ""
        tree, total = {}, 0
        for member in members:
            name = PurePosixPath(os.path.relpath(member.name, top)).as_posix()
            if in_tree(name):
                tree[name] = archive.extractfile(member).read()
                total += len(tree[name])
                _bounded(total, repo, key)
    fields = HeaderParser().parsestr(tree.get("PKG-INFO", b"").decode("utf-8", "replace"))  # its header only
    stem = where.name.removesuffix(".tar.gz").removesuffix(".tgz")
    name, _, version = stem.rpartition("-")
    provenance = Provenance("sdist", fields.get("Name") or name or stem, fields.get("Version") or version, str(where.resolve()),
                            tree_digest=tree_digest(tree))  # fmt: skip
    return tree, provenance, top


def is_stdlib_source(module: str) -> bool:
    """The standard library ships `module.py` and its `test/test_module.py`."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    return (lib / f"{module}.py").is_file() and (lib / "test" / f"test_{module}.py").is_file()


def sources_of(modules: list[str], eval_modules: list[str], repos: list[dict[str, str]] | None) -> list[Source]:
    """The sources `task.kwargs` name: the standard-library `modules`, then `repos`, each module
    once; a held-out name of `eval_modules` that is neither is built from the standard library when
    it ships it. A module named twice, or a held-out name that is no source, is refused naming its key."""
    repositories = [
        repository_source(**spec, key=f"task.kwargs.repos[{i}]") for i, spec in enumerate(repo_specs(repos))
    ]
    named: dict[str, str] = {}
    for key, module in [*((f"task.kwargs.modules[{i}]", m) for i, m in enumerate(modules)),
                        *((f"{s.key}.module", s.module) for s in repositories)]:  # fmt: skip
        if module in named:
            raise ValueError(f"{key}: {module!r} is already {named[module]}: a module is one source with one test "
                             "suite (a second entry would replace the first's tests)")  # fmt: skip
        named[module] = key
    extra: dict[str, str] = {}  # held-out standard-library modules named in eval_modules alone -> key
    for i, module in enumerate(eval_modules):
        if module in named or module in extra:
            continue
        if not is_stdlib_source(module):
            close = difflib.get_close_matches(module, named, n=1)
            raise ValueError(
                f"task.kwargs.eval_modules[{i}]: {module!r} is none of the sources ({', '.join(named) or 'none'}) "
                "and no standard-library module with its tests"
                + (f" — did you mean {close[0]!r}?" if close else " (a repository's module goes by its dotted name)")
            )
        extra[module] = f"task.kwargs.eval_modules[{i}]"
    return (
        [load_source(module, named[module]) for module in modules]
        + [load_source(module, key) for module, key in extra.items()]
        + repositories
    )
