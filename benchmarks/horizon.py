"""Success against horizon on the horizon preset: the loss channels' arms over seeds, and the context policies.

    python benchmarks/horizon.py [--seeds 0 1 2] [--arms rl sdpo replay all] [--horizons 2 4 8 16]
                                 [--out runs/horizon_bench] [-- ARGS for every run]
    python benchmarks/horizon.py --context --seeds 0 1 2 -- --max-steps 40   # cut against elide
    python benchmarks/horizon.py --network --seeds 0                          # one mesh, islands, workers
    python benchmarks/horizon.py --merge runs/h_s0/results_arm.json runs/h_s1/results_arm.json  # seeds run apart

Each seed's warm start runs once (`warm`) and every run of that seed starts RL from it; each
(arm, seed) is then one `meshrl train @ configs/horizon.toml --seed S` (same step budget), its
`final/` scored greedy on the task's held-out split at every horizon in `--horizons`
(`eval.n` prompts each; success: the full reward). Arms: `rl` (the preset as shipped: the RL
channel alone), `sdpo` (+SDPO at weight 0.05), `replay` (+replay DPO at 0.1), `all` (both). `--context` runs instead the
preset with its episodes past the budget (`--filler` words a tool result, a shorter
`--budget`: 8 hops then pass it), with `generator.context_policy` `cut` and `elide`. `--network` runs the preset as one mesh, as two DiLoCo
islands (half the prompts a step each, under one lighthouse) and with two outside rollout workers
(`meshrl rollout-worker`, offered half of each step's groups). Every run's numbers go to
OUT/results_<mode>.json; the figure, every seed a thin line and the arm's mean a thick one, to `--plot`.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import preset_runs  # benchmarks/, beside this script

from meshrl.configs.run_record import run_config
from meshrl.ingress.keys import generate_keys
from meshrl.run.evaluate import evaluate_checkpoint
from meshrl.run.run_dir import RunDir
from meshrl.trainer.islands import serve_lighthouse

REPO = Path(__file__).resolve().parents[1]
PRESET = REPO / "configs" / "horizon.toml"
REPLAY, SDPO = ["--loss.replay.weight", "0.1"], ["--loss.sdpo.weight", "0.05"]
ARMS = {"rl": [], "sdpo": SDPO, "replay": REPLAY, "all": [*REPLAY, *SDPO]}  # the preset is RL alone


start = functools.partial(preset_runs.start, [PRESET])
train = functools.partial(preset_runs.train, [PRESET])
warm = functools.partial(preset_runs.warm, [PRESET])
finish = preset_runs.finish


def islands(out: Path, seed: int, extra: list[str]) -> float:
    """Two DiLoCo islands of the preset at once, half its prompts a step each; `out` holds `a/` and `b/`."""
    prompts = int(run_config_value("task", "prompts_per_step")) // 2
    lighthouse = serve_lighthouse("[::]:0", min_islands=2, join_timeout_ms=30_000, heartbeat_timeout_ms=5_000)
    began = time.time()
    out.mkdir(parents=True, exist_ok=True)
    procs = {name: start(out / name, seed, [*extra, "--task.prompts_per_step", str(prompts),
                                            "--trainer.diloco.replica_id", name,
                                            "--trainer.diloco.lighthouse", lighthouse.address(),
                                            "--trainer.diloco.host", "localhost"])
             for name in ("a", "b")}  # fmt: skip
    for name, proc in procs.items():
        finish(out / name, proc)
    lighthouse.shutdown()
    return time.time() - began


def with_workers(out: Path, seed: int, extra: list[str], workers: int = 2) -> float:
    """The preset with the ingress on and `workers` outside rollout workers offered half of each step's groups."""
    keys = out.parent / f"{out.name}_keys"
    if not (keys / "controller.key").exists():
        generate_keys(keys, "controller")
        (keys / "authorized").mkdir()
        for i in range(workers):
            public, _ = generate_keys(keys / "workers", f"worker{i}")
            shutil.copy(public, keys / "authorized")
    address = "tcp://127.0.0.1:5571"
    groups = int(run_config_value("task", "prompts_per_step")) // 2
    began = time.time()
    proc = start(out, seed, [*extra, "--ingress.bind", address, "--ingress.server-key", str(keys / "controller.key_secret"),
                             "--ingress.authorized-keys", str(keys / "authorized"),
                             "--ingress.groups-per-step", str(groups)])  # fmt: skip
    outside = []
    for i in range(workers):
        log = (out.parent / f"{out.name}_worker{i}.log").open("w")
        args = [sys.executable, "-m", "meshrl.cli.main", "rollout-worker", "--connect", address,
                "--server-key", str(keys / "controller.key"), "--key", str(keys / "workers" / f"worker{i}.key_secret")]  # fmt: skip
        outside.append(subprocess.Popen(args, cwd=REPO, stdout=log, stderr=log))
    try:
        finish(out, proc)
    finally:
        for worker in outside:
            worker.terminate()
            worker.wait()
    return time.time() - began


def success_by_horizon(out: Path, horizons: list[int], n: int) -> dict[int, float]:
    """Greedy success on the held-out split at each horizon (the run's own task otherwise)."""
    scores = {}
    for hops in horizons:
        config = run_config(out, ["--eval.n", str(n), "--eval.k", "1"])
        kwargs = dict(config.task.kwargs)
        kwargs.update(hops=max(hops, kwargs.get("hops", hops)), eval_hops=hops)
        config.task.kwargs = kwargs
        scores[hops] = evaluate_checkpoint(config, out).pass_greedy
    return scores


def summary(records: list[dict]) -> dict[str, float]:
    """What the run's records say: the horizon it reached, and its last tenth's reward."""
    rl = [r for r in records if r.get("phase") != "warm_start"]
    tail = rl[-max(1, len(rl) // 10) :]
    return {
        "curriculum_horizon": rl[-1].get("curriculum/horizon", float("nan")),
        "reward_last_tenth": statistics.fmean(r["reward/mean"] for r in tail),
        "elided_rollouts": sum(r.get("rollouts/elided", 0) for r in rl),
        "budget_ended": sum(r.get("rollouts/budget_ended", 0) for r in rl),
        "outside_rollouts": sum(r.get("rollouts/external", 0) for r in rl),
        "outside_rejected": sum(v for k, v in rl[-1].items() if k.startswith("ingress/rejected")),
    }


def plot(results: list[dict], horizons: list[int], path: Path, key: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.4))
    arms = sorted({r[key] for r in results}, key=[r[key] for r in results].index)
    for color, arm in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], arms, strict=False):
        runs = [r for r in results if r[key] == arm]
        for r in runs:
            ax.plot(horizons, [r["success"][str(h)] for h in horizons], color=color, alpha=0.35, lw=1)
        mean = [statistics.fmean(r["success"][str(h)] for r in runs) for h in horizons]
        ax.plot(horizons, mean, color=color, lw=2.5, marker="o", label=f"{arm} (mean of {len(runs)} seeds)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(horizons, [str(h) for h in horizons])
    ax.set_xlabel("horizon (hops), held-out chains")
    ax.set_ylabel("greedy success")
    ax.set_ylim(-0.03, 1.03)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--horizons", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--n", type=int, default=32, help="held-out prompts per horizon")
    parser.add_argument("--context", action="store_true", help="cut against elide, results padded past the budget")
    parser.add_argument("--filler", type=int, default=16, help="--context: filler words per tool result")
    parser.add_argument("--budget", type=int, default=512, help="--context: an episode's token budget")
    parser.add_argument("--network", action="store_true", help="one mesh, two islands, two outside workers")
    parser.add_argument("--modes", nargs="+", choices=list(NETWORK), default=list(NETWORK), help="--network: which")
    parser.add_argument("--reuse", action="store_true", help="keep the rows OUT's results file has (arm and seed)")
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        help="run nothing: table and draw the rows of these results files together (seeds run apart)",
    )
    parser.add_argument("--out", default="runs/horizon_bench")
    parser.add_argument("--plot", default=None, help="default: docs/horizon.png (docs/horizon_context.png)")
    args, passed = parser.parse_known_args()
    common = [a for a in passed if a != "--"]
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    if args.context:  # every run, its warm start included, on results padded past the budget
        task = {**run_config_value("task", "kwargs"), "filler_words": args.filler}
        kwargs = ", ".join(f"{k} = {json.dumps(v)}" for k, v in task.items())
        layer = root / "context.toml"
        layer.write_text(f"[task]\nkwargs = {{ {kwargs} }}\n[trainer]\nmicro_batch_tokens = {args.budget}\n")
        common = ["@", str(layer), *common]
        arms = {policy: ["--generator.context_policy", policy] for policy in ("cut", "elide")}
        key, plot_path = "context_policy", args.plot or str(REPO / "docs" / "horizon_context.png")
    elif args.network:
        arms = {mode: [] for mode in args.modes}
        key, plot_path = "run", args.plot or str(REPO / "docs" / "horizon_network.png")
    else:
        arms = {arm: ARMS[arm] for arm in args.arms}
        key, plot_path = "arm", args.plot or str(REPO / "docs" / "horizon.png")

    if args.merge:  # every file's rows, each arm's seeds together in the order the arms first appear
        rows = [r for file in args.merge for r in json.loads(file.read_text())]
        arms_seen = list(dict.fromkeys(r[key] for r in rows))
        report(sorted(rows, key=lambda r: (arms_seen.index(r[key]), r["seed"])), args, key, plot_path)
        return
    path = root / f"results_{key}.json"
    kept = {(r[key], r["seed"]): r for r in json.loads(path.read_text())} if args.reuse and path.exists() else {}
    if args.network and (arms_path := root / "results_arm.json").exists():  # the arm `rl` is the one-mesh run
        kept.update({(r["arm"], r["seed"]): {**r, key: r["arm"]} for r in json.loads(arms_path.read_text())
                     if r["arm"] in ("rl", "warm start")})  # fmt: skip
    results = []

    def add(row: dict) -> None:
        results.append(row)
        print(json.dumps(row), flush=True)
        path.write_text(json.dumps(results, indent=1))

    for seed in args.seeds:
        warmed = warm(root, seed, common)
        start_from = ["--model.path", str(warmed), "--trainer.warm_start_steps", "0", "--eval.interval", "0"]
        if (row := kept.get(("warm start", seed))) is None:  # the warm start alone: RL's baseline
            before = success_by_horizon(warmed.parent, args.horizons, args.n)
            row = {key: "warm start", "seed": seed, "success": {str(h): s for h, s in before.items()}}
        add(row)
        for arm, flags in arms.items():
            if (row := kept.get((arm, seed))) is not None:
                add(row)
                continue
            out = root / f"{arm}_seed{seed}"
            if args.network:  # arm: how the preset is run; every run of a network mode on the same flags
                seconds = NETWORK[arm](out, seed, [*start_from, *common])
                finals = [out / "a", out / "b"] if arm == "islands" else [out]
            else:
                seconds, finals = train(out, seed, [*start_from, *flags, *common]), [out]
            scores = [success_by_horizon(final, args.horizons, args.n) for final in finals]
            success = {str(h): statistics.fmean(score[h] for score in scores) for h in args.horizons}
            records = RunDir(finals[0]).read_metrics()
            add({key: arm, "seed": seed, "train_s": round(seconds, 1), "success": success, **summary(records)})
    report(results, args, key, plot_path)


def report(results: list[dict], args: argparse.Namespace, key: str, plot_path: str) -> None:
    """Every row as a line of the table, then the figure."""
    print(f"\ngreedy success on held-out chains ({args.n} a horizon), by {key}; every seed:")
    print(f"{key:<10} seed " + "".join(f"{h:>7}" for h in args.horizons) + "  curriculum  train_s")
    for r in results:
        cells = "".join(f"{r['success'][str(h)]:>7.2f}" for h in args.horizons)
        trained = f"{r['curriculum_horizon']:>10.0f}  {r['train_s']:>7.0f}" if "train_s" in r else ""
        print(f"{r[key]:<10} {r['seed']:>4} {cells}  {trained}")
    plot(results, args.horizons, Path(plot_path), key)
    print(f"plot: {plot_path}")


NETWORK = {"islands": islands, "workers": with_workers, "rl": train}  # "rl": the arm of the same name


def run_config_value(section: str, key: str) -> Any:
    """A value the preset sets."""
    return tomllib.loads(PRESET.read_text())[section][key]


if __name__ == "__main__":
    main()
