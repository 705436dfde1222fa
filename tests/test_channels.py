"""Replay (DPO / SimPO) and SDPO (generalized JSD) channels against formulas written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.loss_adapters.replay import dpo_loss, replay_loss, simpo_loss
from meshrl.loss_adapters.sdpo import generalized_jsd


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_dpo_matches_formula_and_prefers_the_chosen_response():
    chosen = torch.tensor([-10.0, -4.0], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([-12.0, -3.0], dtype=torch.float64, requires_grad=True)
    ref_c = torch.tensor([-11.0, -4.5], dtype=torch.float64)
    ref_r = torch.tensor([-11.5, -3.5], dtype=torch.float64)
    out = dpo_loss(chosen, rejected, ref_c, ref_r, beta=0.5)
    margins = [0.5 * ((-10 + 11) - (-12 + 11.5)), 0.5 * ((-4 + 4.5) - (-3 + 3.5))]
    assert out.loss.item() == pytest.approx(sum(-_log_sigmoid(m) for m in margins) / 2, abs=1e-12)
    assert out.metrics["replay/accuracy"].item() == pytest.approx(0.5)
    assert out.metrics["replay/margin"].item() == pytest.approx(sum(margins) / 2, abs=1e-12)
    out.loss.backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()  # descent raises chosen, lowers rejected


def test_conservative_dpo_label_smoothing():
    c, r, z = torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([0.0])
    out = dpo_loss(c, r, z, z, beta=1.0, label_smoothing=0.2)
    assert out.loss.item() == pytest.approx(-0.8 * _log_sigmoid(1.0) - 0.2 * _log_sigmoid(-1.0), abs=1e-6)


@pytest.mark.parametrize("variant", ["dpo", "simpo"])
def test_rpo_alpha_adds_the_chosen_mean_token_nll(variant):
    chosen = torch.tensor([[-1.0, -3.0, -9.0]], requires_grad=True)
    rejected = torch.tensor([[-2.0, -2.0, -2.0]])
    mask = torch.tensor([[True, True, False]])
    ref = {"ref_chosen": torch.tensor([-4.0]), "ref_rejected": torch.tensor([-4.0])} if variant == "dpo" else {}
    plain = replay_loss(chosen, mask, rejected, mask, variant=variant, **ref)
    rpo = replay_loss(chosen, mask, rejected, mask, variant=variant, rpo_alpha=0.5, **ref)
    assert rpo.metrics["replay/chosen_nll"].item() == pytest.approx(2.0)  # (1 + 3) / 2 response tokens
    assert rpo.loss.item() == pytest.approx(plain.loss.item() + 0.5 * 2.0)
    rpo.loss.backward()
    assert chosen.grad[0, 2] == 0  # the prompt token gets nothing


def test_simpo_is_length_normalised_with_margin():
    out = simpo_loss(torch.tensor([-6.0]), torch.tensor([-6.0]), torch.tensor([3.0]), torch.tensor([2.0]),
                     beta=2.0, gamma=0.5)  # fmt: skip
    assert out.loss.item() == pytest.approx(-_log_sigmoid(2.0 * (-2.0) - 2.0 * (-3.0) - 0.5), abs=1e-6)


def test_replay_loss_sums_only_response_tokens():
    logprobs = torch.tensor([[-5.0, -1.0, -2.0, -9.0]])
    mask = torch.tensor([[0, 1, 1, 0]])
    other = torch.tensor([[-5.0, -3.0, -3.0, -3.0]])
    other_mask = torch.tensor([[0, 1, 1, 1]])
    out = replay_loss(logprobs, mask, other, other_mask, variant="simpo", beta=1.0, gamma=0.0)
    assert out.loss.item() == pytest.approx(-_log_sigmoid(-1.5 - (-3.0)), abs=1e-6)
    zero = torch.zeros(1)
    dpo = replay_loss(logprobs, mask, other, other_mask, variant="dpo", beta=1.0, ref_chosen=zero, ref_rejected=zero)
    assert dpo.loss.item() == pytest.approx(-_log_sigmoid(-3.0 - (-9.0)), abs=1e-6)
    with pytest.raises(ValueError, match="reference"):
        replay_loss(logprobs, mask, other, other_mask, variant="dpo")
    with pytest.raises(ValueError, match="variant"):
        replay_loss(logprobs, mask, other, other_mask, variant="ipo")


# ----------------------------------------------------------------------------- generalized JSD


def reference_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float) -> torch.Tensor:
    """Per-token JSD from probabilities: β·KL(p_T‖m) + (1−β)·KL(p_S‖m), m = β·p_T + (1−β)·p_S."""
    p_s = torch.softmax(student.double() / temperature, -1)
    p_t = torch.softmax(teacher.double() / temperature, -1)
    m = beta * p_t + (1 - beta) * p_s
    kl = lambda p, q: (p * (p.log() - q.log())).sum(-1)  # noqa: E731
    return beta * kl(p_t, m) + (1 - beta) * kl(p_s, m)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])  # endpoints are the plain KLs, tested below
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_jsd_matches_reference_with_labels(beta, temperature):
    torch.manual_seed(0)
    student, teacher = torch.randn(3, 5, 11, dtype=torch.float64), torch.randn(3, 5, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 5))
    labels[0, :2] = -100
    labels[2, 4] = -100
    got = generalized_jsd(student, teacher, labels, beta=beta, temperature=temperature)
    per_token = reference_jsd(student, teacher, beta, temperature)
    valid = labels != -100
    assert got.item() == pytest.approx((per_token[valid].sum() / valid.sum()).item(), abs=1e-12)


def test_jsd_endpoints_are_the_two_kls():
    torch.manual_seed(1)
    s, t = torch.randn(2, 4, 7, dtype=torch.float64), torch.randn(2, 4, 7, dtype=torch.float64)
    p_s, p_t = torch.softmax(s, -1), torch.softmax(t, -1)
    kl_t_s = (p_t * (p_t.log() - p_s.log())).sum(-1)
    kl_s_t = (p_s * (p_s.log() - p_t.log())).sum(-1)
    # without labels, batchmean divides by the batch size (TRL GKD's convention)
    assert generalized_jsd(s, t, beta=0.0).item() == pytest.approx(kl_t_s.sum().item() / 2, abs=1e-12)
    assert generalized_jsd(s, t, beta=1.0).item() == pytest.approx(kl_s_t.sum().item() / 2, abs=1e-12)


def test_jsd_token_clip_caps_each_token():
    torch.manual_seed(2)
    s, t = torch.randn(1, 6, 9) * 4, torch.randn(1, 6, 9) * 4
    labels = torch.zeros(1, 6, dtype=torch.long)
    per_token = reference_jsd(s, t, 0.5, 1.0)
    clip = float(per_token.median())
    got = generalized_jsd(s, t, labels, beta=0.5, token_clip=clip)
    assert got.item() == pytest.approx(per_token.clamp(max=clip).mean().item(), rel=1e-5)
    assert got < generalized_jsd(s, t, labels, beta=0.5)


def test_jsd_gradient_reaches_only_the_student_through_its_logits():
    s = torch.randn(1, 3, 5, requires_grad=True)
    t = torch.randn(1, 3, 5)
    generalized_jsd(s, t, torch.zeros(1, 3, dtype=torch.long)).backward()
    assert torch.isfinite(s.grad).all() and s.grad.abs().sum() > 0
    assert generalized_jsd(t.clone(), t, beta=0.5).item() == pytest.approx(0.0, abs=1e-7)
