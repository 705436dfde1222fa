"""Replay channel: pairwise preference losses on (chosen, rejected) pairs.

Pairs are mined from teacher disagreement with the student (chosen = the teachers'
consensus action, rejected = the student's). Both losses read per-token logprobs of the
two responses plus their response masks; DPO also needs a frozen or precomputed
reference's summed logprobs, SimPO needs none.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from meshrl.loss_adapters.prime_rl import LossOutputs


def sequence_logprob(token_logprobs: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Summed response logprob per sequence and the response length: (B, T) → (B,), (B,)."""
    mask = response_mask.to(token_logprobs.dtype)
    return (token_logprobs * mask).sum(-1), mask.sum(-1)


def dpo_loss(
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> LossOutputs:
    """−log σ(β[(π_c − ref_c) − (π_r − ref_r)]) on summed response logprobs, mean over pairs.

    `label_smoothing` ε > 0 is conservative DPO: (1−ε)·that − ε·log σ(−β·margin).
    """
    chosen_reward = beta * (chosen - ref_chosen)
    rejected_reward = beta * (rejected - ref_rejected)
    logits = chosen_reward - rejected_reward
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return LossOutputs(loss=losses.mean(), metrics=_pair_metrics(chosen_reward, rejected_reward))


def simpo_loss(
    chosen: Tensor,
    rejected: Tensor,
    chosen_len: Tensor,
    rejected_len: Tensor,
    beta: float = 2.0,
    gamma: float = 1.0,
) -> LossOutputs:
    """−log σ(β/|y|-normalized logprob difference − γ): length-normalized, no reference."""
    chosen_reward = beta * chosen / chosen_len.clamp_min(1)
    rejected_reward = beta * rejected / rejected_len.clamp_min(1)
    losses = -F.logsigmoid(chosen_reward - rejected_reward - gamma)
    return LossOutputs(loss=losses.mean(), metrics=_pair_metrics(chosen_reward, rejected_reward))


def _pair_metrics(chosen_reward: Tensor, rejected_reward: Tensor) -> dict[str, Tensor]:
    chosen_reward, rejected_reward = chosen_reward.detach(), rejected_reward.detach()
    return {
        "replay/reward_chosen": chosen_reward.mean(),
        "replay/reward_rejected": rejected_reward.mean(),
        "replay/margin": (chosen_reward - rejected_reward).mean(),
        "replay/accuracy": (chosen_reward > rejected_reward).to(chosen_reward.dtype).mean(),
    }


def replay_loss(
    chosen_logprobs: Tensor,
    chosen_mask: Tensor,
    rejected_logprobs: Tensor,
    rejected_mask: Tensor,
    *,
    variant: str = "dpo",
    beta: float = 0.1,
    gamma: float = 1.0,
    label_smoothing: float = 0.0,
    rpo_alpha: float = 0.0,
    ref_chosen: Tensor | None = None,
    ref_rejected: Tensor | None = None,
) -> LossOutputs:
    """The replay channel from per-token logprobs (B, T) and response masks.

    `ref_chosen` / `ref_rejected` are the reference's *summed* response logprobs (B,),
    precomputed or from a frozen model; DPO refuses to run without them. `rpo_alpha` > 0
    adds α·(mean per-token NLL of the chosen responses), RPO's (and TRL's `rpo_alpha`)
    guard against the pairwise loss pushing the chosen response down along with the rejected.
    """
    chosen, chosen_len = sequence_logprob(chosen_logprobs, chosen_mask)
    rejected, rejected_len = sequence_logprob(rejected_logprobs, rejected_mask)
    if variant == "simpo":
        out = simpo_loss(chosen, rejected, chosen_len, rejected_len, beta=beta, gamma=gamma)
    elif variant != "dpo":
        raise ValueError(f"unknown replay variant {variant!r} (expected 'dpo' or 'simpo')")
    elif ref_chosen is None or ref_rejected is None:
        raise ValueError("DPO needs reference logprobs for both responses (or use variant 'simpo')")
    else:
        out = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=beta, label_smoothing=label_smoothing)
    nll = -(chosen / chosen_len.clamp_min(1)).mean()
    out.metrics["replay/chosen_nll"] = nll.detach()
    return LossOutputs(loss=out.loss + rpo_alpha * nll, metrics=out.metrics) if rpo_alpha > 0 else out
