"""Sequence packing: tokenized samples into fixed-budget rows, as the trainer consumes them.

Rollouts (their sampled token ids) and collated traces (RL/SFT rows) both pack here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from meshrl.models.routing import unrecorded


@dataclass
class Encoded:
    """One tokenized sequence with its per-token masks."""

    ids: np.ndarray
    mask: np.ndarray  # bool: tokens in the loss (assistant turns / recovery turn / response)
    logprobs: np.ndarray | None = None
    routing: np.ndarray | None = (
        None  # a mixture of experts' routing of `ids`: (len(ids), layers, k) (`models.routing`)
    )


def pack_rows(rows: list[Encoded], values: Sequence[float], pack_tokens: int, pad_id: int) -> dict[str, torch.Tensor]:
    """First-fit-decreasing into rows of ≤ pack_tokens; position ids restart at each sample.

    `values` are per-sample advantages, broadcast over each sample's tokens; `sample_index`
    maps every token to its sample (−1 on padding). Rows that carry a mixture of experts' routing
    give `routed_experts` (rows, width, layers, k), unrecorded where they have none (padding, tokens
    after the record)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(rows)), key=lambda i: -rows[i].ids.size):
        size = rows[i].ids.size
        slot = next((b for b, free in enumerate(room) if free >= size), None)
        if slot is None:
            bins.append([i])
            room.append(pack_tokens - size)
        else:
            bins[slot].append(i)
            room[slot] -= size
    width = max(pack_tokens - free for free in room)
    out = {
        "input_ids": torch.full((len(bins), width), pad_id, dtype=torch.long),
        "position_ids": torch.zeros(len(bins), width, dtype=torch.long),
        "loss_mask": torch.zeros(len(bins), width, dtype=torch.bool),
        "advantages": torch.zeros(len(bins), width),
        "inference_logprobs": torch.zeros(len(bins), width),
        "sample_index": torch.full((len(bins), width), -1, dtype=torch.long),
    }
    routed = next((r.routing for r in rows if r.routing is not None), None)
    if routed is not None:
        out["routed_experts"] = torch.from_numpy(unrecorded((len(bins), width, *routed.shape[1:]), routed.dtype))
    for b, members in enumerate(bins):
        col = 0
        for i in members:
            r, n = rows[i], rows[i].ids.size
            cols = slice(col, col + n)
            out["input_ids"][b, cols] = torch.from_numpy(r.ids)
            out["position_ids"][b, cols] = torch.arange(n)
            out["loss_mask"][b, cols] = torch.from_numpy(r.mask)
            out["advantages"][b, cols] = values[i]
            out["sample_index"][b, cols] = i
            if r.logprobs is not None:
                out["inference_logprobs"][b, cols] = torch.from_numpy(r.logprobs)
            if r.routing is not None:
                out["routed_experts"][b, cols] = torch.from_numpy(r.routing)
            col += n
        out["position_ids"][b, col:] = torch.arange(width - col)  # padding: its own, loss-free sample
    return out
