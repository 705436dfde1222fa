"""The flat weight buffer a trainer publishes and generators read (`generator.weight_sync = rdma`).

Monarch's RDMABuffer takes one 1-D contiguous tensor, so the state dict travels as one flat
tensor plus its layout: a `TensorSlot` per weight, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSlot:
    """Where one named weight lies in the flat buffer: the next `numel` elements, viewed as `shape`."""

    name: str
    shape: tuple[int, ...]
    numel: int


def flatten_weights(weights: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[TensorSlot]]:
    """The weights as one flat tensor and its layout."""
    flat = torch.cat([t.flatten() for t in weights.values()])
    return flat, [TensorSlot(name, tuple(t.shape), t.numel()) for name, t in weights.items()]


def unflatten_weights(flat: torch.Tensor, layout: list[TensorSlot]) -> dict[str, torch.Tensor]:
    """Views into `flat`, by name, as `flatten_weights` laid them out."""
    weights, offset = {}, 0
    for slot in layout:
        weights[slot.name] = flat[offset : offset + slot.numel].view(slot.shape)
        offset += slot.numel
    return weights
