"""TIS and MIS off-policy corrections against a per-token reference of the published formulas,
in float64: the loss and its gradient with respect to the trainer's logprobs, and the metrics."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.configs import MisLoss, TisLoss
from meshrl.loss_adapters import LossInputs, mis_loss_fn, rl_loss_fn, tis_loss_fn

ADV_TAU, KL_TAU = 0.7, 0.01


def sample(seed: int, n: int = 12) -> LossInputs:
    g = torch.Generator().manual_seed(seed)
    inference = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    trainer = (inference + torch.randn(n, generator=g, dtype=torch.float64) * 0.8).requires_grad_()
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) > 0.2
    weights = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    return LossInputs(trainer, inference, None, advantages, mask, weights)


def reference(inputs: LossInputs, kind: str, level: str, cap: float = 2.0, low: float = 0.125, high: float = 8.0):
    """Loop over tokens: w_t = exp(lp_train − lp_inf) (sequence: Π over the mask), c_t = min(w, cap)
    (TIS) or w·1[low ≤ w ≤ high] (MIS); loss = Σ_mask [−adv_tau·A·c·lp_train + kl_tau·(lp_train − lp_inf)²]·weight;
    d loss / d lp_train(t) = [−adv_tau·A·c + 2·kl_tau·(lp_train − lp_inf)]·weight."""
    lp = inputs.trainer_logprobs.detach().tolist()
    inf, adv = inputs.inference_logprobs.tolist(), inputs.advantages.tolist()
    mask, weight = inputs.loss_mask.tolist(), inputs.loss_weights.tolist()
    token_w = [math.exp(a - b) for a, b in zip(lp, inf)]
    seq_w = math.exp(sum(a - b for a, b, m in zip(lp, inf, mask) if m))
    loss, grad, limited = 0.0, [0.0] * len(lp), []
    for t in range(len(lp)):
        if not mask[t]:
            continue
        w = token_w[t] if level == "token" else seq_w
        if kind == "tis":
            c, hit = min(w, cap), w > cap
        else:
            hit = not low <= w <= high
            c = 0.0 if hit else w
        limited.append(hit)
        loss += (-ADV_TAU * adv[t] * c * lp[t] + KL_TAU * (lp[t] - inf[t]) ** 2) * weight[t]
        grad[t] = (-ADV_TAU * adv[t] * c + 2 * KL_TAU * (lp[t] - inf[t])) * weight[t]
    return loss, grad, sum(limited) / len(limited)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("kind", ["tis", "mis"])
def test_the_correction_is_the_published_formula(kind, level):
    for seed in range(6):
        inputs = sample(seed)
        if kind == "tis":
            out = tis_loss_fn(inputs, level=level, cap=2.0, adv_tau=ADV_TAU, kl_tau=KL_TAU)
            limited = out.metrics["tis/capped"]
        else:  # bounds close to 1, so some tokens (and some samples) fall outside
            out = mis_loss_fn(inputs, level=level, low=0.5, high=2.0, adv_tau=ADV_TAU, kl_tau=KL_TAU)
            limited = out.metrics["mis/masked"]
        loss, grad, fraction = reference(inputs, kind, level, cap=2.0, low=0.5, high=2.0)
        (got,) = torch.autograd.grad(out.loss, inputs.trainer_logprobs)
        assert out.loss.item() == pytest.approx(loss, rel=1e-12, abs=1e-12)
        torch.testing.assert_close(got, torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=1e-12)
        assert limited.item() == pytest.approx(fraction)


def test_the_sample_set_exercises_both_sides_of_each_bound():
    """The reference test would pass vacuously if no weight were ever capped or masked."""
    fractions = {(kind, level): [reference(sample(s), kind, level, low=0.5, high=2.0)[2] for s in range(6)]
                 for kind in ("tis", "mis") for level in ("token", "sequence")}  # fmt: skip
    for key, values in fractions.items():
        assert 0 < sum(values) < len(values), key


def test_on_policy_the_corrections_are_the_plain_policy_gradient():
    inputs = sample(0)
    inputs.inference_logprobs = inputs.trainer_logprobs.detach().clone()
    plain = -(ADV_TAU * inputs.advantages * inputs.trainer_logprobs * inputs.loss_mask * inputs.loss_weights).sum()
    for fn in (tis_loss_fn, mis_loss_fn):
        for level in ("token", "sequence"):
            out = fn(inputs, level=level, adv_tau=ADV_TAU, kl_tau=KL_TAU)
            assert out.loss.item() == pytest.approx(plain.item(), rel=1e-12)
            assert out.metrics["mismatch_kl"].item() == 0


def test_configs_select_them_and_refuse_bad_bounds():
    inputs = sample(1)
    out = rl_loss_fn(TisLoss(level="sequence", cap=1.5))(inputs)
    assert out.loss.item() == pytest.approx(tis_loss_fn(inputs, level="sequence", cap=1.5).loss.item())
    assert "mis/masked_high" in rl_loss_fn(MisLoss())(inputs).metrics
    with pytest.raises(ValueError, match="must bracket 1"):
        MisLoss(low=2.0, high=8.0)


def test_an_overflowing_sequence_weight_is_reported_not_nan():
    inputs = sample(2, n=6)
    inputs.inference_logprobs = inputs.trainer_logprobs.detach() - 200.0  # W = e^(200·tokens): inf in float64
    out = tis_loss_fn(inputs, level="sequence")
    assert out.metrics["tis/ratio_max"].item() == math.inf and out.metrics["tis/capped"].item() == 1.0
    assert torch.isfinite(out.loss)
