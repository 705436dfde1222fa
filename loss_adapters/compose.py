"""The composed loss the trainer calls on each micro-batch.

    total = (Σ_samples rl_fn(sample)) / (loss-mask tokens over all DP ranks)
            + β·replay(pairs) + α·SDPO(error sites)

A channel is off when its weight is 0 or the batch lacks its keys. Batch keys (tensors
are (B, T) and aligned with `input_ids`; logprobs at position t are of token t):

- RL: `input_ids`, `loss_mask`, `advantages`, `inference_logprobs`; optional
  `ref_logprobs`, `loss_weights`, `attention_mask`, and `position_ids` (packed rows:
  a sample starts wherever the position id is 0).
- Replay: `dpo_{chosen,rejected}_input_ids`, `dpo_{chosen,rejected}_response_mask`;
  optional `dpo_{chosen,rejected}_attention_mask` and precomputed reference sums
  `dpo_ref_{chosen,rejected}_logprob` (B,).
- SDPO: `sdpo_student_input_ids`, `sdpo_teacher_input_ids`, `sdpo_loss_mask` (1 on
  recovery tokens, −100 elsewhere; the same positions in both); optional
  `sdpo_{student,teacher}_attention_mask`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from meshrl.configs.imports import import_object
from meshrl.configs.schema import CustomLoss, DppoKlLoss, IpoLoss, LossConfig, MisLoss, RefKlLoss, TisLoss
from meshrl.loss_adapters.corrections import mis_loss_fn, tis_loss_fn
from meshrl.loss_adapters.logprobs import hidden_states, lm_head_weight, sequence_token_logprobs
from meshrl.loss_adapters.prime_rl import LossInputs, LossOutputs, ipo_loss_fn, loss_fn, ref_kl_loss_fn
from meshrl.loss_adapters.replay import replay_loss
from meshrl.loss_adapters.sdpo import generalized_jsd

RL_KEYS = ("input_ids", "loss_mask", "advantages", "inference_logprobs")
REPLAY_KEYS = (
    "dpo_chosen_input_ids",
    "dpo_chosen_response_mask",
    "dpo_rejected_input_ids",
    "dpo_rejected_response_mask",
)
SDPO_KEYS = ("sdpo_student_input_ids", "sdpo_teacher_input_ids", "sdpo_loss_mask")


def rl_loss_fn(config: LossConfig) -> Callable[[LossInputs], LossOutputs]:
    """The per-sample RL function a loss config selects, with its knobs bound."""
    if isinstance(config, DppoKlLoss):
        return partial(
            loss_fn,
            dppo_mask_low=config.dppo_mask_low,
            dppo_mask_high=config.dppo_mask_high,
            adv_tau=config.adv_tau,
            kl_tau=config.kl_tau,
        )
    if isinstance(config, IpoLoss):
        return partial(ipo_loss_fn, ipo_threshold=config.ipo_threshold, adv_tau=config.adv_tau, kl_tau=config.kl_tau)
    if isinstance(config, RefKlLoss):
        return partial(ref_kl_loss_fn, mask_low=config.mask_low, kl_tau=config.kl_tau)
    if isinstance(config, TisLoss):
        return partial(tis_loss_fn, level=config.level, cap=config.cap, adv_tau=config.adv_tau, kl_tau=config.kl_tau)
    if isinstance(config, MisLoss):
        return partial(mis_loss_fn, level=config.level, low=config.low, high=config.high, adv_tau=config.adv_tau,
                       kl_tau=config.kl_tau)  # fmt: skip
    if isinstance(config, CustomLoss):
        try:
            fn = import_object(config.import_path)
        except ValueError as exc:
            raise ValueError(f"loss.import_path: {exc}") from None
        if not callable(fn):
            raise ValueError(f"loss.import_path: {config.import_path!r} is not callable")
        return partial(fn, **config.kwargs)
    raise TypeError(f"unknown loss config {type(config).__name__}")


PEAK = "_max"  # a metric named so is a largest value: reduced by max, over samples, micro-batches and ranks


def _forward_kwargs(batch: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {k: batch[prefix + k] for k in ("attention_mask", "position_ids", "routed_experts") if prefix + k in batch}


def sample_spans(batch: dict[str, Tensor]) -> list[tuple[int, int, int]]:
    """(row, start, end) of every sample: one per row, or split where packed position ids restart at 0."""
    rows, length = batch["input_ids"].shape
    if "position_ids" not in batch:
        return [(r, 0, length) for r in range(rows)]
    spans = []
    for r in range(rows):
        starts = torch.nonzero(batch["position_ids"][r] == 0).flatten().tolist() or [0]
        starts = starts if starts[0] == 0 else [0, *starts]
        spans += [(r, s, e) for s, e in zip(starts, [*starts[1:], length])]
    return spans


def _rl_channel(
    model: nn.Module,
    batch: dict[str, Tensor],
    fn: Callable,
    token_count: Tensor | int | None,
    chunk_size: int,
    temperature: float,
) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """The RL loss, its metrics (means over the micro-batch's tokens) and the token count of each mean."""
    loss_mask = batch["loss_mask"].bool()
    logprobs = sequence_token_logprobs(
        model, batch["input_ids"], chunk_size, temperature, loss_mask, **_forward_kwargs(batch, "")
    )
    total = logprobs.sum() * 0.0  # keeps a graph even when every sample is empty
    per_metric: dict[str, list[tuple[Tensor, Tensor]]] = {}  # name -> (sample's mean, its token count)
    for row, start, end in sample_spans(batch):
        if not loss_mask[row, start:end].any():
            continue
        tokens = loss_mask[row, start:end].sum()
        take = lambda key: batch[key][row, start:end] if key in batch else None  # noqa: E731, B023 - called within this iteration only
        out = fn(
            LossInputs(
                trainer_logprobs=logprobs[row, start:end],
                inference_logprobs=take("inference_logprobs"),
                ref_logprobs=take("ref_logprobs"),
                advantages=take("advantages"),
                loss_mask=loss_mask[row, start:end],
                loss_weights=take("loss_weights"),
            )
        )
        total = total + out.loss
        counts = getattr(out, "counts", {})  # PRIME-RL's own LossOutputs has none
        for name, value in out.metrics.items():
            per_metric.setdefault(name, []).append((value.detach().float(), counts.get(name, tokens).float()))
    count = loss_mask.sum() if token_count is None else token_count
    metrics, counts = _token_means(per_metric)
    return total / torch.clamp_min(torch.as_tensor(count, dtype=total.dtype), 1), metrics, counts


def _token_means(per_metric: dict[str, list[tuple[Tensor, Tensor]]]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Per-sample means made means over all the samples' tokens, with those tokens' counts: a 2-token
    sample fully capped beside a 98-token one not capped is 2% capped, not 50%; and a fraction of
    the masked tokens is over the masked tokens alone (NaN where none was), not diluted by samples
    with none. A `PEAK` metric is the samples' largest, and has no count."""
    metrics, counts = {}, {}
    for name, parts in per_metric.items():
        values, weights = (torch.stack(column) for column in zip(*parts))
        if name.endswith(PEAK):
            metrics[name] = values.max()
        else:
            counts[name] = weights.sum()
            metrics[name] = (values * weights).sum() / counts[name]
    return metrics, counts


def reference_sums(ref_model: nn.Module, batch: dict[str, Tensor], chunk_size: int) -> dict[str, Tensor]:
    """The frozen reference's summed response logprobs of each pair side, under the keys
    (`dpo_ref_chosen_logprob`, `dpo_ref_rejected_logprob`) a batch may bring them in."""
    sums = {}
    with torch.no_grad():
        for side in ("chosen", "rejected"):
            ids, mask = batch[f"dpo_{side}_input_ids"], batch[f"dpo_{side}_response_mask"]
            ref = sequence_token_logprobs(
                ref_model, ids, chunk_size, 1.0, mask, **_forward_kwargs(batch, f"dpo_{side}_")
            )
            sums[f"dpo_ref_{side}_logprob"] = (ref * mask.to(ref.dtype)).sum(-1)
    return sums


def reference_logprobs(
    ref_model: nn.Module, batch: dict[str, Tensor], chunk_size: int, temperature: float
) -> dict[str, Tensor]:
    """The frozen reference's per-token logprobs of the RL rows, under the sampler's temperature as
    the policy's are scored, under the key (`ref_logprobs`) ref_kl reads."""
    with torch.no_grad():
        ref = sequence_token_logprobs(
            ref_model, batch["input_ids"], chunk_size, temperature, batch["loss_mask"], **_forward_kwargs(batch, "")
        )
    return {"ref_logprobs": ref}


def _replay_channel(
    model: nn.Module, batch: dict[str, Tensor], ref_model: nn.Module | None, config: LossConfig, chunk_size: int
) -> tuple[Tensor, dict[str, Tensor]]:
    channel = config.replay
    logprobs = {
        side: sequence_token_logprobs(
            model,
            batch[f"dpo_{side}_input_ids"],
            chunk_size,
            1.0,
            batch[f"dpo_{side}_response_mask"],
            **_forward_kwargs(batch, f"dpo_{side}_"),
        )
        for side in ("chosen", "rejected")
    }
    refs: dict[str, Tensor | None] = {side: batch.get(f"dpo_ref_{side}_logprob") for side in ("chosen", "rejected")}
    if channel.variant == "dpo" and ref_model is not None and any(ref is None for ref in refs.values()):
        sums = reference_sums(ref_model, batch, chunk_size)
        refs = {side: sums[f"dpo_ref_{side}_logprob"] for side in refs}
    out = replay_loss(
        logprobs["chosen"],
        batch["dpo_chosen_response_mask"],
        logprobs["rejected"],
        batch["dpo_rejected_response_mask"],
        variant=channel.variant,
        beta=channel.beta,
        gamma=channel.gamma,
        label_smoothing=channel.label_smoothing,
        rpo_alpha=channel.rpo_alpha,
        ref_chosen=refs["chosen"],
        ref_rejected=refs["rejected"],
    )
    return out.loss, out.metrics


def _at_least_fp32(logits: Tensor) -> Tensor:
    """bf16/fp16 logits upcast before a softmax over the vocabulary (too coarse otherwise)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def sdpo_targets(batch: dict[str, Tensor]) -> Tensor:
    """Where SDPO's loss lives: position t-1 of each row predicts recovery token t (B, T-1, bool)."""
    return batch["sdpo_loss_mask"][:, 1:] != -100


def _sdpo_channel(model: nn.Module, batch: dict[str, Tensor], config: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """JSD between hint-free (student) and hint-conditioned (teacher, no grad) next-token
    distributions, only at recovery tokens: logits exist for those N positions alone."""
    channel = config.sdpo
    rows, cols = torch.nonzero(sdpo_targets(batch), as_tuple=True)
    weight = lm_head_weight(model)
    student = hidden_states(model, batch["sdpo_student_input_ids"], **_forward_kwargs(batch, "sdpo_student_"))
    with torch.no_grad():
        teacher = hidden_states(model, batch["sdpo_teacher_input_ids"], **_forward_kwargs(batch, "sdpo_teacher_"))
        teacher_logits = _at_least_fp32(teacher[rows, cols] @ weight.T)
    student_logits = _at_least_fp32(student[rows, cols] @ weight.T)
    loss = generalized_jsd(
        student_logits[None],
        teacher_logits[None],
        labels=torch.ones(1, rows.numel(), dtype=torch.long, device=rows.device),
        beta=channel.jsd_beta,
        temperature=channel.temperature,
        token_clip=channel.token_clip,
    )
    return loss, {"sdpo/tokens": torch.tensor(float(rows.numel()))}


def compose_loss(
    model: nn.Module,
    batch: dict[str, Tensor],
    config: LossConfig,
    *,
    rl_fn: Callable[[LossInputs], LossOutputs] | None = None,
    rl_token_count: Tensor | int | None = None,
    ref_model: nn.Module | None = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
) -> LossOutputs:
    """Every live channel's loss on one micro-batch, summed with its weight.

    `rl_token_count` is the loss-mask token count summed over data-parallel ranks (the
    local count when None); `ref_model` is the frozen DPO reference when the batch brings
    no precomputed reference sums; `temperature` is the sampler's: the RL channel scores
    tokens under softmax(logits / temperature), the distribution their inference logprobs
    came from, so the importance ratio, the DPPO mask and the KL compare like with like.
    The RL metrics' `counts` are the tokens each is a mean over, for the trainer to reduce them.
    """
    metrics: dict[str, Tensor] = {}
    counts: dict[str, Tensor] = {}
    total: Tensor | None = None
    if all(k in batch for k in RL_KEYS):
        rl, rl_metrics, counts = _rl_channel(
            model, batch, rl_fn or rl_loss_fn(config), rl_token_count, chunk_size, temperature
        )
        total = rl
        metrics.update(rl_metrics)
        metrics["loss/rl"] = rl.detach()
    if config.replay.weight > 0 and all(k in batch for k in REPLAY_KEYS):
        replay, replay_metrics = _replay_channel(model, batch, ref_model, config, chunk_size)
        total = config.replay.weight * replay if total is None else total + config.replay.weight * replay
        metrics.update(replay_metrics)
        metrics["loss/replay"] = replay.detach()
    if config.sdpo.weight > 0 and all(k in batch for k in SDPO_KEYS) and sdpo_targets(batch).any():
        sdpo, sdpo_metrics = _sdpo_channel(model, batch, config)
        total = config.sdpo.weight * sdpo if total is None else total + config.sdpo.weight * sdpo
        metrics.update(sdpo_metrics)
        metrics["loss/sdpo"] = sdpo.detach()
    if total is None:
        raise ValueError(
            "no live loss channel: the batch lacks the RL keys "
            f"{RL_KEYS} and every other channel is off or has no inputs"
        )
    metrics["loss/total"] = total.detach()
    return LossOutputs(loss=total, metrics=metrics, counts=counts)
