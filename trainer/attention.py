"""Packed rows attended document by document, by one of three kernels.

The collator packs many samples into one row, position ids restarting at each (rollouts/packing.py).
transformers' SDPA path turns restarting position ids into a dense T×T block mask: memory quadratic
in the row's length, and SDPA off its flash kernel (a 64k row of 2k-token samples ran at a third of
one 64k sample's tokens/s on an H200). Here a row's documents never see each other, in O(tokens)
memory, through one of (`trainer.attention`):

- `sdpa`: one causal SDPA call per document (every call can take the flash kernel); any device.
- `varlen`: PyTorch's flash varlen kernel (`torch.nn.attention.varlen.varlen_attn`) over all the
  micro-batch's documents in one call; CUDA, bf16/fp16 only (a float32 call takes `sdpa`).
- `flex`: FlexAttention with a document block mask (compiled on CUDA); PyTorch has no CPU backward.

`auto` takes `varlen` on a CUDA device that has it, `flex` on other CUDA devices, `sdpa` elsewhere.
A micro-batch whose rows are one document each is one causal SDPA call on every kernel (flash).
The documents' bounds are found once per micro-batch (one host sync), not once per layer:
every layer gets the same position-ids tensor, and its `Documents` are kept beside it. Under
`trainer.compile` the attention call stays out of the layers' graphs (those bounds would specialise
a graph per packing).

Registered with transformers as the attention implementations `meshrl_documents[_flex|_varlen]` (the
trainer's policy and reference models use it). Calls that carry a padding mask, or a KV cache, go to
transformers' own SDPA unchanged. A layer's sliding window (Mistral, Phi-3, Qwen2/3's windowed
layers, Gemma 2/3's local layers) is honoured within each document by every kernel, as the sampler
attends; the variants none of them computes (attention logit soft-capping, attention sinks, chunked
attention) are refused when the model is set up, naming the config key.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import cache, cached_property, partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

Kernel = Literal["sdpa", "flex", "varlen"]
DOCUMENTS = "meshrl_documents"
# Each kernel's implementation name in transformers (a name holding "sdpa" would get transformers' SDPA checks).
NAMES: dict[str, str] = {"sdpa": DOCUMENTS, "flex": f"{DOCUMENTS}_flex", "varlen": f"{DOCUMENTS}_varlen"}
WINDOW_BLOCK = 512  # queries per SDPA call of a windowed document: keys and mask O(block × (block + window))
HALF = (torch.bfloat16, torch.float16)  # the dtypes flash kernels take
# Config keys of attention variants no kernel here computes; a model that sets one is refused.
UNSUPPORTED = {
    "attn_logit_softcapping": "soft-caps its attention logits",
    "attention_chunk_size": "attends in chunks",
}


@dataclass
class Documents:
    """One micro-batch's documents: the bounds every layer attends within. What one kernel alone
    reads (varlen's cumulative starts, FlexAttention's per-token index) is derived when it asks."""

    spans: list[list[tuple[int, int]]]  # [start, end) of each document, per row
    length: int  # tokens a row
    device: torch.device
    block_masks: dict[int | None, Any] = field(default_factory=dict)  # FlexAttention's, by window

    @property
    def one_each(self) -> bool:
        return all(len(row) == 1 for row in self.spans)

    @cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """int32 document starts over the rows laid end to end, then the total (varlen's layout)."""
        starts = [r * self.length + s for r, row in enumerate(self.spans) for s, _ in row]
        return torch.tensor([*starts, len(self.spans) * self.length], dtype=torch.int32, device=self.device)

    @cached_property
    def max_length(self) -> int:
        return max(e - s for row in self.spans for s, e in row)

    @cached_property
    def ids(self) -> torch.Tensor:
        """(rows, length) the document index of each token (FlexAttention's mask reads it)."""
        lengths = torch.tensor([e - s for row in self.spans for s, e in row], dtype=torch.long)
        rows = torch.tensor([i for row in self.spans for i in range(len(row))], dtype=torch.int32)
        return rows.repeat_interleave(lengths).view(len(self.spans), self.length).to(self.device)


_found: WeakIdKeyDictionary = WeakIdKeyDictionary()  # position ids → their Documents (one forward's layers)


def documents(position_ids: torch.Tensor, rows: int) -> Documents:
    """The documents of `rows` rows of these position ids (one row broadcast to all), found once and
    read back in one transfer: a new document wherever the position does not go up by 1."""
    found = _found.get(position_ids)
    if found is not None and len(found.spans) == rows:
        return found
    positions = position_ids.expand(rows, -1)
    length = positions.shape[1]
    bounds: list[list[int]] = [[0] for _ in range(rows)]
    for row, before in torch.nonzero(positions[:, 1:] != positions[:, :-1] + 1).tolist():
        bounds[row].append(before + 1)
    spans = [list(zip(row, [*row[1:], length])) for row in bounds]
    found = _found[position_ids] = Documents(spans, length, position_ids.device)
    return found


@torch.compiler.disable  # `trainer.compile`: its host-side bounds would specialise a layer's graph per packing
def document_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: torch.Tensor | None = None,
    kernel: Kernel = "sdpa",
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each document of each row; (batch, seq, heads, head_dim) out."""
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)  # fmt: skip
    window = kwargs.get("sliding_window")
    docs = documents(position_ids, query.shape[0])
    if dropout == 0.0 and not docs.one_each:
        if kernel == "varlen":
            query, key, value = _in_autocast_dtype(query, key, value)
        if kernel == "varlen" and query.dtype in HALF:
            return varlen_documents(query, key, value, docs, scaling, window), None
        if kernel == "flex":
            return flex_documents(query, key, value, docs, scaling, window), None
    rows = []
    for b, spans in enumerate(docs.spans):
        parts = [
            causal_attention(
                query[b : b + 1, :, s:e], key[b : b + 1, :, s:e], value[b : b + 1, :, s:e], dropout, scaling, window
            )
            for s, e in spans
        ]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    out = rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous(), None


def _in_autocast_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in autocast's dtype where it is on, as SDPA would take them: under autocast over
    float32 weights, RoPE's float32 tables leave the queries and keys float32 (the values bf16)."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) for t in tensors)


@cache
def _varlen() -> tuple[Any, set[str]]:
    """PyTorch's varlen kernel and the keyword arguments this version of it takes."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def varlen_available(device: torch.device) -> bool:
    """Whether `varlen` can run on `device`: CUDA, a PyTorch with the kernel, an Ampere or newer card."""
    if device.type != "cuda":
        return False
    try:
        _varlen()
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def varlen_documents(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, docs: Documents, scaling: float | None,
    window: int | None,
) -> torch.Tensor:  # fmt: skip
    """Every document of the micro-batch in one flash varlen call; (batch, seq, heads, head_dim) out.
    The kernel is causal only when told so by its window, (−1, 0): its default (−1, −1) attends both
    ways. A window of W keys is flash's (W − 1, 0): each query sees itself and the W − 1 before it."""
    kernel, takes = _varlen()
    batch, heads, length, width = query.shape
    flat = lambda t: t.transpose(1, 2).reshape(batch * length, t.shape[1], width)  # noqa: E731
    q, k, v = flat(query), flat(key), flat(value)
    extra: dict[str, Any] = {"scale": scaling}
    if key.shape[1] != heads:  # grouped-query attention: the kernel's own, else the heads repeated
        if "enable_gqa" in takes:
            extra["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(heads // key.shape[1], dim=1) for t in (k, v))
    if "window_size" in takes:
        extra["window_size"] = (-1, 0) if window is None else (window - 1, 0)
    elif "is_causal" in takes and window is None:  # an older signature: causal by flag, no windows
        extra["is_causal"] = True
    else:
        return flex_documents(query, key, value, docs, scaling, window)
    out = kernel(q, k, v, docs.cu_seqlens, docs.cu_seqlens, docs.max_length, docs.max_length, **extra)
    return out.view(batch, length, heads, width)


@cache
def _flex(device_type: str) -> tuple[Any, Any]:
    """FlexAttention and its block-mask builder: compiled on CUDA (eager materialises every score)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=True), partial(create_block_mask, _compile=True)
    return flex_attention, create_block_mask


def flex_documents(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, docs: Documents, scaling: float | None,
    window: int | None,
) -> torch.Tensor:  # fmt: skip
    """FlexAttention under a causal document mask (and window), built once per micro-batch and window."""
    attend, block_mask = _flex(query.device.type)
    mask = docs.block_masks.get(window)
    if mask is None:
        ids = docs.ids

        def within(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            seen = (ids[b, q] == ids[b, kv]) & (kv <= q)
            return seen if window is None else seen & (q - kv < window)

        batch, length = ids.shape
        mask = docs.block_masks[window] = block_mask(within, batch, None, length, length, device=query.device)
    out = attend(query, key, value, block_mask=mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous()


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


def attention_kernel(choice: Literal["auto", "sdpa", "flex", "varlen"], device: torch.device) -> Kernel:
    """The kernel `trainer.attention` names on `device`; `auto` picks the fastest there. A kernel the
    device cannot run is refused, naming the key."""
    if choice == "auto":
        return "sdpa" if device.type != "cuda" else "varlen" if varlen_available(device) else "flex"
    if choice == "varlen" and not varlen_available(device):
        raise ValueError(f"trainer.attention = 'varlen' needs a CUDA device of compute capability 8.0+ and a "
                         f"PyTorch with torch.nn.attention.varlen (this trainer runs on {device})")  # fmt: skip
    if choice == "flex" and device.type != "cuda":
        raise ValueError(f"trainer.attention = 'flex' needs a CUDA device: PyTorch's FlexAttention has no backward "
                         f"on {device.type} (use 'sdpa' or 'auto')")  # fmt: skip
    return choice


def use_document_attention(model: nn.Module, kernel: Kernel = "sdpa") -> None:
    """Make `model` (a transformers model) attend packed rows document by document through `kernel`;
    refuses a model whose attention none of the kernels computes (scoring it as plain attention would
    not be its policy)."""
    config = model.config.get_text_config()
    refused = [f"{key} = {getattr(config, key)} ({why})" for key, why in UNSUPPORTED.items()
               if getattr(config, key, None) is not None]  # fmt: skip
    if any(isinstance(getattr(module, "sinks", None), nn.Parameter) for module in model.modules()):
        refused.append("attention sinks (a `sinks` parameter in its attention layers)")
    if refused:
        raise ValueError(f"model.path: a {config.model_type} model the trainer cannot score as it samples: "
                         f"{'; '.join(refused)}")  # fmt: skip
    name = NAMES[kernel]
    AttentionInterface.register(name, partial(document_attention, kernel=kernel))
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, _documents_mask)
    model.set_attn_implementation(name)
