"""Activation checkpointing: decoder layers recompute their activations in backward.

Without it a layer keeps every intermediate tensor of its forward until backward (about 2.2 MB a
token on Qwen3-0.6B in bf16), so memory grows with the trace and a 64k-token row does not fit
one GPU. A `full` checkpointed layer keeps only its input and runs its whole forward again in
backward (PyTorch's non-reentrant `checkpoint`, through transformers' `GradientCheckpointingLayer`
hook, so FSDP2's unit hooks and autocast run inside the recompute as in the forward). A `selective`
one (op-level, PyTorch's selective checkpoint contexts, as torchtitan's "op" policy) also keeps the
attention kernel's output and every other matmul's, so backward recomputes only half the matmuls
and the cheap elementwise ops: keeping every matmul's output would cost ~45 GB at 64k tokens of
Qwen3-0.6B, half of them ~20 GB. `offload` moves the kept layer inputs to host memory (`save_on_cpu`,
pinned on a GPU); the outputs `selective` keeps stay on the device.

The recompute runs every forward hook a second time; `recomputing()` lets a hook that counts
(the MoE router statistics) tell the replay from the forward, and it runs under the recorded MoE
routing its forward had (`models.routing`), so a replayed router chooses the same experts again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from transformers.modeling_layers import GradientCheckpointingLayer

from meshrl.configs.schema import TrainerConfig
from meshrl.models.routing import current_routing, routed_flat

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


aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten._grouped_mm.default}
# Attention kernels' outputs: the costliest op of a long row, always kept by `selective`.
ATTENTION = {aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
             aten._scaled_dot_product_cudnn_attention.default, aten._flash_attention_forward.default,
             aten._scaled_dot_product_flash_attention_for_cpu.default}  # fmt: skip
if hasattr(torch.ops.higher_order, "flex_attention"):
    ATTENTION.add(torch.ops.higher_order.flex_attention)
try:  # PyTorch's varlen kernel (trainer/attention.py) registers its op on import
    import torch.nn.attention.varlen

    ATTENTION.add(torch.ops.torch_attn._varlen_attn.default)
except (ImportError, AttributeError):
    pass


def _keep_every_other_matmul() -> Callable[..., CheckpointPolicy]:
    """One checkpointed call's policy: keep the attention kernels' outputs and the 1st, 3rd, ...
    matmul's; recompute the rest. Forward and recompute count their matmuls apart, so both phases
    make the same choice for the same op."""
    seen = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in MATMULS:
            seen[ctx.is_recompute] += 1
            keep = seen[ctx.is_recompute] % 2 == 1
        else:
            keep = op in ATTENTION
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@contextmanager
def _recomputing(cached: Any, routing: torch.Tensor | None) -> Iterator[None]:
    """A recompute: the selective policy's cached outputs, if any, and the routing the forward had."""
    with cached, _recompute(), routed_flat(routing):
        yield


def _contexts(selective: bool) -> tuple[Any, Any]:
    """Called in the forward: the contexts of the forward and of its recompute in backward, which runs
    outside the forward's own (a mixture of experts' recorded routing is captured here for it)."""
    if not selective:
        return nullcontext(), _recomputing(nullcontext(), current_routing())
    caching, cached = create_selective_checkpoint_contexts(_keep_every_other_matmul())
    return caching, _recomputing(cached, current_routing())


def _checkpoint(function: Callable, *args: Any, offload: bool, selective: bool, device_type: str) -> Any:
    with torch.autograd.graph.save_on_cpu(pin_memory=device_type == "cuda") if offload else nullcontext():
        return checkpoint(function, *args, use_reentrant=False, context_fn=partial(_contexts, selective))


def checkpointed_layers(config: TrainerConfig, count: int) -> list[bool]:
    """Which of `count` decoder layers recompute: none, or every `every`-th from the first."""
    on = config.activation_checkpointing != "none"
    return [on and i % config.activation_checkpointing_every == 0 for i in range(count)]


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
    function = partial(_checkpoint, offload=config.activation_offload,
                       selective=config.activation_checkpointing == "selective", device_type=device.type)  # fmt: skip
    chosen = checkpointed_layers(config, len(layers))
    for layer, on in zip(layers, chosen, strict=True):
        layer.gradient_checkpointing = on
        layer._gradient_checkpointing_func = function
    return sum(chosen)
