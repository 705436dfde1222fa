"""Step time against max(generation, training), synchronous and async, through the real meshes.

    python benchmarks/async_step.py [--steps 12] [--warm-start-steps 200] [@ preset.toml] [--dotted.overrides ...]

First a warm start through `meshrl train` (the embedded default's task and teachers unless a
preset is given); its `final/` model is then the policy of every timed run, so they skip the
warm start and generate the multi-turn episodes a trained policy makes. Timed runs:
max_async_level 0 (synchronous: a step's episodes start on the policy it trains) and 1 and 2
(generation runs ahead), with weights as pickled tensors, and level 1 through the RDMA
buffer. Medians over the steps after the first two (spawn, warm-up); generation time is the
span from a step's first episode start to its last episode end.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from meshrl.configs import load_config
from meshrl.run.controller import train
from meshrl.run.run_dir import RunDir

KEYS = ("time/step", "time/generate", "time/train", "time/weight_sync", "time/wait_rollouts", "staleness")


def run(base: list[str], extra: list[str], out: Path) -> dict[str, float]:
    config = load_config([*base, *extra, "--output-dir", str(out), "--metrics.progress", "plain"])
    train(config)
    records = RunDir(out).read_metrics()[2:]
    return {k: statistics.median(r[k] for r in records) for k in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warm-start-steps", type=int, default=200)
    args, rest = parser.parse_known_args()
    base = rest or ["@", "configs/local.toml"]
    with tempfile.TemporaryDirectory() as tmp:
        warm = Path(tmp) / "warm"
        run(base, ["--trainer.warm_start_steps", str(args.warm_start_steps), "--max-steps", "3"], warm)
        timed = [*base, "--model.path", str(warm / "final"), "--trainer.warm_start_steps", "0",
                 "--max-steps", str(args.steps), "--ckpt.interval", str(args.steps + 1)]  # fmt: skip
        tensors = ["--generator.weight_sync", "tensors"]
        modes = {
            "sync + tensors": ["--generator.max_async_level", "0", *tensors],
            "async 1 + tensors": ["--generator.max_async_level", "1", *tensors],
            "async 2 + tensors": ["--generator.max_async_level", "2", *tensors],
            "async 1 + rdma": ["--generator.max_async_level", "1", "--generator.weight_sync", "rdma"],
        }
        results = {name: run(timed, extra, Path(tmp) / name.replace(" ", "")) for name, extra in modes.items()}
    print(f"{'mode':<20}{'step s':>9}{'gen s':>9}{'train s':>9}{'wait s':>9}{'sync s':>9}{'stale':>7}"
          f"{'step/max(gen,train)':>22}")  # fmt: skip
    for name, r in results.items():
        bound = max(r["time/generate"], r["time/train"])
        print(f"{name:<20}{r['time/step']:9.3f}{r['time/generate']:9.3f}{r['time/train']:9.3f}"
              f"{r['time/wait_rollouts']:9.3f}{r['time/weight_sync']:9.3f}{r['staleness']:7.2f}"
              f"{r['time/step'] / bound:22.2f}")  # fmt: skip
    sync_step = results["sync + tensors"]["time/step"]
    for name in ("async 1 + tensors", "async 2 + tensors"):
        print(f"{name} / sync step time: {results[name]['time/step'] / sync_step:.2f}")
    print("goal: async step / max(gen, train) <= 1.05")


if __name__ == "__main__":
    main()
