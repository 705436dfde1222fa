"""The generator actor: one inference engine per proc, streaming episodes of the run's task.

The controller submits groups and long-polls `take` for finished ones; weights arrive
whenever the trainer publishes them and are swapped in between two decode steps. `take`
and the weight endpoints are concurrent endpoints, so neither waits behind the other.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch
from monarch.actor import Actor, concurrent_endpoint, current_rank, endpoint
from safetensors.torch import load_file
from transformers import AutoTokenizer

from meshrl.configs.schema import RunConfig
from meshrl.inference.backends import make_engine
from meshrl.inference.weights import WeightLayout, unflatten_weights
from meshrl.rollouts.chat import ChatSettings
from meshrl.rollouts.episodes import EpisodeFormat, EpisodeLimits, engine_limits
from meshrl.rollouts.scheduler import EpisodeScheduler, FinishedGroup, GroupRequest, Sampling
from meshrl.tasks.base import make_task
from meshrl.topology.devices import cpu_threads, proc_device, role_gpus
from meshrl.topology.worker import process_info
from meshrl.trainer.lora import add_lora, lora_generators


class GeneratorActor(Actor):
    def __init__(self, config: RunConfig, model_path: str, rank: int | None = None) -> None:
        self.rank = current_rank().rank if rank is None else rank  # a replacement keeps the rank it replaces
        g = config.generator
        gpus = role_gpus(config.topology, "generator", self.rank)
        if proc_device(config.topology, "generator", self.rank).type == "cpu":  # also refuses GPUs the host lacks
            torch.set_num_threads(cpu_threads())
        limits = EpisodeLimits.of(config)
        engine = make_engine(
            g.backend,
            model_path,
            config.model.dtype,
            gpus,
            engine_limits(config),
            g.vllm_log_level,
            g.hf_batching,
            config.seed + self.rank,  # continuous batching's one generator: ranks draw apart
            record_routing=config.trainer.routing_replay is not False,  # a mixture of experts' routing, replayed
        )
        if lora_generators(config):  # the trainer's adapters injected alike: a weight sync sends them alone
            add_lora(engine.model, config.model.lora).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        episodes = EpisodeFormat(tokenizer, make_task(config.task), ChatSettings.of(config.model), limits)
        self.scheduler = EpisodeScheduler(
            engine, episodes, Sampling(g.temperature, g.top_p, g.max_new_tokens),
            max_episodes=g.max_concurrent_episodes, max_tokens=g.max_concurrent_tokens,
        )  # fmt: skip

    @endpoint
    async def info(self) -> dict[str, Any]:
        return {"role": "generator", "rank": self.rank, **process_info()}

    @endpoint
    async def close(self) -> None:
        """Stop the scheduler and let the engine go: a failed generator is replaced, and its
        process must not hold a second copy of the model meanwhile."""
        self.scheduler.close()
        del self.scheduler

    @endpoint
    async def submit(self, requests: list[GroupRequest]) -> None:
        """Queue groups of episodes; they start as slots free up."""
        self.scheduler.submit(requests)

    @concurrent_endpoint
    async def take(self, wait_s: float) -> list[FinishedGroup]:
        """Finished groups, waiting up to `wait_s` for the first (a long poll)."""
        return await asyncio.to_thread(self.scheduler.take, wait_s)

    @concurrent_endpoint
    async def load_weights(self, weights: dict[str, torch.Tensor], version: int, wait: bool = False) -> None:
        """Stage pickled weights; the engine swaps them in between two decode steps (`wait`:
        return only then)."""
        await self._stage(weights, version, wait)

    @concurrent_endpoint
    async def pull_weights(self, buffer: Any, layout: WeightLayout, version: int, wait: bool = False) -> None:
        """Read the trainer's registered flat buffer into a local one and stage it: once this
        returns the trainer may overwrite its buffer."""
        flat = layout.empty()
        await buffer.read_into(flat)
        await self._stage(unflatten_weights(flat, layout), version, wait)

    @concurrent_endpoint
    async def read_weights(self, path: str, version: int, wait: bool = False) -> None:
        """Load the safetensors file the trainer published at `path` and stage it."""
        if not Path(path).exists():
            raise FileNotFoundError(
                f"generator rank {self.rank} does not see the published weights {path}: "
                "generator.weight_sync = filesystem needs output_dir on a filesystem the trainer and generator hosts share"
            )
        await self._stage(await asyncio.to_thread(load_file, path), version, wait)

    async def _stage(self, weights: dict[str, torch.Tensor], version: int, wait: bool) -> None:
        loaded = self.scheduler.load_weights(weights, version)
        if wait:
            await asyncio.to_thread(loaded.wait)
            self.scheduler.check()  # a load that failed (the engine refuses to sample) fails this call
