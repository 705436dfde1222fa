"""The generator actor: one inference engine per proc, running episodes of the run's task."""

from __future__ import annotations

import time
from typing import Any

import torch
from monarch.actor import Actor, current_rank, endpoint
from transformers import AutoTokenizer

from meshrl.actors.rollout import EpisodeRunner, Rollout
from meshrl.actors.run_dir import process_info
from meshrl.configs.schema import RunConfig
from meshrl.loss_adapters.compose import import_object
from meshrl.tasks.base import Prompt


def make_task(config: RunConfig) -> Any:
    """The task factory named by `task.import_path`, called with `task.kwargs`."""
    try:
        factory = import_object(config.task.import_path)
    except ValueError as exc:
        raise ValueError(f"task.import_path: {exc}") from None
    return factory(**config.task.kwargs)


def make_engine(config: RunConfig, model_path: str) -> Any:
    if config.generator.backend == "vllm":
        from meshrl.actors.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, dtype=config.model.dtype)
    from meshrl.actors.hf_engine import HFEngine

    return HFEngine.from_pretrained(model_path, dtype=config.model.dtype)


class GeneratorActor(Actor):
    def __init__(self, config: RunConfig, model_path: str, rank: int | None = None) -> None:
        self.rank = current_rank().rank if rank is None else rank  # a replacement keeps the rank it replaces
        self.config = config
        torch.set_num_threads(max(1, torch.get_num_threads() // max(1, config.topology.generator.procs)))
        self.engine = make_engine(config, model_path)
        self.runner = EpisodeRunner(self.engine, AutoTokenizer.from_pretrained(model_path), make_task(config))

    @endpoint
    def info(self) -> dict[str, Any]:
        return {"role": "generator", "rank": self.rank, **process_info()}

    @endpoint
    def rollout(self, prompts: list[Prompt], seed: int) -> tuple[list[Rollout], float]:
        """Episodes for `prompts` (each sampled `samples_per_prompt` times) and the seconds they took."""
        g = self.config.generator
        start = time.perf_counter()
        rollouts = self.runner.run(
            prompts, g.samples_per_prompt, temperature=g.temperature, top_p=g.top_p,
            max_new_tokens=g.max_new_tokens, version=self.engine.version, seed=seed,
        )  # fmt: skip
        return rollouts, time.perf_counter() - start

    @endpoint
    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self.engine.load_weights(weights, version)

    @endpoint
    def pull_weights(self, buffer: Any, layout: list[tuple[str, tuple[int, ...], int]], version: int) -> None:
        """Read the trainer's flat weight buffer straight into a local one, then load it."""
        flat = torch.empty(sum(n for _, _, n in layout))
        buffer.read_into(flat).get()
        weights, offset = {}, 0
        for name, shape, n in layout:
            weights[name] = flat[offset : offset + n].view(shape)
            offset += n
        self.engine.load_weights(weights, version)
