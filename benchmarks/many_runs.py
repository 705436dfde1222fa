"""The main job (or any config) run many times, one after another: how many collapse, and where
the others end.

    python benchmarks/many_runs.py --runs 20 [--first-seed 0] [--same-seed] [--out DIR] [-- ARGS...]
    python benchmarks/many_runs.py --seeds 0 2 3 [--out DIR] [-- ARGS...]

Each run is `meshrl train @ configs/local.toml ARGS... --seed S --output-dir OUT/run_I` in a fresh
output directory OUT/run_I (warm start included), seeds `--first-seed` onward (`--same-seed`: every run seed
`--first-seed`, so only timing differs). A run *collapsed* when its reward over the last tenth of
its steps is below `--bar` (healthy runs of the embedded default end at 0.85-0.96; collapsed ones
near 0) after its reward had been above it (a tenth's rolling mean); one whose rolling mean never
reached the bar *never learned* (a failed warm start, not a collapse). A run *dipped* when that
rolling mean fell under the bar after reaching it, whether or not it came back before the end (a
collapse caught early; with 60 steps, one that starts late ends the run as a collapse); each run
also counts its steps whose own reward fell under the bar after that point. Per run it prints the first
and last tenth's reward, where a collapse began (the rolling mean under `--bar` from there on), and the replay channel's
`reward_chosen` / `reward_rejected` (β-scaled log-ratios to the reference) over the last tenth,
and for thinking models the sampled reasoning (`reasoning/tokens`) first and last tenth; then the
counts. Runs already finished in OUT are read, not run again, so an interrupted study resumes.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from meshrl.run.run_dir import RunDir

REPO = Path(__file__).resolve().parents[1]


@dataclass
class RunSummary:
    seed: int
    first: float
    last: float
    collapse_step: int | None
    lowest: float | None  # the lowest rolling mean after the run first reached the bar
    low_steps: int  # steps after that first window whose own reward was under the bar
    chosen: float
    rejected: float
    reasoning: tuple[float, float] | None  # reasoning/tokens, first and last tenth
    seconds: float

    bar: float

    @property
    def collapsed(self) -> bool:
        return self.collapse_step is not None

    @property
    def dipped(self) -> bool:
        return self.lowest is not None and self.lowest < self.bar

    @property
    def never_learned(self) -> bool:
        return self.last < self.bar and not self.collapsed


def summarize(metrics: Path, seed: int, seconds: float, bar: float) -> RunSummary:
    rows = RunDir(metrics.parent).read_metrics()
    rewards = [row["reward/mean"] for row in rows]
    tenth = max(1, len(rows) // 10)
    last = statistics.fmean(rewards[-tenth:])
    # a tenth's rolling mean: one lucky step is no learning, one bad step no collapse
    rolling = [statistics.fmean(rewards[i : i + tenth]) for i in range(len(rewards) - tenth + 1)]
    learned = next((i for i, mean in enumerate(rolling) if mean >= bar), None)
    collapse_step = None
    if last < bar and learned is not None:
        after = [i for i in range(learned, len(rolling)) if all(mean < bar for mean in rolling[i:])]
        collapse_step = rows[after[0]]["step"] if after else rows[-tenth]["step"]

    def mean(key: str, part: list[dict]) -> float:
        values = [row[key] for row in part if key in row]
        return statistics.fmean(values) if values else float("nan")

    thinks = "reasoning/tokens" in rows[0]

    return RunSummary(
        seed=seed,
        first=statistics.fmean(rewards[:tenth]),
        last=last,
        collapse_step=collapse_step,
        lowest=min(rolling[learned:]) if learned is not None else None,
        low_steps=sum(reward < bar for reward in rewards[learned + tenth :]) if learned is not None else 0,
        chosen=mean("replay/reward_chosen", rows[-tenth:]),
        rejected=mean("replay/reward_rejected", rows[-tenth:]),
        reasoning=(mean("reasoning/tokens", rows[:tenth]), mean("reasoning/tokens", rows[-tenth:])) if thinks else None,
        seconds=seconds,
        bar=bar,
    )


def run_one(run_dir: Path, seed: int, config: str, extra: list[str]) -> float:
    command = [sys.executable, "-m", "meshrl.cli.main", "train", "@", config, *extra]
    command += ["--seed", str(seed), "--output-dir", str(run_dir)]  # last: a preset in `extra` sets neither
    started = time.perf_counter()
    with run_dir.with_suffix(".log").open("w") as log:
        subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
    seconds = time.perf_counter() - started
    (run_dir / "seconds").write_text(f"{seconds:.1f}\n")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--same-seed", action="store_true", help="every run the first seed: only timing differs")
    parser.add_argument(
        "--seeds", type=int, nargs="+", help="these seeds, one run each (instead of --runs from --first-seed)"
    )
    parser.add_argument("--config", default="configs/local.toml")
    parser.add_argument("--bar", type=float, default=0.5, help="last-tenth reward under which a run collapsed")
    parser.add_argument("--out", type=Path, default=Path("/tmp/many_runs"))
    parser.add_argument("extra", nargs="*", help="more `meshrl train` arguments (after --)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summaries = []
    seeds = args.seeds or [args.first_seed if args.same_seed else args.first_seed + i for i in range(args.runs)]
    for i, seed in enumerate(seeds):
        run_dir = args.out / f"run_{i:03d}"
        done = run_dir / "seconds"
        seconds = float(done.read_text()) if done.exists() else run_one(run_dir, seed, args.config, args.extra)
        summary = summarize(run_dir / "metrics.jsonl", seed, seconds, args.bar)
        summaries.append(summary)
        mark = f"COLLAPSED at step {summary.collapse_step}" if summary.collapsed else "held"
        mark = "never reached the bar" if summary.never_learned else mark
        mark += f" (dipped to {summary.lowest:.3f})" if summary.dipped and not summary.collapsed else ""
        thought = "" if summary.reasoning is None else "reasoning {:.1f} -> {:.1f} tokens; ".format(*summary.reasoning)
        print(
            f"run {i + 1:2d} seed {seed:3d}: reward {summary.first:.3f} -> {summary.last:.3f} {mark}; "
            f"{summary.low_steps} steps under the bar after reaching it; {thought}"
            f"last tenth replay chosen {summary.chosen:+.3f} rejected {summary.rejected:+.3f}; {seconds:.0f} s",
            flush=True,
        )
    collapsed = sum(s.collapsed for s in summaries)
    never = sum(s.never_learned for s in summaries)
    dipped = sum(s.dipped for s in summaries)
    healthy = [s.last for s in summaries if s.last >= args.bar]
    print(
        f"{collapsed} of {len(summaries)} runs collapsed, {dipped} dipped under the bar after reaching it (the collapsed "
        f"ones included), {never} never reached the bar; the others' last-tenth reward "
        f"{min(healthy, default=float('nan')):.3f}-{max(healthy, default=float('nan')):.3f} "
        f"(median {statistics.median(healthy) if healthy else float('nan'):.3f}); "
        f"median {statistics.median(s.seconds for s in summaries):.0f} s a run"
    )


if __name__ == "__main__":
    main()
