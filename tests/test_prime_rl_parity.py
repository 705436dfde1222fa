"""The PRIME-RL hook against an independent per-token reference written from the spec.

The reference walks tokens with Python floats and writes the gradient by hand, so it
shares no code (and no vectorised formulation) with the adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.loss_adapters.prime_rl import LossInputs, ipo_loss_fn, loss_fn, ref_kl_loss_fn

DEFAULT_METRICS = {
    "masked_mismatch_kl",
    "unmasked_mismatch_kl",
    "is_masked",
    "is_masked_low",
    "is_masked_high",
    "masked_advantage_positive",
    "masked_advantage_negative",
}


def _mean(values: list[float], flags: list[bool]) -> float:
    picked = [v for v, f in zip(values, flags) if f]
    return sum(picked) / max(len(picked), 1)


def reference(case: dict, rule: str, **kw) -> tuple[float, list[float], dict[str, float]]:
    """Loss, d loss / d trainer_logprobs, metrics — one token at a time."""
    n = len(case["train"])
    weights = case["weights"] or [1.0] * n
    loss, grad, kls, masked, low_flags, high_flags = 0.0, [], [], [], [], []
    for t in range(n):
        lt, li, a, m, w = case["train"][t], case["inf"][t], case["adv"][t], case["mask"][t], weights[t]
        r = math.exp(lt - li)
        dp = math.exp(lt) - math.exp(li)
        if rule == "dppo":
            signal = kw["adv_tau"] * a
            is_masked = dp > kw["high"] if a > 0 else dp < -kw["low"]
            low_flags.append(a < 0 and dp < -kw["low"])
            high_flags.append(a > 0 and dp > kw["high"])
        elif rule == "ipo":
            signal = kw["adv_tau"] * a
            is_masked = abs(dp) > kw["threshold"]
        else:  # ref_kl
            signal = case["ref"][t] - lt
            is_masked = dp < -kw["low"]
        keep = m and not is_masked
        loss += (-(signal * r if keep else 0.0) + (kw["kl_tau"] * (lt - li) ** 2 if m else 0.0)) * w
        grad.append((-(signal * r if keep else 0.0) + (2 * kw["kl_tau"] * (lt - li) if m else 0.0)) * w)
        kls.append(r - (lt - li) - 1)
        masked.append(is_masked)
    mask = case["mask"]
    dropped = [m and x for m, x in zip(mask, masked)]
    kept = [m and not x for m, x in zip(mask, masked)]
    metrics = {
        "masked_mismatch_kl": _mean(kls, dropped),
        "unmasked_mismatch_kl": _mean(kls, kept),
        "is_masked": _mean([float(x) for x in masked], mask),
    }
    if rule == "dppo":
        metrics["is_masked_low"] = _mean([float(x) for x in low_flags], mask)
        metrics["is_masked_high"] = _mean([float(x) for x in high_flags], mask)
        metrics["masked_advantage_positive"] = _mean([float(a > 0) for a in case["adv"]], dropped)
        metrics["masked_advantage_negative"] = _mean([float(a < 0) for a in case["adv"]], dropped)
    if rule == "ref_kl":
        metrics = {f"ref_kl/{k}": v for k, v in metrics.items()}
        metrics["ref_kl"] = _mean([case["ref"][t] - case["train"][t] for t in range(n)], mask)
    return loss, grad, metrics


@st.composite
def cases(draw, with_ref: bool = False) -> dict:
    n = draw(st.integers(1, 24))
    logprob = st.floats(-6.0, -1e-3, allow_nan=False)
    drift = st.floats(-2.0, 2.0, allow_nan=False)
    train = draw(st.lists(logprob, min_size=n, max_size=n))
    # inference logprobs near the trainer's so that some tokens pass the mask and some do not
    inf = [min(-1e-4, lt + d) for lt, d in zip(train, draw(st.lists(drift, min_size=n, max_size=n)))]
    adv = draw(st.lists(st.sampled_from([0.0, 1.0, -1.0, 0.37, -2.5]) | st.floats(-3, 3), min_size=n, max_size=n))
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    weights = draw(st.none() | st.lists(st.floats(0.0, 2.0), min_size=n, max_size=n))
    ref = draw(st.lists(logprob, min_size=n, max_size=n)) if with_ref else None
    return {"train": train, "inf": inf, "adv": adv, "mask": mask, "weights": weights, "ref": ref}


def _inputs(case: dict) -> LossInputs:
    f64 = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    return LossInputs(
        trainer_logprobs=f64(case["train"]).requires_grad_(),
        inference_logprobs=f64(case["inf"]),
        ref_logprobs=None if case["ref"] is None else f64(case["ref"]),
        advantages=f64(case["adv"]),
        loss_mask=torch.tensor(case["mask"], dtype=torch.bool),
        loss_weights=None if case["weights"] is None else f64(case["weights"]),
    )


def _check(out, inputs: LossInputs, ref_loss: float, ref_grad: list[float], ref_metrics: dict[str, float]) -> None:
    assert out.loss.dtype == torch.float64 and out.loss.dim() == 0
    assert out.loss.item() == pytest.approx(ref_loss, abs=1e-9, rel=1e-9)
    (grad,) = torch.autograd.grad(out.loss, inputs.trainer_logprobs, allow_unused=True)
    grad = torch.zeros_like(inputs.trainer_logprobs) if grad is None else grad
    assert grad.tolist() == pytest.approx(ref_grad, abs=1e-9, rel=1e-9)
    assert set(out.metrics) == set(ref_metrics)
    for name, value in ref_metrics.items():
        # fractions of booleans are float32 in PRIME-RL too; divergences stay float64
        tol = 1e-6 if out.metrics[name].dtype == torch.float32 else 1e-9
        assert out.metrics[name].item() == pytest.approx(value, abs=tol), name


@settings(max_examples=300, deadline=None)
@given(cases(), st.sampled_from([(0.2, 0.2, 1.0, 1e-3), (0.05, 0.3, 0.5, 0.1), (0.0, 0.0, 2.0, 0.0)]))
def test_default_loss_matches_reference(case, knobs):
    low, high, adv_tau, kl_tau = knobs
    inputs = _inputs(case)
    out = loss_fn(inputs, dppo_mask_low=low, dppo_mask_high=high, adv_tau=adv_tau, kl_tau=kl_tau)
    _check(out, inputs, *reference(case, "dppo", low=low, high=high, adv_tau=adv_tau, kl_tau=kl_tau))
    assert set(out.metrics) == DEFAULT_METRICS


@settings(max_examples=150, deadline=None)
@given(cases(), st.sampled_from([0.1, 0.02, 0.5]))
def test_ipo_loss_matches_reference(case, threshold):
    inputs = _inputs(case)
    out = ipo_loss_fn(inputs, ipo_threshold=threshold)
    _check(out, inputs, *reference(case, "ipo", threshold=threshold, adv_tau=1.0, kl_tau=1e-3))


@settings(max_examples=150, deadline=None)
@given(cases(with_ref=True))
def test_ref_kl_loss_matches_reference(case):
    inputs = _inputs(case)
    out = ref_kl_loss_fn(inputs)
    _check(out, inputs, *reference(case, "ref_kl", low=0.2, kl_tau=1e-3))


def test_hand_computed_case():
    """Three tokens worked out on paper: one kept, one masked high (A>0), one outside the mask."""
    lt = [math.log(0.5), math.log(0.9), math.log(0.3)]
    li = [math.log(0.4), math.log(0.6), math.log(0.3)]
    inputs = _inputs(
        {"train": lt, "inf": li, "adv": [1.0, 1.0, -1.0], "mask": [True, True, False], "weights": None, "ref": None}
    )
    out = loss_fn(inputs)
    # token 0: Δp = 0.1 ≤ 0.2 kept: −1·(0.5/0.4) + 1e-3·log(1.25)²; token 1: Δp = 0.3 > 0.2 masked: KL only
    expected = -1.25 + 1e-3 * math.log(1.25) ** 2 + 1e-3 * math.log(1.5) ** 2
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    assert out.metrics["is_masked"].item() == pytest.approx(0.5)
    assert out.metrics["is_masked_high"].item() == pytest.approx(0.5)
    assert out.metrics["is_masked_low"].item() == 0.0
    assert out.metrics["masked_advantage_positive"].item() == 1.0
    assert out.metrics["masked_mismatch_kl"].item() == pytest.approx(1.5 - math.log(1.5) - 1, abs=1e-12)


def test_zero_advantage_uses_the_low_side_of_the_mask():
    """A = 0 counts as 'not positive': masked when its probability fell by more than `low`."""
    inputs = _inputs(
        {"train": [math.log(0.1)], "inf": [math.log(0.5)], "adv": [0.0], "mask": [True], "weights": None, "ref": None}
    )
    out = loss_fn(inputs)
    assert out.metrics["is_masked"].item() == 1.0
    assert out.metrics["is_masked_low"].item() == 0.0  # the low-side counter only counts A < 0
    assert out.metrics["masked_advantage_negative"].item() == 0.0


def test_all_masked_sample_has_zero_loss_and_a_graph():
    inputs = _inputs({"train": [-1.0, -2.0], "inf": [-1.5, -0.5], "adv": [1.0, -1.0], "mask": [False, False],
                      "weights": None, "ref": None})  # fmt: skip
    out = loss_fn(inputs)
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert torch.equal(inputs.trainer_logprobs.grad, torch.zeros(2, dtype=torch.float64))
    assert all(v.item() == 0.0 for v in out.metrics.values())


@dataclass
class OldPrimeRLInputs:
    """PRIME-RL before the rename: `teacher_logprobs`, no `loss_weights` field."""

    trainer_logprobs: torch.Tensor
    inference_logprobs: torch.Tensor
    teacher_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    loss_mask: torch.Tensor


def test_foreign_inputs_are_read_by_attribute():
    case = {"train": [-0.5, -1.0, -2.0], "inf": [-0.6, -0.9, -2.5], "adv": [1.0, -1.0, 0.5], "mask": [True] * 3,
            "weights": None, "ref": [-0.4, -1.2, -1.9]}  # fmt: skip
    ours = _inputs(case)
    old = OldPrimeRLInputs(ours.trainer_logprobs, ours.inference_logprobs, ours.ref_logprobs, ours.advantages,
                           ours.loss_mask)  # fmt: skip
    assert torch.equal(loss_fn(old).loss, loss_fn(ours).loss)
    assert torch.equal(ref_kl_loss_fn(old).loss, ref_kl_loss_fn(ours).loss)


def test_ref_kl_without_reference_is_a_clear_error():
    inputs = _inputs({"train": [-1.0], "inf": [-1.0], "adv": [1.0], "mask": [True], "weights": None, "ref": None})
    with pytest.raises(ValueError, match="ref_logprobs"):
        ref_kl_loss_fn(inputs)
