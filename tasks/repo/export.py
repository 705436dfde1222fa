"""A repository task as a SWE-bench-style instance that a harness outside meshrl can rebuild.

The record names its source as SWE-bench does a repository (`repo`, `base_commit`, `version`,
`environment_setup_commit`) and, in `source`, everything that rebuilding the base tree takes:
an sdist's name and version, a git checkout's remote and commit, the standard library's version
and layout; `tree_digest` tells a rebuilt tree from another (`sources.tree_digest`).
`benchmarks/swe_check.py` rebuilds the tree from a record alone and checks its test lists.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
from typing import Any

from meshrl.tasks.repo.build import RepoTask, buggy_code
from meshrl.tasks.repo.sources import Source

GITHUB = re.compile(r"github\.com[:/]([\w.-]+/[\w.-]+?)(?:\.git)?/?$")


def swe_instance(source: Source, task: RepoTask, problem_statement: str) -> dict[str, Any]:
    """One task: `patch` fixes the bug (the gold patch), `bug_patch` injects it into the base tree,
    `test_patch` adds what meshrl adds to the tree (the tests' `__init__.py`), FAIL_TO_PASS and
    PASS_TO_PASS as JSON lists of unittest ids."""
    origin = source.provenance
    assert origin is not None, "every source is read with its provenance"
    found = GITHUB.search(origin.location) if origin.kind == "git" else None
    repo = {"stdlib": "python/cpython", "git": found.group(1) if found else origin.location}.get(
        origin.kind, origin.name
    )
    base = origin.commit or origin.tree_digest
    buggy = buggy_code(source, task)
    return {
        "instance_id": task.task_id,
        "repo": repo,
        "base_commit": base,
        "environment_setup_commit": base,
        "version": origin.version,
        "source": {**dataclasses.asdict(origin), "module": source.path, "tests": source.test_path},
        "tree_digest": origin.tree_digest,
        "problem_statement": problem_statement,
        "patch": unified_diff(source.path, buggy, source.code),
        "bug_patch": unified_diff(source.path, source.code, buggy),
        "test_patch": "".join(new_file_diff(path, text) for path, text in sorted(source.added.items())),
        "FAIL_TO_PASS": json.dumps(list(task.fail_to_pass)),
        "PASS_TO_PASS": json.dumps(list(task.pass_to_pass)),
        "test_command": f"python3 -m unittest {source.test_module}",
    }


def unified_diff(path: str, before: str, after: str) -> str:
    """`before` -> `after` of the file `path`, as `git diff` writes a patch."""
    lines = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                 f"a/{path}", f"b/{path}")  # fmt: skip
    ended = (line if line.endswith("\n") else f"{line}\n\\ No newline at end of file\n" for line in lines)
    return f"diff --git a/{path} b/{path}\n" + "".join(ended)


def new_file_diff(path: str, text: str) -> str:
    """A patch creating `path` with `text`, as `git diff` writes one (an empty file has no hunk)."""
    header = f"diff --git a/{path} b/{path}\nnew file mode 100644\n"
    if not text:
        return header
    lines = text.splitlines(keepends=True)
    body = "".join(f"+{line}" if line.endswith("\n") else f"+{line}\n\\ No newline at end of file\n" for line in lines)
    return f"{header}--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n{body}"
