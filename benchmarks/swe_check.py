"""Rebuild each exported instance's base tree from its record alone, outside meshrl, and check it:
the tree's digest is the record's, FAIL_TO_PASS fail and PASS_TO_PASS pass with the bug patched in,
and all of them pass with the gold patch on top.

    meshrl tasks build @ configs/local.toml @ configs/repo_fix.toml --export tasks.jsonl
    python benchmarks/swe_check.py tasks.jsonl [--sources DIR] [--first N]

Sources by `source.kind`: `sdist`, `NAME-VERSION.tar.gz` from `--sources` (default the set-up's
`.venv/share/meshrl-sources`), else `pip download --no-deps --no-binary :all: NAME==VERSION` (network);
`git`, a clone of `source.location` at `source.commit` (network); `directory`, the folder itself;
`stdlib`, this interpreter's standard library when its version is the record's. The tree is every
regular file below the source's top folder but paths with a part starting with `.` or named
`__pycache__`; its digest is SHA-256 of its `sha256sum` lines sorted by path. The tests run here
with `python3 -m unittest`'s loader (the test module's own `load_tests`, doctests included), not in
meshrl's sandbox. Nothing here imports meshrl.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

REPO = Path(__file__).resolve().parent.parent
# Runs in the tree: each wanted test id's outcome (pass, fail, missing) as one JSON line; tests that
# do not import all fail, as meshrl's runner counts them.
OUTCOMES = """
import json, sys, unittest
wanted = set(json.loads(sys.argv[2]))
found, load_failed = {}, []
def walk(suite):
    for test in suite:
        if isinstance(test, unittest.TestSuite):
            walk(test)
        elif type(test).__name__ == "_FailedTest":  # how unittest reports a module that did not import
            load_failed.append(test)
        elif test.id() in wanted:
            found[test.id()] = test
try:
    walk(unittest.defaultTestLoader.loadTestsFromName(sys.argv[1]))
except Exception:
    load_failed.append(sys.argv[1])
if load_failed:  # the tests do not even import (a bug at import time): every one of them fails
    print(json.dumps({test_id: "fail" for test_id in wanted}))
    raise SystemExit(0)
outcomes = {}
for test_id in sorted(wanted):
    if test_id not in found:
        outcomes[test_id] = "missing"
        continue
    result = unittest.TestResult()
    found[test_id].run(result)
    outcomes[test_id] = "pass" if result.wasSuccessful() else "fail"
print(json.dumps(outcomes))
"""


def in_tree(name: str) -> bool:
    return not any(part.startswith(".") or part == "__pycache__" for part in PurePosixPath(name).parts)


def digest(root: Path) -> str:
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    lines = "".join(f"{hashlib.sha256((root / n).read_bytes()).hexdigest()}  {n}\n" for n in files if in_tree(n))
    return hashlib.sha256(lines.encode()).hexdigest()


def sdist(source: dict, sources: Path, scratch: Path) -> Path:
    """The sdist's archive: from `sources`, else downloaded."""
    for stem in {source["name"], source["name"].replace("-", "_"), source["name"].replace("_", "-")}:
        found = sources / f"{stem}-{source['version']}.tar.gz"
        if found.is_file():
            return found
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(scratch),
                    f"{source['name']}=={source['version']}"], check=True, capture_output=True)  # fmt: skip
    return next(scratch.glob("*.tar.gz"))


def base_tree(source: dict, sources: Path, root: Path) -> None:
    """Write the record's base tree into the empty folder `root`."""
    kind = source["kind"]
    if kind == "sdist":
        with tempfile.TemporaryDirectory() as scratch, tarfile.open(sdist(source, sources, Path(scratch))) as archive:
            members = [m for m in archive.getmembers() if m.isfile()]
            top = os.path.commonpath([m.name for m in members]) if len(members) > 1 else ""
            for member in members:
                name = os.path.relpath(member.name, top)
                if in_tree(name):
                    (root / name).parent.mkdir(parents=True, exist_ok=True)
                    (root / name).write_bytes(archive.extractfile(member).read())
    elif kind == "git":
        subprocess.run(["git", "clone", "-q", source["location"], str(root)], check=True)
        subprocess.run(["git", "-C", str(root), "checkout", "-q", source["commit"]], check=True)
    elif kind == "directory":
        shutil.copytree(source["location"], root, dirs_exist_ok=True)
    elif kind == "stdlib":
        here = ".".join(map(str, sys.version_info[:3]))
        if here != source["version"]:
            raise SystemExit(f"the record's standard library is Python {source['version']}, this is {here}")
        lib = Path(sysconfig.get_paths()["stdlib"])
        for name, where in source["layout"].items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(lib / where, root / name)
    else:
        raise SystemExit(f"unknown source kind {kind!r}")


def apply(root: Path, patch: str) -> None:
    if patch:
        subprocess.run(["git", "apply", "-"], cwd=root, input=patch, text=True, check=True, capture_output=True)


def outcomes(root: Path, test_module: str, tests: list[str]) -> dict[str, str]:
    """The tests' outcomes in a fresh copy of the tree, as each meshrl run is: files a run before left
    (a .pyc the tests' own subprocesses wrote, an output file) cannot stand in for the patched tree."""
    with tempfile.TemporaryDirectory() as scratch:
        fresh = Path(scratch) / "tree"
        shutil.copytree(root, fresh)
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        done = subprocess.run([sys.executable, "-B", "-c", OUTCOMES, test_module, json.dumps(tests)], cwd=fresh,
                              env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the tests did not run: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check(instance: dict, sources: Path) -> list[str]:
    """What is wrong with the instance rebuilt from its record (nothing: an empty list)."""
    source = instance["source"]
    test_module = instance["test_command"].removeprefix("python3 -m unittest ")
    f2p, p2p = json.loads(instance["FAIL_TO_PASS"]), json.loads(instance["PASS_TO_PASS"])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "tree"
        root.mkdir()
        base_tree(source, sources, root)
        problems = [] if digest(root) == instance["tree_digest"] else ["the rebuilt tree's digest differs"]
        apply(root, instance["test_patch"])
        apply(root, instance["bug_patch"])
        buggy = outcomes(root, test_module, f2p + p2p)
        problems += [f"{t} {buggy[t]} with the bug (expected fail)" for t in f2p if buggy[t] != "fail"]
        problems += [f"{t} {buggy[t]} with the bug (expected pass)" for t in p2p if buggy[t] != "pass"]
        apply(root, instance["patch"])
        fixed = outcomes(root, test_module, f2p + p2p)
        problems += [f"{t} {fixed[t]} with the gold patch (expected pass)" for t in f2p + p2p if fixed[t] != "pass"]
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("instances", type=Path, help="a JSONL file of `meshrl tasks build --export`")
    parser.add_argument("--sources", type=Path, default=REPO / ".venv" / "share" / "meshrl-sources")
    parser.add_argument("--first", type=int, default=None, help="check only the first N instances")
    args = parser.parse_args()
    instances = [json.loads(line) for line in args.instances.read_text().splitlines() if line.strip()]
    failed = 0
    for instance in instances[: args.first]:
        try:
            problems = check(instance, args.sources)
        except (OSError, RuntimeError, subprocess.SubprocessError, tarfile.TarError, StopIteration) as exc:
            problems = [f"not rebuilt: {type(exc).__name__}: {str(exc)[-500:]}"]
        failed += bool(problems)
        detail = "".join(f"\n     {problem}" for problem in problems)
        print(f"{'FAIL' if problems else 'ok  '} {instance['instance_id']} ({instance['repo']} {instance['version']}){detail}",
              flush=True)  # fmt: skip
    print(f"{len(instances[: args.first]) - failed} of {len(instances[: args.first])} instances rebuilt and checked")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
