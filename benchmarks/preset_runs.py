"""`meshrl train` runs of a preset for the benchmarks that compare arms over seeds (horizon.py,
code_tools.py): one run in a process of its own, its log beside its directory, and the warm start
a seed's arms share."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def start(presets: Sequence[Path], out: Path, seed: int, extra: list[str]) -> subprocess.Popen:
    """One `meshrl train` of the presets (layered left to right), its log beside `out`."""
    log = (out.parent / f"{out.name}.log").open("w")
    layers = [arg for preset in presets for arg in ("@", str(preset))]
    args = [sys.executable, "-m", "meshrl.cli.main", "train", *layers, "--output-dir", str(out),
            "--overwrite", "--seed", str(seed), "--metrics.progress", "plain", *extra]  # fmt: skip
    return subprocess.Popen(args, cwd=REPO, stdout=log, stderr=log, env={**os.environ, "RUST_LOG": "warn"})


def finish(out: Path, proc: subprocess.Popen) -> None:
    if proc.wait() != 0:
        raise SystemExit(f"{out}: meshrl train exited {proc.returncode}; see {out.parent / f'{out.name}.log'}")


def train(presets: Sequence[Path], out: Path, seed: int, extra: list[str]) -> float:
    """One `meshrl train` of the presets, waited for; its wall seconds."""
    began = time.time()
    finish(out, start(presets, out, seed, extra))
    return time.time() - began


def warm(presets: Sequence[Path], root: Path, seed: int, common: list[str]) -> Path:
    """The seed's warm start, shared by its runs: the presets' demonstrations, then one RL step at a
    learning rate of 1e-30 (no weight moves) so the run exports `final/`. Its runs start from that
    export with fresh AdamW moments, as a preset's own RL does (`warm_start_keep_optimizer = false`)."""
    out = root / f"warm_seed{seed}"
    if not (out / "final" / "config.json").exists():
        train(presets, out, seed, [*common, "--max-steps", "1", "--trainer.lr", "1e-30", "--eval.interval", "0"])
    return out / "final"
