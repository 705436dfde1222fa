"""The warm start: supervised steps on the task's demonstrations before RL, so the policy starts
from a model that knows the task's format (the tiny model and small real ones do not).

`sft_steps` yields each step's metrics, so the controller records, shows and checkpoints the warm
start as it does RL steps; the demonstrations are drawn from the run's seed, so a warm start
resumed at step k trains on exactly the demonstrations it would have.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

from transformers import PreTrainedTokenizerBase

from meshrl.configs.schema import RunConfig
from meshrl.rollouts.episodes import cap_trace
from meshrl.tasks.base import Task
from meshrl.traces.collator import TraceCollator


def sft_steps(
    config: RunConfig,
    task: Task,
    tokenizer: PreTrainedTokenizerBase,
    collator: TraceCollator,
    trainers: Any,
    start: int = 0,
) -> Iterator[dict[str, Any]]:
    """`trainer.warm_start_steps` SFT steps of `warm_start_batch_size` demonstrations (tool results
    capped as in an episode), each split across the trainer ranks, from step `start`; each step's
    record. The trainers turn to RL afterwards (`start_rl`), which the caller does."""
    steps, size = config.trainer.warm_start_steps, config.trainer.warm_start_batch_size
    demos = [
        cap_trace(demo, tokenizer, config.generator.max_tool_result_tokens)
        for demo in task.demonstrations(random.Random(config.seed + 2), steps * size)
    ]
    world = config.topology.trainer.size
    cut = 0
    for i in range(start, steps):
        began = time.perf_counter()
        chunk = demos[i * size : (i + 1) * size]
        collated = [collator(chunk[r::world]) for r in range(world)]
        cut += sum(c.stats.truncated for c in collated)
        ranks = list(trainers.sft_step.call([c.batch for c in collated]).get().values())
        yield {
            "phase": "warm_start",
            "step": i,
            "warm_start/loss": sum(r["loss/sft"] for r in ranks) / len(ranks),
            "warm_start/grad_norm": ranks[0]["grad_norm"],
            "warm_start/lr": ranks[0]["lr"],
            "warm_start/seconds": time.perf_counter() - began,
        }
    if cut:
        print(f"warm start: {cut} demonstrations longer than trainer.micro_batch_tokens "
              f"{config.trainer.micro_batch_tokens} were cut to it", flush=True)  # fmt: skip
