"""The flat weight buffer a trainer publishes and generators read (`generator.weight_sync = rdma`).

Monarch's RDMABuffer takes one 1-D contiguous tensor, so the state dict travels as one flat
tensor of one dtype plus its layout: the dtype (a reader allocates its buffer from it; a
float32 buffer read from bf16 bytes is garbage) and a `TensorSlot` per weight, in order.
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


@dataclass(frozen=True)
class WeightLayout:
    """How to read a flat weight buffer: its element dtype and its slots in order."""

    dtype: torch.dtype
    slots: list[TensorSlot]

    def empty(self) -> torch.Tensor:
        """A local buffer the flat weights can be read into."""
        return torch.empty(sum(slot.numel for slot in self.slots), dtype=self.dtype)


def flatten_weights(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, WeightLayout]:
    """The weights as one flat tensor of `dtype` and its layout."""
    flat = torch.cat([t.flatten().to(dtype) for t in weights.values()])
    return flat, WeightLayout(dtype, [TensorSlot(name, tuple(t.shape), t.numel()) for name, t in weights.items()])


def refill_flat(flat: torch.Tensor, layout: WeightLayout, weights: dict[str, torch.Tensor]) -> None:
    """Overwrite a buffer `flatten_weights` made with new values of the same weights (a
    registered buffer is reused, not registered again)."""
    offset = 0
    for slot in layout.slots:
        flat[offset : offset + slot.numel].copy_(weights[slot.name].flatten())
        offset += slot.numel


def unflatten_weights(flat: torch.Tensor, layout: WeightLayout) -> dict[str, torch.Tensor]:
    """Views into `flat`, by name, as `flatten_weights` laid them out."""
    if flat.dtype != layout.dtype or flat.numel() != sum(slot.numel for slot in layout.slots):
        raise ValueError(f"a {flat.dtype} buffer of {flat.numel()} elements does not match its layout ({layout.dtype})")
    weights, offset = {}, 0
    for slot in layout.slots:
        weights[slot.name] = flat[offset : offset + slot.numel].view(slot.shape)
        offset += slot.numel
    return weights
