"""Per-token logprobs from last hidden states and the LM head, without a full N×V logits tensor.

The forward pass walks token chunks, keeping only each token's label logit and its
logsumexp; the backward pass recomputes one chunk's logits at a time and turns them into
the gradients of the hidden states and of the head in place. Peak extra memory is one
chunk × V instead of several N × V tensors (logits, log-softmax, their gradients).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from meshrl.models.routing import routed


def _matmul_dtype(hidden: Tensor) -> torch.dtype:
    """The dtype the head matmul runs in: autocast's when it is on (bf16 compute over fp32
    master weights), else the hidden states'. Backward runs outside autocast, so forward
    records it for backward to recompute the same logits."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int, temperature: float) -> Tensor:
        out = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        lse = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        dtype = _matmul_dtype(hidden)
        head = weight.to(dtype)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = (hidden[rows].to(dtype) @ head.T).float()
            if temperature != 1.0:
                logits.div_(temperature)
            lse[rows] = torch.logsumexp(logits, dim=-1)
            out[rows] = logits.gather(1, labels[rows, None]).squeeze(1) - lse[rows]
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk_size, ctx.temperature, ctx.dtype = chunk_size, temperature, dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        hidden, weight, labels, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        scale = grad_out.float() / ctx.temperature
        head = weight.to(ctx.dtype)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            chunk = hidden[rows].to(ctx.dtype)
            # d logprob / d logits = onehot(label) − softmax; scaled by the incoming gradient.
            grad_logits = (chunk @ head.T).float()
            if ctx.temperature != 1.0:
                grad_logits.div_(ctx.temperature)
            grad_logits.sub_(lse[rows, None]).exp_().mul_(-scale[rows, None])
            grad_logits.scatter_add_(1, labels[rows, None], scale[rows, None])
            grad_logits = grad_logits.to(ctx.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ head
            if grad_weight is not None:
                grad_weight.add_(grad_logits.T @ chunk)  # in the matmul dtype, accumulated in fp32
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_token_logprobs(
    hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int = 1024, temperature: float = 1.0
) -> Tensor:
    """log softmax(hidden @ weightᵀ / temperature)[label] for each row: (N, H), (V, H), (N,) → (N,) float32."""
    if hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"hidden has {hidden.shape[0]} rows but labels has {labels.shape[0]}")
    return _ChunkedTokenLogprobs.apply(hidden, weight, labels, chunk_size, temperature)


def naive_token_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """The reference path: materialise all logits, log-softmax, gather."""
    logits = (hidden @ weight.T).float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, labels[:, None]).squeeze(1)


# Config attributes of families whose logits are not hidden @ headᵀ: scoring them as if they were
# would give logprobs the model never samples from.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def lm_head_weight(model: nn.Module) -> Tensor:
    """The output-embedding matrix (V, H) of an HF causal LM.

    A head with a bias, and families that soft-cap or scale their logits (Gemma 2's
    final_logit_softcapping, Cohere's logit_scale, Granite's logits_scaling, ...), are refused by name.
    A head with LoRA adapters (peft's layer around it) is its base weight plus each active adapter's
    delta, so the adapters score and train as peft's forward uses them (without adapter dropout);
    its `.weight` alone is the base, which left a head's adapters out of the loss and untrained.
    """
    config = getattr(model, "config", None)
    for name in LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and value != 1:
            raise ValueError(
                f"{config.model_type} models transform their logits ({name} = {value}); "
                "chunked logprobs support plain hidden @ head logits"
            )
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("chunked logprobs support LM heads without a bias")
    adapters = getattr(head, "lora_A", None)
    if adapters is None or head.merged or head.disable_adapters:
        return head.weight
    return head.weight + sum(head.get_delta_weight(name) for name in head.active_adapters if name in adapters)


def hidden_states(
    model: nn.Module, input_ids: Tensor, routed_experts: Tensor | None = None, **forward_kwargs
) -> Tensor:
    """Last hidden states (B, T, H) of an HF causal LM's trunk (after its final norm).

    No KV cache: without one, HF builds a block-diagonal mask from packed position ids.
    `routed_experts` (B, T, layers, k): a mixture of experts' recorded routing of these tokens, which
    its routers take if the trainer replays routing (`models.routing`).
    """
    with routed(routed_experts):
        return model.get_decoder()(input_ids=input_ids, use_cache=False, **forward_kwargs).last_hidden_state


def sequence_token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    positions: Tensor | None = None,
    **forward_kwargs,
) -> Tensor:
    """Logprob of each token given its prefix, (B, T), aligned with `input_ids`; position 0 is 0.

    This is the alignment of inference logprobs (one per sampled token), so loss masks and
    sampler logprobs index the same positions. `positions` (B, T, bool) scores only those tokens
    (a loss mask) and leaves 0 elsewhere: the head's matmul over the vocabulary costs as much
    as several decoder layers per token, and prompt and tool-output tokens need none.
    """
    hidden = hidden_states(model, input_ids, **forward_kwargs)
    batch, length, width = hidden.shape
    head, labels = lm_head_weight(model), input_ids[:, 1:]
    if positions is None:
        flat = chunked_token_logprobs(
            hidden[:, :-1].reshape(-1, width), head, labels.reshape(-1), chunk_size, temperature
        )
        return torch.cat([flat.new_zeros(batch, 1), flat.view(batch, length - 1)], dim=1)
    take = positions[:, 1:].bool()
    scored = chunked_token_logprobs(hidden[:, :-1][take], head, labels[take], chunk_size, temperature)
    return scored.new_zeros(batch, length).masked_scatter(torch.cat([take.new_zeros(batch, 1), take], dim=1), scored)
