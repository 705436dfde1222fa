"""How a trainer's weights reach generators other than as pickled tensors.

`generator.weight_sync = rdma`: Monarch's RDMABuffer takes one 1-D contiguous tensor, so the
state dict travels as one flat tensor of one dtype plus its layout: the dtype (a reader
allocates its buffer from it; a float32 buffer read from bf16 bytes is garbage) and a
`TensorSlot` per weight, in order.

`generator.weight_sync = filesystem`: one safetensors file per version, written atomically (a
reader never sees half a file), as PRIME-RL's trainer hands weights to its inference servers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file


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


def save_weights_file(weights: dict[str, torch.Tensor], path: Path) -> None:
    """The weights as one safetensors file at `path`, renamed in when complete. A tensor sharing
    storage with an earlier one (tied embeddings) is written once: generators load by name and
    their model ties it again."""
    seen: set[tuple[int, int]] = set()
    unique = {}
    for name, tensor in weights.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key not in seen:
            seen.add(key)
            unique[name] = tensor.contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    save_file(unique, str(partial))
    os.replace(partial, path)
