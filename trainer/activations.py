"""Activation checkpointing: decoder layers recompute their activations in backward.

Without it a layer keeps every intermediate tensor of its forward until backward (about 2.2 MB a
token on Qwen3-0.6B in bf16), so memory grows with the trace and a 64k-token row does not fit
one GPU. A checkpointed layer keeps only its input and runs its forward again in backward
(PyTorch's non-reentrant `checkpoint`, through transformers' `GradientCheckpointingLayer` hook,
so FSDP2's unit hooks and autocast run inside the recompute as in the forward). `offload` also
moves those kept inputs to host memory (`save_on_cpu`, pinned on a GPU).

The recompute runs every forward hook a second time; `recomputing()` lets a hook that counts
(the MoE router statistics) tell the replay from the forward.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from meshrl.configs.schema import TrainerConfig

_state = threading.local()


def recomputing() -> bool:
    """True inside a checkpointed layer's recompute (in backward)."""
    return getattr(_state, "recomputing", False)


@contextmanager
def _recompute() -> Iterator[None]:
    previous, _state.recomputing = recomputing(), True
    try:
        yield
    finally:
        _state.recomputing = previous


def _contexts() -> tuple[Any, Any]:
    return nullcontext(), _recompute()


def _checkpoint(function: Callable, *args: Any, offload: bool, device_type: str) -> Any:
    with torch.autograd.graph.save_on_cpu(pin_memory=device_type == "cuda") if offload else nullcontext():
        return checkpoint(function, *args, use_reentrant=False, context_fn=_contexts)


def checkpointed_layers(config: TrainerConfig, count: int) -> list[bool]:
    """Which of `count` decoder layers recompute: none, all, or every `every`-th from the first."""
    mode = config.activation_checkpointing
    return [mode == "full" or (mode == "selective" and i % config.activation_checkpointing_every == 0)
            for i in range(count)]  # fmt: skip


def enable_checkpointing(model: nn.Module, config: TrainerConfig, device: torch.device) -> int:
    """Switch checkpointing on in `model`'s decoder layers as `config` says; the number switched on.

    Called before any wrapping (LoRA's adapters, FSDP2's `fully_shard`): the flag lives on the layer,
    so the wrappers' hooks run inside its checkpointed call."""
    if config.activation_checkpointing == "none":
        return 0
    layers = list(getattr(model.get_decoder(), "layers", []))
    if not layers or not all(isinstance(layer, GradientCheckpointingLayer) for layer in layers):
        raise ValueError(
            f"trainer.activation_checkpointing = {config.activation_checkpointing!r}: {type(model).__name__}'s "
            "decoder layers are not transformers GradientCheckpointingLayers"
        )
    function = partial(_checkpoint, offload=config.activation_offload, device_type=device.type)
    chosen = checkpointed_layers(config, len(layers))
    for layer, on in zip(layers, chosen, strict=True):
        layer.gradient_checkpointing = on
        layer._gradient_checkpointing_func = function
    return sum(chosen)
