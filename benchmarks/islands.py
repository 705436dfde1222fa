"""One trainer mesh against two DiLoCo islands at equal total rollouts, on the embedded default.

    python benchmarks/islands.py [--sync-every 10] [--outer-lr 1 --outer-momentum 0] [--out runs/islands]
    python benchmarks/islands.py --preset configs/smollm2.toml --prompts 4 -- --trainer.lr 3e-4 ...

Runs `meshrl train @ configs/local.toml [@ PRESET ...] [ARGS after --]` once as one island
(`--prompts` a step, 8 by default), then two islands at once (half the prompts a step each, the
same steps: the same rollouts in total) under one lighthouse,
and prints per trainer step the bytes each island's rank handed to torchft's all-reduce
(measured: `diloco/payload_bytes`) against what data parallelism all-reduces (every gradient,
every step: the model's parameter bytes, as `TrainerCore._all_reduce_grads` does), and the
mean reward of the last quarter of the steps (15 of 60). The outer optimizer defaults to the
config's (`trainer.diloco.*`). The reward curves go to docs/islands_reward.png (or --plot).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from meshrl.configs.schema import DilocoConfig
from meshrl.inference.vllm_engine import checkpoint_shapes
from meshrl.run.run_dir import RunDir
from meshrl.trainer.islands import serve_lighthouse

REPO = Path(__file__).resolve().parents[1]
MESHRL = [sys.executable, "-m", "meshrl.cli.main", "train", "@", str(REPO / "configs" / "local.toml")]


def records(out: Path) -> list[dict]:
    return RunDir(out).read_metrics()


def run(out: Path, seed: int, common: list[str], *extra: str) -> subprocess.Popen:
    """`meshrl train` with the invocation's presets and arguments (`common`), then this run's `extra`."""
    log = (out.parent / f"{out.name}.log").open("w")
    args = [
        *MESHRL,
        *common,
        "--output-dir",
        str(out),
        "--overwrite",
        "--seed",
        str(seed),
        "--metrics.progress",
        "plain",
        *extra,
    ]
    return subprocess.Popen(args, cwd=REPO, stdout=log, stderr=log, env={**os.environ, "RUST_LOG": "warn"})


def smooth(values: list[float], window: int = 10) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def main() -> None:
    parser = argparse.ArgumentParser()
    defaults = DilocoConfig()
    parser.add_argument("--sync-every", type=int, default=defaults.sync_every)
    parser.add_argument("--outer-lr", type=float, default=defaults.outer_lr)
    parser.add_argument("--outer-momentum", type=float, default=defaults.outer_momentum)
    parser.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=defaults.outer_nesterov)
    parser.add_argument("--plot", default=str(REPO / "docs" / "islands_reward.png"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/islands")
    parser.add_argument(
        "--min-islands", type=int, default=2,
        help="the lighthouse's quorum size: 2 keeps the islands in step (each outer step waits for both)",
    )  # fmt: skip
    parser.add_argument("--reuse-one", action="store_true", help="keep OUT/one from an earlier run")
    parser.add_argument("--preset", action="append", default=[], help="a config file layered over local.toml")
    parser.add_argument("--prompts", type=int, default=8, help="one island's prompts a step (each of two: half)")
    args, passed = parser.parse_known_args()
    common = [*(arg for preset in args.preset for arg in ("@", str(Path(preset).resolve()))),
                *(a for a in passed if a != "--")]  # fmt: skip
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)

    start = time.time()
    if not args.reuse_one:
        one = run(root / "one", args.seed, common, "--task.prompts_per_step", str(args.prompts))
        assert one.wait() == 0, (root / "one.log").read_text()[-3000:]
    one_s = time.time() - start

    lighthouse = serve_lighthouse(
        "[::]:0", min_islands=args.min_islands, join_timeout_ms=30_000, heartbeat_timeout_ms=5_000
    )
    start = time.time()
    islands = [
        run(root / name, args.seed, common, "--task.prompts_per_step", str(args.prompts // 2), "--trainer.diloco.replica_id", name,
            "--trainer.diloco.lighthouse", lighthouse.address(), "--trainer.diloco.host", "localhost",
            "--trainer.diloco.sync_every", str(args.sync_every), "--trainer.diloco.outer_lr", str(args.outer_lr),
            "--trainer.diloco.outer_momentum", str(args.outer_momentum),
            "--trainer.diloco.outer_nesterov", str(args.nesterov).lower())
        for name in ("a", "b")
    ]  # fmt: skip
    for name, proc in zip("ab", islands, strict=True):
        assert proc.wait() == 0, (root / f"{name}.log").read_text()[-3000:]
    two_s = time.time() - start
    lighthouse.shutdown()

    base, a, b = records(root / "one"), records(root / "a"), records(root / "b")
    steps = len(base)
    shapes = checkpoint_shapes(root / "one" / "final").values()  # from the files' headers, no tensor read
    param_bytes = sum(math.prod(shape) * 4 for shape in shapes)  # float32 master gradients, one per parameter
    diloco_per_step = a[-1]["diloco/payload_bytes"] / len(a)
    reward = lambda rs: [r["reward/mean"] for r in rs]  # noqa: E731
    two = [(x + y) / 2 for x, y in zip(reward(a), reward(b), strict=True)]
    tail = max(1, steps // 4)
    one_time = "reused" if args.reuse_one else f"{one_s:.0f} s"
    print(f"one island: {steps} steps ({one_time}); two islands at once: {two_s:.0f} s (2 CPU cores shared)")
    print(f"outer steps {a[-1]['diloco/outer_steps']:.0f} (a), {b[-1]['diloco/outer_steps']:.0f} (b); "
          f"islands per outer step: {[r['diloco/islands'] for r in a[args.sync_every - 1 :: args.sync_every]]}")  # fmt: skip
    print(f"all-reduce payload per trainer step and rank: DiLoCo {diloco_per_step:,.0f} B, "
          f"data parallel {param_bytes:,.0f} B (every parameter's float32 gradient): "
          f"ratio {diloco_per_step / param_bytes:.3f} (1/H = {1 / args.sync_every:.3f})")  # fmt: skip
    print(f"mean reward, last {tail} steps: one island {statistics.fmean(reward(base)[-tail:]):.3f}, "
          f"two islands {statistics.fmean(two[-tail:]):.3f}")  # fmt: skip

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(smooth(reward(base)), label=f"1 island, {args.prompts} prompts/step")
    outer = f"outer lr {args.outer_lr:g}, momentum {args.outer_momentum:g}{', Nesterov' if args.nesterov else ''}"
    ax.plot(smooth(two), label=f"2 islands x {args.prompts // 2} prompts/step (mean), H={args.sync_every}, {outer}")
    ax.set_xlabel("step")
    ax.set_ylabel("reward/mean (10-step mean)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
