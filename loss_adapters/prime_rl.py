"""PRIME-RL's per-sample loss hook: `fn(inputs, **kwargs) -> LossOutputs`.

`loss_fn` with its default kwargs is PRIME-RL's default loss (DPPO binary-TV mask plus a
squared log-ratio KL to the inference policy), so it can be plugged into PRIME-RL as

    [trainer.loss]
    type = "custom"
    import_path = "meshrl.loss_adapters.prime_rl.loss_fn"

and meshrl's own trainer calls the same functions. Inputs are read by attribute, so
PRIME-RL's own `LossInputs` objects work unchanged (older ones call `ref_logprobs`
`teacher_logprobs`, and some have no `loss_weights`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class LossInputs:
    """One sample's 1-D per-token tensors, PRIME-RL's field names and order. The trainer scores only
    loss-mask tokens: `trainer_logprobs` (and `ref_logprobs`) hold 0 outside `loss_mask`."""

    trainer_logprobs: Tensor
    inference_logprobs: Tensor
    ref_logprobs: Tensor | None
    advantages: Tensor
    loss_mask: Tensor
    loss_weights: Tensor | None = field(default=None)


@dataclass
class LossOutputs:
    """A scalar loss (summed over the sample's tokens) and scalar metrics. A metric that is a mean
    over a subset of the loss-mask tokens (the masked ones, say) has that subset's token count in
    `counts`, so that the trainer's means over samples, micro-batches and ranks are over those
    tokens; any other is a mean over every loss-mask token. PRIME-RL reads `loss` and `metrics`."""

    loss: Tensor
    metrics: dict[str, Tensor]
    counts: dict[str, Tensor] = field(default_factory=dict)


LossFn = Callable[..., LossOutputs]


def _safe_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` over `mask`, 0 when the mask is empty (PRIME-RL's metric convention)."""
    return values[mask].sum() / torch.clamp_min(mask.sum(), 1)


def _outputs(loss: Tensor, metrics: dict[str, Tensor], over_subsets: dict[str, tuple[Tensor, Tensor]]) -> LossOutputs:
    """`metrics` (means over the loss mask) and, for each (values, subset) of `over_subsets`, the
    mean over that subset with its token count: an empty subset's 0 then weighs nothing."""
    means = {name: _safe_mean(values, subset) for name, (values, subset) in over_subsets.items()}
    counts = {name: subset.sum() for name, (_, subset) in over_subsets.items()}
    return LossOutputs(loss=loss, metrics={**metrics, **means}, counts=counts)


def _ref_logprobs(inputs: Any) -> Tensor | None:
    ref = getattr(inputs, "ref_logprobs", None)
    return ref if ref is not None else getattr(inputs, "teacher_logprobs", None)


def _ratio_terms(inputs: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """log r, r, mismatch KL (r − log r − 1) and Δp = p_train − p_inf, per token."""
    log_ratio = inputs.trainer_logprobs - inputs.inference_logprobs
    ratio = torch.exp(log_ratio)
    mismatch_kl = ratio - log_ratio - 1
    prob_diff = torch.exp(inputs.trainer_logprobs) - torch.exp(inputs.inference_logprobs)
    return log_ratio, ratio, mismatch_kl, prob_diff


def _policy_loss(inputs: Any, signal: Tensor, keep: Tensor, log_ratio: Tensor, ratio: Tensor, kl_tau: float) -> Tensor:
    """Σ_t [−keep·signal·r + kl_tau·mask·(log r)²]·w_t: the masked-ratio policy term plus KL."""
    per_token = -(keep * signal * ratio) + kl_tau * (inputs.loss_mask * log_ratio**2)
    weights = getattr(inputs, "loss_weights", None)
    if weights is not None:
        per_token = per_token * weights
    return per_token.sum()


def loss_fn(
    inputs: Any,
    dppo_mask_low: float = 0.2,
    dppo_mask_high: float = 0.2,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
) -> LossOutputs:
    """DPPO-clip + KL, PRIME-RL's default loss.

    The trust region is a mask on the probability change, conditioned on the advantage's
    sign: A>0 tokens whose probability rose by more than `dppo_mask_high`, and A≤0 tokens
    whose probability fell by more than `dppo_mask_low`, get no policy gradient. The KL
    term covers every loss-mask token, masked or not.
    """
    mask = inputs.loss_mask
    advantages = inputs.advantages
    log_ratio, ratio, mismatch_kl, prob_diff = _ratio_terms(inputs)
    too_high = prob_diff > dppo_mask_high
    too_low = prob_diff < -dppo_mask_low
    positive = advantages > 0
    negative = advantages < 0
    is_masked = torch.where(positive, too_high, too_low)
    dropped = mask & is_masked
    keep = mask & ~is_masked
    loss = _policy_loss(inputs, adv_tau * advantages, keep, log_ratio, ratio, kl_tau)
    metrics = {
        "is_masked": _safe_mean(is_masked, mask),
        "is_masked_low": _safe_mean(negative & too_low, mask),
        "is_masked_high": _safe_mean(positive & too_high, mask),
    }
    return _outputs(
        loss,
        metrics,
        {
            "masked_mismatch_kl": (mismatch_kl, dropped),
            "unmasked_mismatch_kl": (mismatch_kl, keep),
            "masked_advantage_positive": (positive, dropped),
            "masked_advantage_negative": (negative, dropped),
        },
    )


def ipo_loss_fn(inputs: Any, ipo_threshold: float = 0.1, adv_tau: float = 1.0, kl_tau: float = 1e-3) -> LossOutputs:
    """PRIME-RL's `ipo` loss: a symmetric trust region |Δp| > `ipo_threshold`, same PG + KL."""
    mask = inputs.loss_mask
    log_ratio, ratio, mismatch_kl, prob_diff = _ratio_terms(inputs)
    is_masked = torch.abs(prob_diff) > ipo_threshold
    keep = mask & ~is_masked
    loss = _policy_loss(inputs, adv_tau * inputs.advantages, keep, log_ratio, ratio, kl_tau)
    split = {"masked_mismatch_kl": (mismatch_kl, mask & is_masked), "unmasked_mismatch_kl": (mismatch_kl, keep)}
    return _outputs(loss, {"is_masked": _safe_mean(is_masked, mask)}, split)


def ref_kl_loss_fn(inputs: Any, mask_low: float = 0.2, kl_tau: float = 1e-3) -> LossOutputs:
    """PRIME-RL's `ref_kl` loss (on-policy distillation).

    The per-token signal is (ref − train).detach() instead of an advantage; tokens whose
    probability fell by more than `mask_low` are dropped. Metrics are namespaced `ref_kl/`.
    """
    ref = _ref_logprobs(inputs)
    if ref is None:
        raise ValueError("ref_kl loss needs ref_logprobs (a reference model's per-token logprobs)")
    mask = inputs.loss_mask
    log_ratio, ratio, mismatch_kl, prob_diff = _ratio_terms(inputs)
    is_masked = prob_diff < -mask_low
    keep = mask & ~is_masked
    ref_kl = ref - inputs.trainer_logprobs
    loss = _policy_loss(inputs, ref_kl.detach(), keep, log_ratio, ratio, kl_tau)
    metrics = {"ref_kl/is_masked": _safe_mean(is_masked, mask), "ref_kl": _safe_mean(ref_kl, mask)}
    split = {
        "ref_kl/masked_mismatch_kl": (mismatch_kl, mask & is_masked),
        "ref_kl/unmasked_mismatch_kl": (mismatch_kl, keep),
    }
    return _outputs(loss, metrics, split)
