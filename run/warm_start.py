"""The warm start: supervised steps on the task's demonstrations before RL, so the policy starts
from a model that knows the task's format (the tiny model and small real ones do not)."""

from __future__ import annotations

import random
from typing import Any

from transformers import PreTrainedTokenizerBase

from meshrl.configs.schema import RunConfig
from meshrl.rollouts.episodes import cap_trace
from meshrl.tasks.base import Task
from meshrl.traces.collator import TraceCollator


def warm_start(
    config: RunConfig, task: Task, tokenizer: PreTrainedTokenizerBase, collator: TraceCollator, trainers: Any
) -> None:
    """`trainer.warm_start_steps` SFT steps of `warm_start_batch_size` demonstrations (tool results
    capped as in an episode), each split across the trainer ranks; then the trainers turn to RL
    (the reference is taken there)."""
    steps, size = config.trainer.warm_start_steps, config.trainer.warm_start_batch_size
    demos = [
        cap_trace(demo, tokenizer, config.generator.max_tool_result_tokens)
        for demo in task.demonstrations(random.Random(config.seed + 2), steps * size)
    ]
    world = config.topology.trainer.size
    cut = 0
    for i in range(steps):
        chunk = demos[i * size : (i + 1) * size]
        collated = [collator(chunk[r::world]) for r in range(world)]
        cut += sum(c.stats.truncated for c in collated)
        trainers.sft_step.call([c.batch for c in collated]).get()
    if cut:
        print(f"warm start: {cut} demonstrations longer than trainer.micro_batch_tokens "
              f"{config.trainer.micro_batch_tokens} were cut to it", flush=True)  # fmt: skip
    trainers.start_rl.call().get()
