"""The run directory: checkpoints durable before they count as complete, and a run directory
the trainer cannot see refused, metrics as strict JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from meshrl.run.run_dir import COMPLETE, RunDir


def test_everything_is_fsynced_before_the_complete_marker(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run")
    staging = run.staging(4)
    (staging / "model").mkdir()
    for name in ("model/model.safetensors", "model/tokenizer.json", "trainer.pt"):
        (staging / name).write_bytes(b"x")
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    final = run.commit_checkpoint(staging, 4, {"step": 4}, keep_last=2)
    marker = next(i for i, path in enumerate(synced) if Path(path).name.startswith(f".{COMPLETE}"))
    before = set(synced[:marker])
    for path in [staging / "model" / "model.safetensors", staging / "model" / "tokenizer.json",
                 staging / "trainer.pt", staging / "controller.json", staging / "model", staging]:  # fmt: skip
        assert str(path) in before, path
    assert synced[-1] == str(run.checkpoints)  # the rename that publishes the step, made durable
    assert run.latest_checkpoint() == final


def test_a_run_directory_the_trainer_cannot_see_is_refused(tmp_path):
    run = RunDir(tmp_path / "run")
    run.check_shared(lambda path: Path(path).read_text())  # the same filesystem
    with pytest.raises(RuntimeError, match=f"output_dir {run.root} is not the same directory"):
        run.check_shared(lambda path: None)  # another host's disk: the probe is not there
    assert not list(run.root.glob(".shared-probe-*"))


def test_overwrite_clears_an_earlier_run_but_keeps_the_teacher_cache(tmp_path):
    run = RunDir(tmp_path / "run")
    assert run.earlier_run() == []
    run.commit_checkpoint(run.staging(2), 2, {"step": 2}, keep_last=2)
    run.append_metrics({"step": 0})
    (run.root / "teacher_cache.jsonl").write_text("{}\n")
    assert run.earlier_run() == ["checkpoints: step_2", "metrics.jsonl: 1 steps"]
    run.clear()
    assert run.earlier_run() == [] and (run.root / "teacher_cache.jsonl").exists()


def test_metrics_lines_are_strict_json(tmp_path):
    """A NaN or infinite value is written as null (Python's NaN token is not JSON), and a resume's
    rewrite keeps it so."""
    run = RunDir(tmp_path / "run")
    for step, value in enumerate([float("nan"), float("inf"), 0.5]):
        run.append_metrics({"step": step, "grad_norm": value, "skipped_steps": 1})
    run.keep_metrics_before(2)
    refuse = {"parse_constant": lambda token: pytest.fail(f"{token} in metrics.jsonl")}
    lines = [json.loads(line, **refuse) for line in run.metrics_path.read_text().splitlines()]
    assert lines == run.read_metrics() == [{"step": s, "grad_norm": None, "skipped_steps": 1} for s in (0, 1)]
