"""The generator actor: one inference engine per proc, running episodes of the run's task."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from monarch.actor import Actor, current_rank, endpoint
from transformers import AutoTokenizer

from meshrl.configs.schema import RunConfig
from meshrl.inference.backends import make_engine
from meshrl.inference.weights import WeightLayout, unflatten_weights
from meshrl.rollouts.episodes import EpisodeRunner, Rollout
from meshrl.tasks.base import Prompt, make_task
from meshrl.topology.devices import proc_device, role_gpus
from meshrl.topology.worker import process_info


@dataclass
class RolloutBatch:
    """A generator's answer to one request: its episodes and the seconds they took."""

    rollouts: list[Rollout]
    seconds: float


class GeneratorActor(Actor):
    def __init__(self, config: RunConfig, model_path: str, rank: int | None = None) -> None:
        self.rank = current_rank().rank if rank is None else rank  # a replacement keeps the rank it replaces
        self.config = config
        torch.set_num_threads(max(1, torch.get_num_threads() // max(1, config.topology.generator.procs)))
        gpus = role_gpus(config.topology, "generator", self.rank)
        proc_device(config.topology, "generator", self.rank)  # refuses GPUs the host lacks
        self.engine = make_engine(config.generator.backend, model_path, config.model.dtype, gpus)
        self.runner = EpisodeRunner(self.engine, AutoTokenizer.from_pretrained(model_path), make_task(config.task))

    @endpoint
    def info(self) -> dict[str, Any]:
        return {"role": "generator", "rank": self.rank, **process_info()}

    @endpoint
    def rollout(self, prompts: list[Prompt], seed: int) -> RolloutBatch:
        """Episodes for `prompts` (each sampled `samples_per_prompt` times) and the seconds they took."""
        g = self.config.generator
        start = time.perf_counter()
        rollouts = self.runner.run(
            prompts, g.samples_per_prompt, temperature=g.temperature, top_p=g.top_p,
            max_new_tokens=g.max_new_tokens, version=self.engine.version, seed=seed,
        )  # fmt: skip
        return RolloutBatch(rollouts, time.perf_counter() - start)

    @endpoint
    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self.engine.load_weights(weights, version)

    @endpoint
    def pull_weights(self, buffer: Any, layout: WeightLayout, version: int) -> None:
        """Read the trainer's flat weight buffer straight into a local one, then load it."""
        flat = layout.empty()
        buffer.read_into(flat).get()
        self.engine.load_weights(unflatten_weights(flat, layout), version)
