"""Curves of a run's metrics.jsonl (reward, per-channel losses, throughput, the warm start's SFT
loss) and its step timeline as PNGs in DIR/plots/."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from meshrl.run.run_dir import RL, WARM_START, RunDir


def plot(run: str | Path) -> list[Path]:
    """Reward, per-channel losses and throughput curves from metrics.jsonl into DIR/plots/."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = RunDir(run)
    phases = {RL: run_dir.read_metrics(), WARM_START: run_dir.read_metrics(WARM_START)}
    if not any(phases.values()):
        raise ValueError(f"{run_dir.metrics_path}: no metrics to plot")
    out = run_dir.root / "plots"
    out.mkdir(exist_ok=True)
    figures = {
        "reward": (RL, ["reward/mean"]),
        "losses": (RL, ["loss/total", "loss/rl", "loss/replay", "loss/sdpo"]),
        "throughput": (RL, ["rollout_tokens_per_s", "train_tokens_per_s"]),
        "warm_start": (WARM_START, ["warm_start/loss"]),
    }
    written = []
    for name, (phase, keys) in figures.items():
        records = phases[phase]
        if not records:
            continue
        steps = [r["step"] for r in records]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in keys:
            values = series(records, key)
            if not all(math.isnan(v) for v in values):  # markers: a value between two gaps still shows
                ax.plot(steps, values, label=key, marker=".", markersize=3)
        ax.set_xlabel("SFT step" if phase == WARM_START else "step")
        ax.set_title(name)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    if run_dir.read_timeline():
        written.append(plot_timeline(run_dir, out / "timeline.png", plt))
    return written


def series(records: list[dict[str, Any]], key: str) -> list[float]:
    """A key's value at each record, NaN (a gap in the curve, not a 0) where the step had none:
    the key absent, or null in metrics.jsonl (NaN when written: a loss channel without rows)."""
    return [math.nan if r.get(key) is None else float(r[key]) for r in records]


def plot_timeline(run_dir: RunDir, path: Path, plt: Any, last_steps: int = 6) -> Path:
    """The last steps' spans as bars per lane (generators, trainer, weights, teachers,
    checkpoint), coloured by the step they served: overlapping colours are generation running
    ahead of training. Seconds from the first span shown."""
    records = run_dir.read_timeline()[-last_steps:]
    spans = [span for record in records for span in record["spans"]]
    t0 = min(span["start"] for span in spans)
    order = ["checkpoint write", "checkpoint", "weights", "trainer"]
    lanes = sorted(
        {span["lane"] for span in spans}, key=lambda lane: (lane in order, order.index(lane) if lane in order else lane)
    )
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * len(lanes)))
    for span in spans:
        y = lanes.index(span["lane"])
        ax.broken_barh([(span["start"] - t0, max(span["end"] - span["start"], 1e-3))], (y - 0.35, 0.7),
                       facecolors=colours(span["step"] % 10), alpha=0.45, edgecolor="black", linewidth=0.3)  # fmt: skip
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("seconds")
    steps = sorted({span["step"] for span in spans})
    ax.set_title(f"steps {steps[0]}-{steps[-1]} (colour = the step a span served)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
