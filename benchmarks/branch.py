"""One run's state, continued several times under each of several settings: what a setting does from
exactly that state (a run about to collapse, say), with far fewer runs than whole runs need.

    python benchmarks/branch.py RUN STEP --steps 20 --reps 3 --arm on --arm "off:--loss.replay.weight 0"

RUN is a finished run directory holding `checkpoints/step_STEP` (run it with `--ckpt.interval 1
--ckpt.keep-last 250` to branch from any step). Each repetition of each arm copies RUN's config
(with the changes its resumes recorded), tiny model, teacher cache and that checkpoint into
OUT/ARM_I, then resumes it for `--steps` steps: `meshrl train ARGS --output-dir OUT/ARM_I --resume
--allow-config-change --max-steps STEP+STEPS`, where ARGS are the arm's overrides after its colon
(split as a shell splits them). Repetitions and arms alternate, so the machine's load falls on each
alike. A resumed run draws the same prompts and seeds; it differs from its siblings by the timing of
its asynchronous steps, as whole runs do. Per branch it prints the rewards step by step (a branch
that fails is reported and left out), then per arm the mean over the branches from the second step
on (the first was mostly sampled before the branch's own first update) of reward, tool errors,
`grad_norm`, the replay loss and, for thinking models, the sampled reasoning (`reasoning/tokens`).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from meshrl.configs.run_record import ALLOW_CHANGE, CHANGES, RECORD
from meshrl.run.run_dir import RunDir

REPO = Path(__file__).resolve().parents[1]
CARRIED = (RECORD, CHANGES, "tiny_model", "teacher_cache.jsonl")  # what a resumed run reads besides the checkpoint


def branch(run: Path, step: int, steps: int, out: Path, overrides: list[str]) -> list[dict]:
    """One resumed copy of `run` at `step`; its records after `step`."""
    shutil.rmtree(out, ignore_errors=True)
    (out / "checkpoints").mkdir(parents=True)
    for name in CARRIED:
        source = run / name
        if source.is_dir():
            shutil.copytree(source, out / name)
        elif source.exists():
            shutil.copy2(source, out / name)
    shutil.copytree(run / "checkpoints" / f"step_{step}", out / "checkpoints" / f"step_{step}")
    shutil.copy2(run / "metrics.jsonl", out / "metrics.jsonl")  # the resume keeps the records step_N covers
    command = [sys.executable, "-m", "meshrl.cli.main", "train", *overrides]  # over the copied run's config
    command += ["--output-dir", str(out), "--resume", ALLOW_CHANGE, "--max-steps", str(step + steps)]
    command += ["--ckpt.interval", "1000000"]  # last: an arm's preset sets none of these
    with (out.parent / f"{out.name}.log").open("w") as log:
        subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
    return [row for row in RunDir(out).read_metrics() if row["step"] >= step]


def mean(rows: list[dict], key: str) -> float:
    values = [row[key] for row in rows if row.get(key) is not None]
    return statistics.fmean(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("step", type=int)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--arm", action="append", required=True, help='NAME or "NAME:--key value --key value"')
    parser.add_argument("--out", type=Path, default=Path("/tmp/branches"))
    args = parser.parse_args()
    run, out = args.run.resolve(), args.out.resolve()  # the runs start in the repository
    arms: dict[str, list[str]] = {}
    for spec in args.arm:
        name, _, rest = spec.partition(":")
        if name in arms:
            parser.error(f"arm {name!r} given twice")
        arms[name] = shlex.split(rest)
    results: dict[str, list[list[dict]]] = {name: [] for name in arms}
    for rep in range(args.reps):
        for name, overrides in arms.items():
            try:
                rows = branch(run, args.step, args.steps, out / f"{name}_{rep}", overrides)
            except subprocess.CalledProcessError as error:
                print(f"{name} {rep}: failed (exit {error.returncode}; see {out / f'{name}_{rep}.log'})", flush=True)
                continue
            results[name].append(rows)
            print(f"{name} {rep}: " + " ".join(f"{row['reward/mean']:.2f}" for row in rows), flush=True)
    for name, branches in results.items():
        after = [row for rows in branches for row in rows[1:]]
        print(
            f"{name}: reward {mean(after, 'reward/mean'):.3f}, tool errors {mean(after, 'tool_errors'):.1f}, "
            f"grad_norm {mean(after, 'grad_norm'):.2f}, replay loss {mean(after, 'loss/replay'):.2f}"
            + (
                f", reasoning tokens {mean(after, 'reasoning/tokens'):.1f}"
                if any("reasoning/tokens" in r for r in after)
                else ""
            )
            + f" (steps {args.step + 1}-{args.step + args.steps - 1}, {len(branches)} branches)"
        )


if __name__ == "__main__":
    main()
