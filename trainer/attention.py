"""Packed rows attended document by document.

The collator packs many samples into one row, position ids restarting at each (rollouts/packing.py).
transformers' SDPA path turns restarting position ids into a dense T×T block mask: memory quadratic
in the row's length, and SDPA off its flash kernel (a 64k row of 2k-token samples ran at a third of
one 64k sample's tokens/s on an H200). Here each document runs as its own causal SDPA call, so a
packed row costs O(tokens) memory and every call can take the flash kernel; a row with one document
is one call, exactly the unpacked path.

Registered with transformers as the attention implementation `meshrl_documents` (the trainer's
policy and reference models use it). Calls that carry a padding mask, or a KV cache, go to
transformers' own SDPA unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

DOCUMENTS = "meshrl_documents"


def document_spans(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each document in one row: a new one wherever the position does not go up by 1."""
    starts = torch.nonzero(position_ids[1:] != position_ids[:-1] + 1).flatten() + 1
    bounds = [0, *starts.tolist(), position_ids.numel()]
    return list(zip(bounds[:-1], bounds[1:]))


def document_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each document of each row; (batch, seq, heads, head_dim) out."""
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)  # fmt: skip
    gqa = query.shape[1] != key.shape[1]
    rows = []
    for b, positions in enumerate(position_ids.expand(query.shape[0], -1)):
        parts = [
            F.scaled_dot_product_attention(
                query[b : b + 1, :, s:e],
                key[b : b + 1, :, s:e],
                value[b : b + 1, :, s:e],
                dropout_p=dropout,
                is_causal=True,
                scale=scaling,
                enable_gqa=gqa,
            )  # fmt: skip
            for s, e in document_spans(positions)
        ]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    out = rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous(), None


def _documents_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """No mask tensor for rows without padding (the documents come from the position ids); SDPA's
    mask where a padding mask is given, which `document_attention` hands to SDPA."""
    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def use_document_attention(model: nn.Module) -> None:
    """Make `model` (a transformers model) attend packed rows document by document."""
    AttentionInterface.register(DOCUMENTS, document_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(DOCUMENTS, _documents_mask)
    model.set_attn_implementation(DOCUMENTS)
