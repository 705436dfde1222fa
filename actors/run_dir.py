"""What a run leaves in its output directory, written so that a kill never corrupts it.

    DIR/config.toml        resolved config
    DIR/metrics.jsonl      one JSON object per step (a resumed run rewrites it up to its step)
    DIR/checkpoints/step_N/  complete when it holds COMPLETE (written last, then the folder is renamed in)
    DIR/topology.json      every actor's role, rank, host, pid
    DIR/plots/*.png        reward, losses, throughput
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

from meshrl.topology.worker import WORKER_ENV

COMPLETE = "COMPLETE"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def process_info() -> dict[str, Any]:
    """Where the calling actor runs, for topology.json: host name, pid, and the address of
    the `meshrl worker` that spawned its process ('local' on the controller's host)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "worker": os.environ.get(WORKER_ENV, "local")}


class RunDir:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.checkpoints = self.root / "checkpoints"
        self.metrics_path = self.root / "metrics.jsonl"
        self.root.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ metrics

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        records = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut by a kill: everything after it is unsaved
        return records

    def keep_metrics_before(self, step: int) -> None:
        """On resume: exactly the records of the steps the checkpoint covers survive."""
        kept = [r for r in self.read_metrics() if r["step"] < step]
        write_atomic(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))

    def append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    # ------------------------------------------------------------------ checkpoints

    def staging(self, step: int) -> Path:
        path = self.checkpoints / f".step_{step}.partial"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def commit_checkpoint(self, staging: Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
        """Controller state and the COMPLETE marker go in last; then one rename publishes the step."""
        write_atomic(staging / "controller.json", json.dumps(state))
        write_atomic(staging / COMPLETE, str(step))
        final = self.checkpoints / f"step_{step}"
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        for old in self.complete_checkpoints()[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def complete_checkpoints(self) -> list[Path]:
        if not self.checkpoints.exists():
            return []
        done = [p for p in self.checkpoints.glob("step_*") if (p / COMPLETE).exists()]
        return sorted(done, key=lambda p: int(p.name.split("_")[1]))

    def latest_checkpoint(self) -> Path | None:
        done = self.complete_checkpoints()
        return done[-1] if done else None

    # ------------------------------------------------------------------ topology and plots

    def write_topology(self, actors: list[dict[str, Any]]) -> None:
        write_atomic(self.root / "topology.json", json.dumps({"actors": actors}, indent=2))


def plot(run: str | Path) -> list[Path]:
    """Reward, per-channel losses and throughput curves from metrics.jsonl into DIR/plots/."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = RunDir(run)
    records = run_dir.read_metrics()
    if not records:
        raise ValueError(f"{run_dir.metrics_path}: no metrics to plot")
    out = run_dir.root / "plots"
    out.mkdir(exist_ok=True)
    steps = [r["step"] for r in records]
    figures = {
        "reward": ["reward/mean"],
        "losses": ["loss/total", "loss/rl", "loss/replay", "loss/sdpo"],
        "throughput": ["rollout_tokens_per_s", "train_tokens_per_s"],
    }
    written = []
    for name, keys in figures.items():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in keys:
            if any(key in r for r in records):
                ax.plot(steps, [r.get(key, float("nan")) for r in records], label=key)
        ax.set_xlabel("step")
        ax.set_title(name)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
