"""The repository preset end to end: `meshrl train @ configs/local.toml @ configs/repo_fix.toml`, its
warm start on the Claude Code demonstrations, RL episodes in sandbox workspaces, then `meshrl eval`
on held-out modules of both sources, the standard library's and more-itertools' (a small build, so
the run takes seconds, not the preset's minute); `meshrl tasks build --export` writes the tasks as
SWE-bench-style instances."""

from __future__ import annotations

import json
import subprocess

import pytest
from e2e import MESHRL, REPO, records

pytestmark = pytest.mark.mesh  # whole `meshrl` runs

PYPI = {"repo": str(REPO / ".venv" / "share" / "meshrl-sources" / "more-itertools-10.5.0.tar.gz"),
        "module": "more_itertools/recipes.py", "tests": "tests/test_recipes.py"}  # fmt: skip
KWARGS = {"modules": ["colorsys"], "eval_modules": ["getopt"], "repos": [PYPI], "tries": 24, "per_module": 6,
          "max_turns": 50, "sandbox": {"backend": "bwrap", "pool_size": 2, "wall_time_s": 20.0, "cpu_time_s": 10}}  # fmt: skip
PRESET = ["@", str(REPO / "configs" / "local.toml"), "@", str(REPO / "configs" / "repo_fix.toml")]


def test_the_repository_preset_trains_and_its_held_out_split_evaluates(tmp_path):
    kwargs = json.dumps({**KWARGS, "cache_dir": str(tmp_path / "cache")})
    out = tmp_path / "run"
    small = ["--task.kwargs", kwargs, "--max-steps", "2", "--trainer.warm-start-steps", "3",
             "--trainer.warm-start-batch-size", "4", "--task.prompts-per-step", "2", "--generator.samples-per-prompt",
             "2", "--metrics.progress", "plain"]  # fmt: skip
    run = subprocess.run([*MESHRL, "train", *PRESET, *small, "--output-dir", str(out)], capture_output=True,
                         text=True, timeout=600, cwd=REPO)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "repository tasks: colorsys:" in run.stdout  # built once, into the cache
    assert "repository tasks: more_itertools.recipes:" in run.stdout  # the PyPI package's module trains too
    rows = records(out)
    assert len(rows) == 2
    for row in rows:
        assert "rubric/solved" in row and row["task_metric/turns"] >= 1 and "task_metric/tests_fixed" in row
        assert row["rollouts/elided"] >= 0  # the preset's episodes elide old tool results past their budget
    result = tmp_path / "eval.json"
    # the held-out split over both sources (one build: the split is not part of the cache's key)
    both = json.dumps(
        {**KWARGS, "eval_modules": ["getopt", "more_itertools.recipes"], "cache_dir": str(tmp_path / "cache")}
    )
    evaluation = subprocess.run([*MESHRL, "eval", *PRESET, "--task.kwargs", both, "--checkpoint", str(out),
                                 "--n", "4", "--k", "2", "--out", str(result)], capture_output=True, text=True,
                                timeout=600, cwd=REPO)  # fmt: skip
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
    assert "repository tasks" not in evaluation.stdout  # read from the cache
    scores = json.loads(result.read_text())  # 4 held-out tasks, the two sources taking turns (task.eval_prompts)
    assert scores["prompts"] == 4 and scores["k"] == 2
    assert {"eval/pass@1", "eval/pass@2", "eval/rubric/solved", "eval/task_metric/tests_fixed"} <= set(scores)
    swe = tmp_path / "swe.jsonl"
    build = subprocess.run([*MESHRL, "tasks", "build", *PRESET, "--task.kwargs", kwargs, "--export", str(swe)],
                           capture_output=True, text=True, timeout=600, cwd=REPO)  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    instances = [json.loads(line) for line in swe.read_text().splitlines()]
    assert {i["repo"] for i in instances} == {"python/cpython", "more-itertools"}  # sources, not modules
    assert {i["source"]["module"] for i in instances} == {"colorsys.py", "getopt.py", "more_itertools/recipes.py"}
    for instance in instances:
        assert instance["patch"].startswith("diff --git a/") and json.loads(instance["FAIL_TO_PASS"])
