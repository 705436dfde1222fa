"""What a run leaves in its output directory, written so that a kill never corrupts it.

DIR/config.toml        the resolved config the run started with (a resume never rewrites it)
DIR/config_changes.jsonl  one dated line per resume that changed a setting (configs/run_record.py)
DIR/.lock              held by the run using DIR: a second run there is refused
DIR/metrics.jsonl      one strict JSON object per step, null where a value is NaN or infinite
                       (a resumed run rewrites it up to its step)
DIR/checkpoints/step_N/  complete when it holds COMPLETE (every file and folder fsynced first,
                       the marker last, then the folder renamed in); model/ is an HF model
                       directory (float32 master weights, tokenizer, chat template, generation config)
DIR/final/             the finished run's model, exported in model.dtype (`meshrl export`)
DIR/topology.json      every actor's role, rank, host, pid
DIR/weights/step_V.safetensors  the policy generators read (`generator.weight_sync = filesystem`;
                       only the newest version is kept, removed when the run ends)
DIR/plots/*.png        reward, losses, throughput

The trainer's rank 0 writes the checkpoint's files and the controller its marker, so on several
hosts DIR must be one shared filesystem; `check_shared` refuses a DIR the trainer cannot see.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshrl.configs.loader import ConfigError

COMPLETE = "COMPLETE"
RL, WARM_START = "rl", "warm_start"  # the run's phases; a warm-start record says `"phase": "warm_start"`
CHECKPOINT_NAMES = {RL: "step_", WARM_START: "warm_start_"}
RUN_OUTPUTS = (
    "checkpoints",
    "weights",
    "metrics.jsonl",
    "timeline.jsonl",
    "plots",
    "final",
    "tiny_model",
    "gguf_model",
    "topology.json",
    "ingress",
    "tensorboard",
    "wandb",
    "wandb_id",
    "config_changes.jsonl",
)  # `overwrite` clears


class RunDirBusy(ConfigError):
    """Another run holds the directory's lock."""


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_tree(root: Path) -> None:
    """Flush every file under `root`, then every folder (its entries), deepest first."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(folder))


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RunDir:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.checkpoints = self.root / "checkpoints"
        self.metrics_path = self.root / "metrics.jsonl"
        self.timeline_path = self.root / "timeline.jsonl"
        self.record = self.root / "config.toml"
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock: int | None = None

    def lock(self) -> None:
        """Hold DIR/.lock while this process lives (released when it exits, however it exits): a
        second run in DIR is refused, naming the process that holds it."""
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirBusy(
                f"output_dir {self.root} is in use by another meshrl run (pid {holder}): wait for it to end, "
                "or choose another --output-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock = fd

    def unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # closing the descriptor releases the lock
            self._lock = None

    def remove(self) -> None:
        """Remove DIR altogether (a start refused before anything ran in a directory it made)."""
        shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------------ a run already here

    def earlier_run(self) -> list[str]:
        """What a previous run left here that a fresh run would mix with: checkpoints a later
        --resume would pick up, metrics the new ones would follow."""
        found = []
        if self.checkpoints.exists():
            found.append(f"checkpoints: {', '.join(sorted(p.name for p in self.checkpoints.iterdir())) or 'none'}")
        if self.metrics_path.exists():
            found.append(f"metrics.jsonl: {len(self.read_metrics())} steps")
        return found

    def clear(self) -> None:
        """Remove an earlier run's outputs (`overwrite`); the teacher answer cache stays valid and is kept."""
        for name in RUN_OUTPUTS:
            path = self.root / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ metrics

    def read_metrics(self, phase: str = RL) -> list[dict[str, Any]]:
        """The records of one phase: RL steps (the default), or the warm start's SFT steps."""
        return [r for r in _read_jsonl(self.metrics_path) if r.get("phase", RL) == phase]

    def read_timeline(self) -> list[dict[str, Any]]:
        """Per step: when each part of it ran, on which lane (`Controller.train` writes it)."""
        return _read_jsonl(self.timeline_path)

    def keep_records(self, warm_start_steps: int | float, steps: int) -> None:
        """On (re)start: exactly the records of the steps the checkpoint covers survive, the warm
        start's SFT steps below `warm_start_steps` and RL steps below `steps`."""
        below = {WARM_START: warm_start_steps, RL: steps}
        kept = [r for r in _read_jsonl(self.metrics_path) if r["step"] < below[r.get("phase", RL)]]
        write_atomic(self.metrics_path, "".join(map(_json_line, kept)))
        kept = [r for r in _read_jsonl(self.timeline_path) if r["step"] < steps]
        write_atomic(self.timeline_path, "".join(map(_json_line, kept)))

    def append_metrics(self, record: dict[str, Any]) -> None:
        _append_jsonl(self.metrics_path, record)

    def append_timeline(self, record: dict[str, Any]) -> None:
        _append_jsonl(self.timeline_path, record)

    # ------------------------------------------------------------------ published weights

    def weights_file(self, version: int) -> Path:
        """Where policy `version` is published for generators to read (filesystem weight sync)."""
        return self.root / "weights" / f"step_{version}.safetensors"

    def prune_weights(self, keep: Path | None = None) -> None:
        """Remove published weights no generator reads any more (all but `keep`)."""
        for path in (self.root / "weights").glob("step_*.safetensors"):
            if path != keep:
                path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ checkpoints

    def staging(self, step: int, phase: str = RL) -> Path:
        path = self.checkpoints / f".{CHECKPOINT_NAMES[phase]}{step}.partial"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def commit_checkpoint(
        self, staging: Path, step: int, state: dict[str, Any], keep_last: int, phase: str = RL
    ) -> Path:
        """Controller state, an fsync of everything the trainer wrote, and the COMPLETE marker last;
        then one rename publishes the step (and an fsync of the parent makes the rename durable).
        The first RL checkpoint retires the warm start's: a resume never goes back to them."""
        write_atomic(staging / "controller.json", json.dumps(state))
        fsync_tree(staging)
        write_atomic(staging / COMPLETE, str(step))
        fsync_dir(staging)
        final = self.checkpoints / f"{CHECKPOINT_NAMES[phase]}{step}"
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        fsync_dir(self.checkpoints)
        old = self.complete_checkpoints(phase)[:-keep_last] + (
            self.complete_checkpoints(WARM_START) if phase == RL else []
        )
        for path in old:
            shutil.rmtree(path, ignore_errors=True)
        return final

    def complete_checkpoints(self, phase: str = RL) -> list[Path]:
        """The phase's complete checkpoints, oldest first: `step_N` after RL step N, `warm_start_N`
        after the warm start's N-th SFT step."""
        if not self.checkpoints.exists():
            return []
        name = CHECKPOINT_NAMES[phase]
        done = [p for p in self.checkpoints.glob(f"{name}*") if (p / COMPLETE).exists()]
        return sorted(done, key=lambda p: int(p.name.removeprefix(name)))

    def latest_checkpoint(self, phase: str = RL) -> Path | None:
        done = self.complete_checkpoints(phase)
        return done[-1] if done else None

    def check_shared(self, read_on_trainer: Callable[[str], str | None]) -> None:
        """Refuse a run directory the trainer's rank 0 cannot see: it writes checkpoints there, the
        controller commits them. `read_on_trainer(path)` is the file's text as that process reads it."""
        probe = self.root / f".shared-probe-{secrets.token_hex(4)}"
        token = secrets.token_hex(16)
        write_atomic(probe, token)
        try:
            seen = read_on_trainer(str(probe))
        finally:
            probe.unlink(missing_ok=True)
        if seen != token:
            raise RuntimeError(
                f"output_dir {self.root.resolve()} is not the same directory on the trainer's rank-0 host: "
                "checkpoints need a filesystem shared by the controller and the trainer hosts (see "
                "docs/guides/real-model.md, 'Durable checkpoints and the shared filesystem')"
            )

    # ------------------------------------------------------------------ topology

    def write_topology(self, actors: list[dict[str, Any]]) -> None:
        write_atomic(self.root / "topology.json", json.dumps({"actors": actors}, indent=2))


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by a kill: everything after it is unsaved
    return records


def _json_line(record: dict[str, Any]) -> str:
    """One record as a strict JSON line: a NaN or infinite value (a skipped step's grad norm, a mean
    over nothing) becomes null, which jq, pandas and JavaScript read; Python's NaN token they refuse."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


def _append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(_json_line(record))
        f.flush()
        os.fsync(f.fileno())
