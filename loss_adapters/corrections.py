"""Off-policy corrections for a sampler that is not the trainer: truncated (TIS) and masked (MIS)
importance sampling, at token or sequence level. PRIME-RL loss hooks, like `prime_rl.loss_fn`.

The importance weight of a token is w_t = π_train(t) / π_inf(t) with the trainer's probability
held constant (the policy before this step's update), so the gradient of a token is
−A_t · c_t · ∇log π_train(t), with c_t:

- TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
  training"): c = min(w, cap), the weight truncated from above;
- MIS (IcePop-style masking): c = w where low ≤ w ≤ high, else 0 (the token gets no gradient).

At sequence level the weight is the sample's: W = Π_t w_t over its loss-mask tokens, truncated
or masked as one. Both add PRIME-RL's KL to the inference policy, kl_tau · (log π_train/π_inf)²,
on every loss-mask token.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from meshrl.loss_adapters.prime_rl import LossOutputs, _ratio_terms, _safe_mean

Level = Literal["token", "sequence"]


def _weights(inputs: Any, level: Level) -> Tensor:
    """w per token: its own weight, or (sequence) the sample's product over the loss mask."""
    log_w = (inputs.trainer_logprobs.detach() - inputs.inference_logprobs) * inputs.loss_mask
    if level == "sequence":
        log_w = log_w.sum().expand_as(log_w)
    elif level != "token":
        raise ValueError(f"importance sampling level {level!r}: 'token' or 'sequence'")
    return torch.exp(log_w)


def _loss(inputs: Any, coefficient: Tensor, log_ratio: Tensor, adv_tau: float, kl_tau: float) -> Tensor:
    """Σ_t [−adv_tau·A_t·c_t·log π_train(t) + kl_tau·(log r_t)²]·loss_weight_t over the loss mask."""
    mask = inputs.loss_mask
    per_token = -(adv_tau * inputs.advantages * coefficient.detach() * inputs.trainer_logprobs) + kl_tau * log_ratio**2
    per_token = per_token * mask
    weights = getattr(inputs, "loss_weights", None)
    if weights is not None:
        per_token = per_token * weights
    return per_token.sum()


def _ratio_metrics(prefix: str, w: Tensor, mask: Tensor, mismatch_kl: Tensor) -> dict[str, Tensor]:
    return {
        f"{prefix}/ratio_mean": _safe_mean(w, mask),
        f"{prefix}/ratio_max": w.masked_fill(~mask, 0).max(),  # (w * mask) is NaN where w overflowed
        "mismatch_kl": _safe_mean(mismatch_kl, mask),
    }


def tis_loss_fn(
    inputs: Any, level: Level = "token", cap: float = 2.0, adv_tau: float = 1.0, kl_tau: float = 1e-3
) -> LossOutputs:
    """Truncated importance sampling: weights above `cap` count as `cap`."""
    mask = inputs.loss_mask
    log_ratio, _, mismatch_kl, _ = _ratio_terms(inputs)
    w = _weights(inputs, level)
    capped = w > cap
    loss = _loss(inputs, torch.clamp(w, max=cap), log_ratio, adv_tau, kl_tau)
    return LossOutputs(loss, {"tis/capped": _safe_mean(capped, mask), **_ratio_metrics("tis", w, mask, mismatch_kl)})


def mis_loss_fn(
    inputs: Any, level: Level = "token", low: float = 0.125, high: float = 8.0, adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
) -> LossOutputs:  # fmt: skip
    """Masked importance sampling: tokens (or the whole sample) whose weight is outside
    [`low`, `high`] get no policy gradient; the rest are weighted by w."""
    mask = inputs.loss_mask
    log_ratio, _, mismatch_kl, _ = _ratio_terms(inputs)
    w = _weights(inputs, level)
    too_low, too_high = w < low, w > high
    loss = _loss(inputs, torch.where(too_low | too_high, torch.zeros_like(w), w), log_ratio, adv_tau, kl_tau)
    metrics = {
        "mis/masked": _safe_mean(too_low | too_high, mask),
        "mis/masked_low": _safe_mean(too_low, mask),
        "mis/masked_high": _safe_mean(too_high, mask),
        **_ratio_metrics("mis", w, mask, mismatch_kl),
    }
    return LossOutputs(loss, metrics)
