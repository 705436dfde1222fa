"""Checkpoints: the trainers write theirs in the background while training goes on; the
controller's state of that moment is published beside it once every rank's write is done
(`controller.json`, `COMPLETE`, one rename: a crash leaves the previous checkpoint whole), and a
resumed run starts from the newest complete one."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshrl.configs.schema import RunConfig
from meshrl.run.record import Timeline
from meshrl.run.run_dir import RL, RunDir


@dataclass
class PendingCheckpoint:
    """A checkpoint the trainer is still writing in the background, with the controller state
    of the moment it was snapshotted; committed once the trainer reports the write done."""

    staging: Path
    step: int
    state: dict[str, Any]
    started: float
    phase: str


class Checkpointer:
    """One checkpoint write in flight at a time; `trainers` is the trainer mesh."""

    def __init__(self, config: RunConfig, run: RunDir, trainers: Any, timeline: Timeline) -> None:
        self.config, self.run, self.trainers, self.timeline = config, run, trainers, timeline
        self.pending: PendingCheckpoint | None = None

    def save(self, step: int, state: dict[str, Any], phase: str = RL) -> None:
        """Snapshot a checkpoint after `step` steps of `phase` with the controller's `state`: the
        trainers write it in the background, and `commit` publishes it once written."""
        self.commit(wait=True)
        start = time.time()
        staging = self.run.staging(step, phase)
        self.trainers.save_checkpoint.call(str(staging)).get()
        self.pending = PendingCheckpoint(staging, step, {"step": step, "phase": phase, **state}, start, phase)
        if phase == RL:
            self.timeline.add("checkpoint", start, time.time(), step - 1)

    def commit(self, wait: bool) -> None:
        """Publish the pending checkpoint once every trainer rank reports its write done; `wait`:
        block until then."""
        pending = self.pending
        if pending is None or not all(self.trainers.checkpoint_written.call(wait).get().values()):
            return
        self.pending = None
        keep = self.config.ckpt.keep_last
        self.run.commit_checkpoint(pending.staging, pending.step, pending.state, keep, pending.phase)
        if pending.phase == RL:
            self.timeline.add("checkpoint write", pending.started, time.time(), pending.step - 1)

    def resume(self, phase: str = RL) -> dict[str, Any] | None:
        """Load the newest complete checkpoint of `phase` into the trainers and return the
        controller state saved with it (None: there is none)."""
        latest = self.run.latest_checkpoint(phase)
        if latest is None:
            return None
        state = json.loads((latest / "controller.json").read_text())
        self.trainers.load_checkpoint.call(str(latest)).get()
        return state
