"""Curves of a run's metrics.jsonl (reward, per-channel losses, throughput) as PNGs in DIR/plots/."""

from __future__ import annotations

from pathlib import Path

from meshrl.run.run_dir import RunDir


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
