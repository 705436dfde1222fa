"""Async vs synchronous steps, and weight-sync time, through the real meshes in one process.

    python benchmarks/async_step.py [--steps 8] [@ preset.toml] [--dotted.overrides ...]

Runs the same short training four times: synchronous (generate, then train;
max_async_level 0) and async (level 1), each with weights pushed as pickled tensors and
through an RDMA buffer. Reports the median step time against max(generation, training)
and the weight-sync time per step. The first two steps (spawn and warm-up) are left out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

from meshrl.configs import load_config
from meshrl.run.controller import train
from meshrl.run.run_dir import RunDir


def run(base: list[str], level: int, sync: str, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        config = load_config([*base, "--generator.max_async_level", str(level), "--generator.weight_sync", sync,
                              "--max-steps", str(steps), "--output-dir", out, "--ckpt.interval", str(steps + 1),
                              "--metrics.progress", "plain"])  # fmt: skip
        train(config)
        records = RunDir(out).read_metrics()[2:]
    median = lambda key: statistics.median(r[key] for r in records)  # noqa: E731
    return {k: median(k) for k in ("time/step", "time/generate", "time/train", "time/weight_sync")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    args, rest = parser.parse_known_args()
    base = rest or ["@", "configs/local.toml", "--trainer.warm_start_steps", "0", "--teachers.members", "[]"]
    results = {(level, sync): run(base, level, sync, args.steps) for level in (0, 1) for sync in ("tensors", "rdma")}
    print(f"{'mode':<22}{'step s':>9}{'gen s':>9}{'train s':>9}{'sync s':>9}{'step/max(gen,train)':>22}")
    for (level, sync), r in results.items():
        bound = max(r["time/generate"], r["time/train"])
        name = f"{'async' if level else 'sync'} + {sync}"
        print(f"{name:<22}{r['time/step']:9.3f}{r['time/generate']:9.3f}{r['time/train']:9.3f}"
              f"{r['time/weight_sync']:9.3f}{r['time/step'] / bound:22.2f}")  # fmt: skip
    sync_step = results[(0, "tensors")]["time/step"]
    async_step = results[(1, "tensors")]["time/step"]
    print(f"async / sync step time: {async_step / sync_step:.2f} (goal for async: ≤ 1.15 × max(gen, train))")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
