"""A user's own repository as repository tasks, the way a user writes it: "my repository only" over
the preset, a test that reads a data file, the mistakes a user makes named by the key they wrote,
and an export whose base tree a script outside meshrl rebuilds from the record alone."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w

from meshrl.configs import load_config
from meshrl.tasks.base import task_kwargs
from meshrl.tasks.repo.sources import repository_source, sources_of
from meshrl.tasks.repo.task import RepoFixTask

REPO = Path(__file__).resolve().parent.parent
PRESET = ["@", str(REPO / "configs" / "local.toml"), "@", str(REPO / "configs" / "repo_fix.toml")]
SDIST = REPO / ".venv" / "share" / "meshrl-sources" / "more-itertools-10.5.0.tar.gz"
CORE = '''"""A small library of the user's own."""


def clamp(x, low, high):
    if x < low:
        return low
    if x > high:
        return high
    return x


def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def words(text):
    return [word.lower() for word in text.split() if word.isalpha()]
'''
TESTS = """import os
import unittest

from mylib.core import clamp, mean, words

DATA = os.path.join(os.path.dirname(__file__), "data")


class CoreTests(unittest.TestCase):
    def test_clamp(self):
        self.assertEqual(clamp(5, 0, 3), 3)
        self.assertEqual(clamp(-1, 0, 3), 0)
        self.assertEqual(clamp(2, 0, 3), 2)

    def test_mean(self):
        self.assertEqual(mean([1, 2, 3, 4]), 2.5)

    def test_words_from_a_data_file(self):
        with open(os.path.join(DATA, "words.txt")) as f:
            text, expected = f.read().split("---")
        self.assertEqual(words(text), expected.split())

    def test_a_binary_fixture(self):
        with open(os.path.join(DATA, "blob.bin"), "rb") as f:
            self.assertEqual(len(f.read()), 4)
"""


@pytest.fixture(scope="module")
def mylib(tmp_path_factory) -> Path:
    """The user's repository: a git checkout with a text and a binary data file."""
    root = tmp_path_factory.mktemp("mylib")
    (root / "mylib").mkdir()
    (root / "mylib" / "__init__.py").write_text("")
    (root / "mylib" / "core.py").write_text(CORE)
    (root / "tests" / "data").mkdir(parents=True)
    (root / "tests" / "test_core.py").write_text(TESTS)
    (root / "tests" / "test_more.py").write_text(TESTS.replace("CoreTests", "MoreTests"))  # a second suite of core
    (root / "tests" / "data" / "words.txt").write_text("The cat sat on 2 mats ---the cat sat on mats")
    (root / "tests" / "data" / "blob.bin").write_bytes(b"\xff\xfe\x00\x01")
    git = ["git", "-C", str(root), "-c", "user.name=u", "-c", "user.email=u@x"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "mylib"], check=True)
    return root


@pytest.fixture(scope="module")
def mine(mylib, tmp_path_factory) -> tuple[RepoFixTask, dict]:
    """The guide's "my repository only" file layered over the preset, and the task it builds."""
    toml = tmp_path_factory.mktemp("config") / "mine.toml"
    sdist = {"repo": str(SDIST), "module": "more_itertools/recipes.py", "tests": "tests/test_recipes.py"}
    repos = [{"repo": str(mylib), "module": "mylib/core.py", "tests": "tests/test_core.py"}, sdist]
    toml.write_text(
        tomli_w.dumps({"task": {"kwargs": {"modules": [], "repos": repos, "eval_modules": ["mylib.core"]}}})
    )
    cache = tmp_path_factory.mktemp("cache")
    small = ["--task.kwargs.tries", "8", "--task.kwargs.per_module", "2", "--task.kwargs.cache_dir", str(cache),
             "--task.kwargs.sandbox.pool_size", "2"]  # fmt: skip
    kwargs = task_kwargs(load_config([*PRESET, "@", str(toml), *small]).task)
    return RepoFixTask(**kwargs), kwargs


def test_my_repository_only_builds_exactly_my_sources_with_the_presets_limits(mine):
    task, kwargs = mine
    preset = load_config(PRESET).task.kwargs
    assert kwargs["max_turns"] == preset["max_turns"] == 50
    limits = task.sandbox.config  # the preset's limits, one of them overridden on the command line
    assert (limits.wall_time_s, limits.cpu_time_s, limits.pool_size) == (preset["sandbox"]["wall_time_s"], 10, 2)
    assert list(task.sources) == ["mylib.core", "more_itertools.recipes"]  # no standard-library module
    assert {t.module for t in task.tasks.values()} == {"mylib.core", "more_itertools.recipes"}
    assert {task.tasks[i].module for i in task.eval_ids} == {"mylib.core"}


def test_a_test_reading_a_data_file_runs_in_the_workspace_and_a_binary_one_is_named(mine):
    task, _ = mine
    source = task.sources["mylib.core"]
    assert source.extra["tests/data/words.txt"].startswith("The cat")
    assert source.left_out == ("tests/data/blob.bin",)
    stats = next(s for s in task.build_stats if s.module == "mylib.core")
    data_test = "tests.test_core.CoreTests.test_words_from_a_data_file"
    assert data_test in task.expected["mylib.core"]  # it passed on the original, in the sandbox
    assert stats.left_out == {"tests.test_core.CoreTests.test_a_binary_fixture": "fails on the original here"}
    assert "1 left out: CoreTests.test_a_binary_fixture (fails on the original here)" in stats.said()


def test_the_export_names_its_sources_and_a_script_rebuilds_and_checks_them_outside_meshrl(mine, tmp_path):
    task, _ = mine
    instances = task.swe_instances()
    by_repo = {i["repo"]: i for i in instances}
    pypi = by_repo["more-itertools"]
    assert pypi["version"] == "10.5.0" and pypi["source"]["kind"] == "sdist"
    assert pypi["base_commit"] == pypi["tree_digest"] and pypi["test_patch"] == ""
    ours = next(i for i in instances if i["source"]["kind"] == "git")
    head = subprocess.run(["git", "-C", ours["source"]["location"], "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    assert ours["base_commit"] == head and ours["environment_setup_commit"] == head
    records = tmp_path / "tasks.jsonl"
    records.write_text("".join(json.dumps(i) + "\n" for i in instances))
    script = [sys.executable, str(REPO / "benchmarks" / "swe_check.py")]
    done = subprocess.run([*script, str(records)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(instances)} of {len(instances)} instances rebuilt and checked" in done.stdout
    # the check can fail: a passing test listed as failing, and a tree that is not the record's
    forged = {**pypi, "FAIL_TO_PASS": json.dumps([*json.loads(pypi["FAIL_TO_PASS"]), json.loads(pypi["PASS_TO_PASS"])[0]]),
              "tree_digest": "0" * 64}  # fmt: skip
    records.write_text(json.dumps(forged) + "\n")
    done = subprocess.run([*script, str(records)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 1 and "with the bug (expected fail)" in done.stdout and "digest differs" in done.stdout


def test_a_checkout_gives_its_tracked_files_and_a_dirty_one_no_commit(mylib, tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(mylib), str(clone)], check=True)
    (clone / "notes.txt").write_text("untracked")
    source = repository_source(str(clone), "mylib/core.py", "tests/test_core.py")
    assert source.provenance.kind == "git" and source.provenance.commit and "notes.txt" not in source.extra
    (clone / "mylib" / "core.py").write_text(CORE.replace("return x", "return x  # edited"))
    dirty = repository_source(str(clone), "mylib/core.py", "tests/test_core.py").provenance
    assert dirty.kind == "directory" and dirty.commit == "" and dirty.version.endswith("-dirty")


def test_a_module_named_twice_is_refused_naming_both_entries(mylib):
    spec = {"repo": str(mylib), "module": "mylib/core.py", "tests": "tests/test_core.py"}
    with pytest.raises(
        ValueError, match=r"task\.kwargs\.repos\[1\]\.module: 'mylib\.core' is already task\.kwargs\.repos\[0\]"
    ):
        sources_of([], [], [spec, {**spec, "tests": "tests/test_more.py"}])
    with pytest.raises(
        ValueError, match=r"task\.kwargs\.modules\[1\]: 'colorsys' is already task\.kwargs\.modules\[0\]"
    ):
        sources_of(["colorsys", "colorsys"], [], [])


def test_each_misleading_error_names_the_key_written_what_was_looked_for_and_a_fix(mylib, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"task\.kwargs\.repos\.module: .* relative to its top folder "
                       r"'more-itertools-10\.5\.0': write 'more_itertools/recipes\.py'"):  # fmt: skip
        repository_source(str(SDIST), "more-itertools-10.5.0/more_itertools/recipes.py", "tests/test_recipes.py")
    with pytest.raises(
        ValueError,
        match=r"has no 'mylib/cor\.py' \(paths are relative to the repository's folder; did you mean 'mylib/core\.py'",
    ):
        repository_source(str(mylib), "mylib/cor.py", "tests/test_core.py")
    backup = tmp_path / "with_a_copy"  # a folder, not a checkout: every file is read but built ones
    shutil.copytree(mylib, backup, ignore=shutil.ignore_patterns(".git"))
    (backup / "build" / "lib" / "mylib").mkdir(parents=True)
    shutil.copyfile(mylib / "mylib" / "core.py", backup / "build" / "lib" / "mylib" / "core.py")  # not read
    assert "build/lib/mylib/core.py" not in repository_source(str(backup), "mylib/core.py", "tests/test_core.py").extra
    shutil.copyfile(mylib / "mylib" / "core.py", backup / "mylib" / "core_old.py")
    with pytest.raises(ValueError, match=r"'mylib/core_old\.py' holds 100% of the lines of 'mylib/core\.py'"):
        repository_source(str(backup), "mylib/core.py", "tests/test_core.py")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="resolved against the current directory") as refused:
        repository_source("src/mylib", "mylib/core.py", "tests/test_core.py", key="task.kwargs.repos[0]")
    assert "task.kwargs.repos[0].repo: 'src/mylib'" in str(refused.value) and "make setup" not in str(refused.value)
    spec = {"repo": str(mylib), "module": "mylib/core.py", "tests": "tests/test_core.py"}
    with pytest.raises(ValueError, match=r"task\.kwargs\.eval_modules\[0\]: 'mylib\.cor' is none of the sources "
                       r"\(mylib\.core\) .* did you mean 'mylib\.core'\?"):  # fmt: skip
        sources_of([], ["mylib.cor"], [spec])
