"""Packed rows attended document by document.

The collator packs many samples into one row, position ids restarting at each (rollouts/packing.py).
transformers' SDPA path turns restarting position ids into a dense T×T block mask: memory quadratic
in the row's length, and SDPA off its flash kernel (a 64k row of 2k-token samples ran at a third of
one 64k sample's tokens/s on an H200). Here each document runs as its own causal SDPA call, so a
packed row costs O(tokens) memory and every call can take the flash kernel; a row with one document
is one call, exactly the unpacked path.

Registered with transformers as the attention implementation `meshrl_documents` (the trainer's
policy and reference models use it). Calls that carry a padding mask, or a KV cache, go to
transformers' own SDPA unchanged. A layer's sliding window (Mistral, Phi-3, Qwen2/3's windowed
layers, Gemma 2/3's local layers) is honoured within each document, as the sampler attends; the
variants that SDPA cannot compute (attention logit soft-capping, attention sinks, chunked
attention) are refused when the model is set up, naming the config key.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

DOCUMENTS = "meshrl_documents"
WINDOW_BLOCK = 512  # queries per SDPA call of a windowed document: keys and mask O(block × (block + window))
# Config keys of attention variants SDPA cannot compute; a model that sets one is refused.
UNSUPPORTED = {
    "attn_logit_softcapping": "soft-caps its attention logits",
    "attention_chunk_size": "attends in chunks",
}


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
    window = kwargs.get("sliding_window")
    rows = []
    for b, positions in enumerate(position_ids.expand(query.shape[0], -1)):
        parts = [
            causal_attention(
                query[b : b + 1, :, s:e], key[b : b + 1, :, s:e], value[b : b + 1, :, s:e], dropout, scaling, window
            )
            for s, e in document_spans(positions)
        ]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    out = rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous(), None


def causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float, scaling: float | None,
    window: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """One document's causal attention, (1, heads, length, head_dim); within `window` keys (each query
    sees itself and the window − 1 before it, transformers' sliding window) when the document is
    longer than that, in blocks of queries so the mask stays O(length × window)."""
    sdpa = partial(F.scaled_dot_product_attention, dropout_p=dropout, scale=scaling,
                   enable_gqa=query.shape[1] != key.shape[1])  # fmt: skip
    length = query.shape[2]
    if window is None or length <= window:
        return sdpa(query, key, value, is_causal=True)
    block, parts = max(window, WINDOW_BLOCK), []
    for start in range(0, length, block):
        end, first = min(start + block, length), max(0, start - window + 1)
        q = torch.arange(start, end, device=query.device)[:, None]
        k = torch.arange(first, end, device=query.device)[None, :]
        mask = (k <= q) & (k > q - window)
        parts.append(sdpa(query[:, :, start:end], key[:, :, first:end], value[:, :, first:end], attn_mask=mask))
    return torch.cat(parts, dim=2)


def _documents_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """No mask tensor for rows without padding (the documents come from the position ids); SDPA's
    mask where a padding mask is given, which `document_attention` hands to SDPA."""
    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def use_document_attention(model: nn.Module) -> None:
    """Make `model` (a transformers model) attend packed rows document by document; refuses a model
    whose attention SDPA cannot compute (scoring it as plain attention would not be its policy)."""
    config = model.config.get_text_config()
    refused = [f"{key} = {getattr(config, key)} ({why})" for key, why in UNSUPPORTED.items()
               if getattr(config, key, None) is not None]  # fmt: skip
    if any(isinstance(getattr(module, "sinks", None), nn.Parameter) for module in model.modules()):
        refused.append("attention sinks (a `sinks` parameter in its attention layers)")
    if refused:
        raise ValueError(f"model.path: a {config.model_type} model the trainer cannot score as it samples: "
                         f"{'; '.join(refused)}")  # fmt: skip
    AttentionInterface.register(DOCUMENTS, document_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(DOCUMENTS, _documents_mask)
    model.set_attn_implementation(DOCUMENTS)
