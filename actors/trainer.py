"""The trainer actor: one `TrainerCore` per proc of the trainer mesh, with torch.distributed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from monarch.actor import Actor, current_rank, endpoint
from monarch.rdma import RDMABuffer

from meshrl.configs.schema import RunConfig
from meshrl.inference.weights import WeightLayout, flatten_weights, refill_flat, save_weights_file
from meshrl.topology.devices import cpu_threads, proc_device
from meshrl.topology.worker import process_info
from meshrl.trainer.core import TrainerCore


class TrainerActor(Actor):
    """One trainer rank. Every rank gets the whole step's micro-batches and takes its share."""

    def __init__(self, config: RunConfig, model_path: str) -> None:
        self.rank = current_rank().rank
        self.config, self.model_path = config, model_path
        self.core: TrainerCore | None = None
        self._buffer: tuple[torch.Tensor, RDMABuffer, WeightLayout] | None = None

    @endpoint
    def setup(self) -> dict[str, Any]:
        device = proc_device(self.config.topology, "trainer", self.rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(cpu_threads())
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        self.core = TrainerCore(self.config, self.model_path, str(device))
        return {"role": "trainer", "rank": self.rank, **process_info()}

    @endpoint
    def train_step(
        self, rl_shards: list[list[dict[str, Any]]], aux_shards: list[dict[str, Any] | None], rl_tokens: int
    ) -> dict[str, float]:
        return self.core.train_step(rl_shards, aux_shards, rl_tokens, self.rank)

    @endpoint
    def sft_step(self, shards: list[dict[str, Any]]) -> dict[str, float]:
        return self.core.sft_step(shards, self.rank)

    @endpoint
    def start_rl(self) -> None:
        self.core.start_rl()

    @endpoint
    def policy_weights(self, adapters_only: bool = False) -> dict[str, torch.Tensor] | None:
        """Rank 0's full weights (or LoRA adapters alone) in the compute dtype; the other ranks return
        None (they join the FSDP2 gather)."""
        weights = self.core.weights(self.core.compute_dtype, adapters_only)
        return weights if self.rank == 0 else None

    @endpoint
    def policy_weights_rdma(self, adapters_only: bool = False) -> tuple[Any, WeightLayout] | None:
        """The weights (or LoRA adapters alone: the same choice every call) as one flat buffer
        generators read directly (RDMA, or Monarch's TCP fallback), from rank 0 (None elsewhere). The
        buffer is registered once and refilled in place by every call: the caller lets earlier reads
        finish first."""
        weights = self.core.weights(adapters_only=adapters_only)
        if self.rank != 0:
            return None
        if self._buffer is None:
            flat, layout = flatten_weights(weights, self.core.compute_dtype)
            self._buffer = (flat, RDMABuffer(flat), layout)
        else:
            refill_flat(self._buffer[0], self._buffer[2], weights)
        return self._buffer[1], self._buffer[2]

    @endpoint
    def policy_weights_file(self, path: str, adapters_only: bool = False) -> str | None:
        """Rank 0 writes the weights (or LoRA adapters alone) in the compute dtype as one safetensors
        file at `path` (atomically) and returns the path generators read; None on the other ranks."""
        weights = self.core.weights(self.core.compute_dtype, adapters_only)
        if self.rank != 0:
            return None
        save_weights_file(weights, Path(path))
        return path

    @endpoint
    def read_text(self, path: str) -> str | None:
        """A file's text as this process sees it (None when absent): the controller checks that
        the run directory is the same one here."""
        try:
            return Path(path).read_text()
        except FileNotFoundError:
            return None

    @endpoint
    def save_checkpoint(self, directory: str) -> None:
        """Snapshot the state; rank 0 writes it in the background (see `checkpoint_written`)."""
        self.core.save(directory, wait=False)

    @endpoint
    def checkpoint_written(self, wait: bool) -> bool:
        return self.core.checkpoint_written(wait)

    @endpoint
    def load_checkpoint(self, directory: str) -> None:
        self.core.load(directory)
