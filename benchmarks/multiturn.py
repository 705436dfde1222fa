"""Multi-turn generation throughput: the per-episode scheduler against lock-step turns.

    python benchmarks/multiturn.py [--model DIR] [--prompts 16] [--samples 4] [--tool-latency 0.05]

PollTask episodes take 1 to 8 polls (mixed lengths) and the tool sleeps `--tool-latency` s.
The model is the tiny model warm-started on PollTask's demonstrations through `meshrl train`
(or `--model`, a checkpoint's `model/` or a run's `final/`), so it polls turn after turn.

Lock-step (the generator before issue #12): every turn, the episodes still going are sampled
as one batch with a fresh KV cache (each conversation prefilled from scratch), the slowest one
gating the turn, then their tool calls run one after another. Per-episode: EpisodeScheduler,
every episode on its own with its KV cache kept, slots refilled, tools concurrent. Same engine
class, same prompts and seeds, one process; prints episodes/s, sampled tokens/s and the ratio.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from meshrl.configs import load_config
from meshrl.inference.hf_engine import HFEngine
from meshrl.rollouts.episodes import EpisodeFormat, Rollout
from meshrl.rollouts.scheduler import EpisodeScheduler, GroupRequest, Sampling
from meshrl.run.controller import train
from meshrl.tasks.base import Prompt
from meshrl.tasks.poll import PollTask

MAX_NEW_TOKENS = 40


def warm_started(out: Path, steps: int) -> Path:
    """The tiny model after `steps` warm-start steps on PollTask, through the real meshes."""
    config = load_config(["--task.import-path", "meshrl.tasks.poll:PollTask", "--trainer.warm-start-steps", str(steps),
                          "--trainer.warm-start-lr", "3e-3", "--trainer.warm-start-batch-size", "32",
                          "--max-steps", "1", "--output-dir", str(out), "--metrics.progress", "plain",
                          "--generator.max-new-tokens", str(MAX_NEW_TOKENS)])  # fmt: skip
    return train(config) / "final"


def lock_step(engine: HFEngine, episodes: EpisodeFormat, requests: list[tuple[Prompt, int]]) -> list[Rollout]:
    """The baseline: all episodes' turns in lock-step, tools one after another."""
    rollouts = [episodes.start(prompt) for prompt, _ in requests]
    seeds = random.Random(0)
    active = list(rollouts)
    while active:
        completions = engine.generate([r.token_ids for r in active], temperature=1.0, top_p=1.0,
                                      max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=episodes.stop_ids,
                                      seed=seeds.randrange(2**31))  # fmt: skip
        still = []
        for r, completion in zip(active, completions):
            calls = episodes.add_turn(r, completion)
            if calls:
                episodes.add_tool_results(r, calls, [episodes.call_tool(r, call) for call in calls])
            if episodes.goes_on(r, calls):
                still.append(r)
        active = still
    for r in rollouts:
        episodes.score(r)
    return rollouts


def per_episode(engine: HFEngine, episodes: EpisodeFormat, requests: list[tuple[Prompt, int]]) -> list[Rollout]:
    scheduler = EpisodeScheduler(engine, episodes, Sampling(1.0, 1.0, MAX_NEW_TOKENS), max_episodes=len(requests),
                                 max_tokens=1_000_000)  # fmt: skip
    try:
        scheduler.submit([GroupRequest(str(i), prompt, 1, seed) for i, (prompt, seed) in enumerate(requests)])
        groups = []
        while len(groups) < len(requests):
            groups += scheduler.take(60.0)
    finally:
        scheduler.close()
    return [r for g in groups for r in g.rollouts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--warm-start-steps", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tool-latency", type=float, default=0.05)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or warm_started(Path(tmp) / "warm", args.warm_start_steps)
        task = PollTask(1, 8, tool_latency_s=args.tool_latency)
        episodes = EpisodeFormat(AutoTokenizer.from_pretrained(model), task)
        prompts = task.sample_prompts(random.Random(1), args.prompts)
        requests = [(p, s) for p in prompts for s in range(args.samples)]
        results = {}
        for name, run in (("lock-step", lock_step), ("per-episode", per_episode)):
            engine = HFEngine.from_pretrained(str(model))
            start = time.perf_counter()
            rollouts = run(engine, episodes, requests)
            seconds = time.perf_counter() - start
            sampled = sum(sum(r.loss_mask) for r in rollouts)
            turns = [r.turns for r in rollouts]
            results[name] = (len(rollouts) / seconds, sampled / seconds)
            print(f"{name:<12} {seconds:7.2f} s  {results[name][0]:7.2f} episodes/s  {results[name][1]:8.1f} "
                  f"sampled tokens/s  turns {min(turns)}-{max(turns)} (mean {sum(turns) / len(turns):.1f})")  # fmt: skip
        ratio = results["per-episode"][0] / results["lock-step"][0]
        print(f"per-episode / lock-step: {ratio:.2f}x episodes/s, "
              f"{results['per-episode'][1] / results['lock-step'][1]:.2f}x sampled tokens/s (goal >= 2x)")  # fmt: skip


if __name__ == "__main__":
    main()
