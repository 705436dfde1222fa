"""SmolLM2's held-out pass@1 on the multi-turn code preset: as shipped, after the warm start, and
after RL with each loss channel, over seeds.

    python benchmarks/code_tools.py [--seeds 0 1 2] [--arms rl sdpo replay all replay_own] [--out runs/code_tools_bench] [-- ARGS]
    python benchmarks/code_tools.py --merge runs/ct_s0/results.json runs/ct_s1/results.json   # seeds run apart
    python benchmarks/code_tools.py --moves [--seeds 0 1 2] [--out runs/code_tools_bench]       # finished runs

`configs/local.toml` under `configs/smollm2_code_tools.toml` (the code exercises with `run_python`).
Each seed's warm start runs once and every arm of that seed starts RL from its export (fresh
AdamW moments, as the preset's own RL does); each (arm, seed) is then one `meshrl train` with the
preset's step budget, its newest checkpoint scored by `meshrl eval --checkpoint` (the preset's
`eval.n` held-out exercises, greedy and `eval.k` samples each, in a process of its own). Arms:
`rl` (the preset: the RL channel alone), `sdpo` (+SDPO at the error sites of `run_python` runs,
the hint being the reference function), `replay` (+replay DPO, the task's oracle as the teacher),
`all` (both), `replay_own` (+replay DPO, the seed's warm start and the oracle as teachers, agreeing by
outcome: `arm_args`). Beside pass@1 each row keeps what the channel trained on: SDPO recovery tokens and
replay pairs per step, replay's accuracy and margin, each channel's loss and its part of the
gradient (`metrics.channel_grad_norms`), tool calls and errors per episode. Rows go to
OUT/results.json as each finishes (`--reuse` keeps finished ones). `--moves` reads the finished
runs instead: how far each arm's final weights are from the seed's warm start, and the cosine of
that move with RL alone's (AdamW's step length is set by the learning rate, not by the gradient's
norm, so a channel that pulls as hard as RL takes its share of the direction, not extra length).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import preset_runs  # benchmarks/, beside this script
import torch
from safetensors.torch import load_file

REPO = preset_runs.REPO
PRESETS = [REPO / "configs" / "local.toml", REPO / "configs" / "smollm2_code_tools.toml"]
REPLAY = ["--loss.replay.weight", "0.1", "--teachers.members", '[{"backend": "oracle"}]', "--teachers.min-agree", "1"]
# SDPO's weight, tuned on training steps alone: at weight 1 its part of the gradient was 0.057 and
# 0.049 against RL's 0.18 and 0.096 on seed 0's first two steps (`grad_norm/sdpo`, `grad_norm/rl`), so
# at 3 the two pull about alike; at 0.05 (its first try) it was 1/60 to 1/40 of RL's: RL alone.
SDPO = ["--loss.sdpo.weight", "3"]
ARMS = {"rl": [], "sdpo": SDPO, "replay": REPLAY, "all": [*REPLAY, *SDPO]}  # and `replay_own`: `arm_args`
ARM_NAMES = [*ARMS, "replay_own"]


def arm_args(arm: str, warmed: Path) -> list[str]:
    """An arm's `meshrl train` arguments. `replay_own`: replay with two teachers, the seed's warm start
    answering greedily (a checkpoint of the run, in the policy's own words) before the oracle, both
    needed (`min_agree` 2) and agreeing by what their actions do, so a pair is mined only where the
    policy's own greedy start does what the oracle does and its chosen side is the model's action."""
    if arm != "replay_own":
        return ARMS[arm]
    own = {"backend": "hf", "name": "warm_start", "path": str(warmed), "renderer": "hermes"}
    return ["--loss.replay.weight", "0.1", "--teachers.members", json.dumps([own, {"backend": "oracle"}]),
            "--teachers.min-agree", "2", "--teachers.agree-by", "outcome"]  # fmt: skip


MEASURED = ["--metrics.channel_grad_norms", "true"]  # every arm: how far each channel moved the policy
KEPT = ("sdpo/tokens", "replay_pairs", "replay/accuracy", "replay/margin", "loss/sdpo", "loss/replay",
        "episode/tool_calls", "tool_errors", "reward/mean", "grad_norm", "grad_norm/rl", "grad_norm/replay",
        "grad_norm/sdpo")  # fmt: skip


def evaluate(run: Path, out: Path) -> dict[str, float]:
    """`meshrl eval` of a run's newest checkpoint (or of the preset's model as shipped, `run` None)."""
    where = ["--checkpoint", str(run)] if run else [arg for p in PRESETS for arg in ("@", str(p))]
    done = subprocess.run([sys.executable, "-m", "meshrl.cli.main", "eval", *where, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"meshrl eval {' '.join(where)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    return {key: result[key] for key in ("eval/pass@1", "eval/pass@4", "eval/pass_greedy") if key in result} | {
        key.removeprefix("eval/task_metric/"): value for key, value in result.items() if "task_metric" in key
    }


def trained_on(run: Path) -> dict[str, float]:
    """Per-step means over the RL steps of what each channel trained on (steps without a key count 0)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r.get("phase") != "warm_start" and "reward/mean" in r]
    means = {key: statistics.fmean(r.get(key) or 0.0 for r in rl) for key in KEPT}  # null: a skipped step
    tenth = max(1, len(rl) // 10)
    means["reward first tenth"] = statistics.fmean(r["reward/mean"] for r in rl[:tenth])
    means["reward last tenth"] = statistics.fmean(r["reward/mean"] for r in rl[-tenth:])
    return means


def exported(run: Path) -> dict[str, torch.Tensor]:
    """A run's exported weights (RUN/final, every safetensors shard)."""
    shards = sorted((run / "final").glob("*.safetensors"))
    if not shards:
        raise SystemExit(f"{run / 'final'}: no exported weights (*.safetensors); did its run finish?")
    return {name: t for shard in shards for name, t in load_file(shard).items()}


def moves(out: Path, seeds: list[int]) -> str:
    """Each finished arm's distance from its seed's warm start (L2 over all weights) and the cosine of
    its move with RL alone's."""
    lines = []
    for seed in seeds:
        warm = exported(out / f"warm_seed{seed}")
        moved = {}
        for arm in ARM_NAMES:
            if (out / f"{arm}_seed{seed}" / "final").is_dir():
                final = exported(out / f"{arm}_seed{seed}")
                moved[arm] = torch.cat([(final[k].double() - warm[k].double()).flatten() for k in warm])
        rl = moved.get("rl")
        for arm, delta in moved.items():
            cosine = (
                "" if rl is None or arm == "rl" else f", cosine with rl's {torch.cosine_similarity(delta, rl, 0):.3f}"
            )
            lines.append(f"seed {seed} {arm}: moved {delta.norm():.3f}{cosine}")
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    seeds = sorted({row["seed"] for row in rows if row["seed"] is not None})
    arms = list(dict.fromkeys(row["arm"] for row in rows))
    lines = ["| arm | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |", "|---" * (len(seeds) + 2) + "|"]
    for arm in arms:
        found = {row["seed"]: row["eval"]["eval/pass@1"] for row in rows if row["arm"] == arm}
        if None in found:  # the model as shipped: one row for every seed
            found = dict.fromkeys(seeds, found[None])
        cells = [f"{found[s]:.3f}" if s in found else "" for s in seeds]
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {statistics.fmean(found.values()):.3f} |")
    return "held-out pass@1 (sampled)\n" + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", choices=ARM_NAMES, default=list(ARMS))
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "code_tools_bench")
    parser.add_argument("--reuse", action="store_true", help="keep the rows OUT/results.json already has")
    parser.add_argument("--merge", type=Path, nargs="+", help="table these results files together instead")
    parser.add_argument("--moves", action="store_true", help="how far the finished runs in OUT moved, instead")
    parser.add_argument("extra", nargs="*", help="after --: arguments for every meshrl train")
    args = parser.parse_args()
    if args.merge:
        print(table([row for path in args.merge for row in json.loads(path.read_text())]))
        return
    if args.moves:
        print(moves(args.out, args.seeds))
        return
    args.out = args.out.resolve()  # the runs' processes start in the repository
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.json"
    rows = json.loads(results.read_text()) if args.reuse and results.exists() else []
    done = {(row["arm"], row["seed"]) for row in rows}

    def keep(row: dict[str, Any]) -> None:
        rows.append(row)
        results.write_text(json.dumps(rows, indent=1) + "\n")
        print(json.dumps(row), flush=True)

    if ("as shipped", None) not in done:
        keep({"arm": "as shipped", "seed": None, "eval": evaluate(None, args.out / "shipped_eval.json")})
    for seed in args.seeds:
        warmed = preset_runs.warm(PRESETS, args.out, seed, args.extra)
        if ("warm start", seed) not in done:
            keep({"arm": "warm start", "seed": seed, "eval": evaluate(warmed.parent, args.out / f"warm_{seed}.json")})
        start_from = ["--model.path", str(warmed), "--trainer.warm_start_steps", "0"]
        for arm in args.arms:
            if (arm, seed) in done:
                continue
            run = args.out / f"{arm}_seed{seed}"
            seconds = preset_runs.train(
                PRESETS, run, seed, [*start_from, *MEASURED, *arm_args(arm, warmed), *args.extra]
            )
            evaluated = evaluate(run, args.out / f"{arm}_{seed}.json")
            keep({"arm": arm, "seed": seed, "eval": evaluated, "trained_on": trained_on(run), "seconds": seconds})
    print(table(rows))


if __name__ == "__main__":
    main()
