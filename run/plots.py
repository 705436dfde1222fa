"""Curves of a run's metrics.jsonl (reward, per-channel losses, throughput, the warm start's SFT
loss, what multi-turn episodes did) and its step timeline as PNGs in DIR/plots/."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from meshrl.run.run_dir import RL, WARM_START, RunDir


def plot(run: str | Path) -> list[Path]:
    """Reward, per-channel losses, throughput and episode curves from metrics.jsonl into DIR/plots/."""
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
        fig, ax = plt.subplots(figsize=(6, 3.5))
        curves(ax, records, {key: key for key in keys})
        ax.set_xlabel("SFT step" if phase == WARM_START else "step")
        ax.set_title(name)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    if phases[RL] and (path := plot_episodes(phases[RL], out / "episodes.png", plt)) is not None:
        written.append(path)
    if run_dir.read_timeline():
        written.append(plot_timeline(run_dir, out / "timeline.png", plt))
    return written


def curves(ax: Any, records: list[dict[str, Any]], keys: dict[str, str]) -> None:
    """Draw each key, under its label, that has a value at some step."""
    steps = [r["step"] for r in records]
    for key, label in keys.items():
        values = series(records, key)
        if not all(math.isnan(v) for v in values):  # markers: a value between two gaps still shows
            ax.plot(steps, values, label=label, marker=".", markersize=3)


def _family(records: list[dict[str, Any]], prefix: str) -> list[str]:
    """The keys `<prefix><suffix>` of any record, by the number their suffix starts with (a horizon,
    a turn bin's first turn)."""
    keys = {key for record in records for key in record if key.startswith(prefix)}
    return sorted(keys, key=lambda key: int(m.group()) if (m := re.match(r"\d+", key[len(prefix) :])) else 0)


def episode_panels(records: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """The panels of episodes.png, each its keys and their labels: those of the figures some record
    holds (`rollouts.episode_stats`): success by horizon (a line per horizon), turns and tool calls,
    tool errors by the turn they answered, length end to end and elided tokens, version spread."""
    panels = {
        "success by horizon": {k: k.split("_")[-1] for k in _family(records, "success/horizon_")},
        "turns and tool calls per episode": {"episode/turns": "turns", "episode/tool_calls": "tool calls"},
        "tool errors by turn": {k: k.split("/")[-1] for k in _family(records, "tool_errors/turn_")},
        "episode tokens": {"episode/tokens": "mean", "episode/tokens_max": "max", "episode/elided_tokens": "elided"},
        "version spread per episode": {"episode/version_spread": "mean", "episode/version_spread_max": "max"},
    }
    return {title: keys for title, keys in panels.items() if any(r.get(k) is not None for r in records for k in keys)}


def plot_episodes(records: list[dict[str, Any]], path: Path, plt: Any) -> Path | None:
    """What multi-turn episodes did, one panel per figure the records hold (`episode_panels`); None,
    and no file, when no record holds any (a run from before these keys)."""
    panels = episode_panels(records)
    if not panels:
        return None
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels.items(), strict=False):
        curves(ax, records, keys)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if title.startswith("success"):
            ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=7, title="horizon" if title.startswith("success") else None, title_fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


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
