"""The composed loss on a tiny HF model: channel arithmetic, packing, switches and gradients."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from meshrl.configs import CustomLoss, DppoKlLoss, IpoLoss, RefKlLoss, load_config
from meshrl.loss_adapters import compose_loss, generalized_jsd, loss_fn, rl_loss_fn
from meshrl.loss_adapters.prime_rl import LossInputs

V = 97


def _model_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """Naive per-token logprobs from the model's own full logits, aligned with `ids`."""
    logits = model(input_ids=ids).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(ids.shape[0], 1), lp], 1)


def _samples(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for length, prompt, adv in [(9, 4, 1.0), (7, 3, -0.5), (6, 2, 0.0)]:
        ids = torch.randint(0, V, (length,), generator=g)
        mask = torch.zeros(length, dtype=torch.bool)
        mask[prompt:] = True
        out.append({
            "input_ids": ids,
            "loss_mask": mask,
            "advantages": torch.full((length,), adv),
            "inference_logprobs": -torch.rand(length, generator=g) * 4 * mask,
        })  # fmt: skip
    return out


def _packed(samples) -> dict[str, torch.Tensor]:
    batch = {k: torch.cat([s[k] for s in samples])[None] for k in samples[0]}
    batch["position_ids"] = torch.cat([torch.arange(len(s["input_ids"])) for s in samples])[None]
    return batch


def _padded(samples) -> dict[str, torch.Tensor]:
    """One sample per row, right-padded."""
    length = max(len(s["input_ids"]) for s in samples)
    pad = lambda t: torch.cat([t, t.new_zeros(length - len(t))])  # noqa: E731
    batch = {k: torch.stack([pad(s[k]) for s in samples]) for k in samples[0]}
    batch["attention_mask"] = torch.stack([pad(torch.ones(len(s["input_ids"]), dtype=torch.long)) for s in samples])
    return batch


def test_rl_channel_is_sum_of_prime_rl_losses_over_token_count(tiny_lm):
    samples = _samples()
    out = compose_loss(tiny_lm, _packed(samples), DppoKlLoss(), chunk_size=8)
    expected = 0.0
    for s in samples:
        lp = _model_logprobs(tiny_lm, s["input_ids"][None])[0]
        expected += loss_fn(LossInputs(lp, s["inference_logprobs"], None, s["advantages"], s["loss_mask"])).loss
    tokens = sum(int(s["loss_mask"].sum()) for s in samples)
    assert out.metrics["loss/rl"].item() == pytest.approx(expected.item() / tokens, rel=1e-5)
    assert out.loss.item() == pytest.approx(out.metrics["loss/rl"].item())
    assert {"is_masked", "masked_mismatch_kl", "unmasked_mismatch_kl", "loss/total"} <= set(out.metrics)
    assert "loss/replay" not in out.metrics and "loss/sdpo" not in out.metrics


def test_rl_metrics_are_means_over_tokens_not_over_samples(tiny_lm):
    """A 2-token sample fully capped beside a 98-token one with nothing capped is 2% capped, not 50%."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for length, prompt, shift in [(4, 2, 2.0), (100, 2, 0.0)]:  # shift: how far the sampler was below the policy
        ids = torch.randint(0, V, (length,), generator=g)
        mask = torch.zeros(length, dtype=torch.bool)
        mask[prompt:] = True
        lp = _model_logprobs(tiny_lm, ids[None])[0].detach()
        samples.append({"input_ids": ids, "loss_mask": mask, "advantages": torch.ones(length),
                        "inference_logprobs": (lp - shift) * mask})  # fmt: skip
    out = compose_loss(tiny_lm, _packed(samples), load_config(["--loss.type", "tis", "--loss.cap", "2"]).loss)
    assert out.metrics["tis/capped"].item() == pytest.approx(2 / 100)
    assert out.metrics["tis/ratio_max"].item() == pytest.approx(math.exp(2.0), rel=1e-4)  # a largest value: the max


def _masked_and_kept(model, seed: int) -> list[dict[str, torch.Tensor]]:
    """Two samples: every token of the first has A < 0 and a probability the sampler put at 0.95 (so
    dppo_kl masks it, Δp < −0.2); the second is on-policy with A > 0, so none of it is masked."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for length, adv, masked in [(6, -1.0, True), (41, 1.0, False)]:
        ids = torch.randint(0, V, (length,), generator=g)
        mask = torch.arange(length) > 0  # the first token is the prompt
        sampler = torch.full((length,), math.log(0.95)) if masked else _model_logprobs(model, ids[None])[0].detach()
        samples.append({"input_ids": ids, "loss_mask": mask, "advantages": torch.full((length,), adv),
                        "inference_logprobs": sampler * mask})  # fmt: skip
    return samples


def test_metrics_of_the_masked_tokens_are_over_those_tokens_alone(tiny_lm):
    """Every masked token has A < 0, so masked_advantage_negative is 1 whatever the unmasked sample
    beside it (a per-sample mean weighed by all its tokens gave 5/45); no masked token at all is NaN."""
    samples = _masked_and_kept(tiny_lm, 0)
    out = compose_loss(tiny_lm, _packed(samples), DppoKlLoss())
    assert out.metrics["masked_advantage_negative"].item() == 1.0
    assert out.metrics["masked_advantage_positive"].item() == 0.0
    assert out.metrics["is_masked"].item() == pytest.approx(5 / 45)
    own = loss_fn(LossInputs(_model_logprobs(tiny_lm, samples[0]["input_ids"][None])[0], samples[0]["inference_logprobs"],
                             None, samples[0]["advantages"], samples[0]["loss_mask"]))  # fmt: skip
    assert out.metrics["masked_mismatch_kl"].item() == pytest.approx(own.metrics["masked_mismatch_kl"].item(), rel=1e-6)
    assert out.counts["masked_advantage_negative"].item() == 5 and out.counts["unmasked_mismatch_kl"].item() == 40
    on_policy = compose_loss(tiny_lm, _packed(samples[1:]), DppoKlLoss())
    assert math.isnan(on_policy.metrics["masked_advantage_negative"].item())
    assert math.isnan(on_policy.metrics["masked_mismatch_kl"].item())
    assert on_policy.counts["masked_mismatch_kl"].item() == 0


def test_packed_rows_equal_padded_rows(tiny_lm):
    samples = _samples(3)
    packed = compose_loss(tiny_lm, _packed(samples), DppoKlLoss())
    padded = compose_loss(tiny_lm, _padded(samples), DppoKlLoss())
    assert packed.loss.item() == pytest.approx(padded.loss.item(), rel=1e-5)


def test_dp_token_count_normalises(tiny_lm):
    batch = _packed(_samples())
    local = compose_loss(tiny_lm, batch, DppoKlLoss())
    global_ = compose_loss(tiny_lm, batch, DppoKlLoss(), rl_token_count=int(batch["loss_mask"].sum()) * 4)
    assert global_.loss.item() == pytest.approx(local.loss.item() / 4, rel=1e-6)


def test_loss_swap_by_config(tiny_lm):
    batch = _packed(_samples())
    batch["ref_logprobs"] = batch["inference_logprobs"] - 0.1
    results = {}
    for config in [DppoKlLoss(), IpoLoss(ipo_threshold=0.01), RefKlLoss(),
                   CustomLoss(import_path="meshrl.loss_adapters.prime_rl:loss_fn", kwargs={"kl_tau": 0.5})]:  # fmt: skip
        results[config.type] = compose_loss(tiny_lm, batch, config)
        assert torch.isfinite(results[config.type].loss)
    assert "ref_kl" in results["ref_kl"].metrics
    assert results["custom"].loss.item() != pytest.approx(results["dppo_kl"].loss.item())
    with pytest.raises(ValueError, match="loss.import_path"):
        rl_loss_fn(CustomLoss(import_path="meshrl.no_such_module.fn"))
    with pytest.raises(ValueError, match="no attribute"):
        rl_loss_fn(CustomLoss(import_path="meshrl.loss_adapters.prime_rl.nope"))


def _replay_batch(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 0]])
    return {
        "dpo_chosen_input_ids": torch.randint(0, V, (2, 6), generator=g),
        "dpo_chosen_response_mask": mask,
        "dpo_rejected_input_ids": torch.randint(0, V, (2, 6), generator=g),
        "dpo_rejected_response_mask": mask,
    }


def _sdpo_batch(seed: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randint(0, V, (1, 10), generator=g)
    student = teacher.clone()
    student[0, 2:5] = torch.randint(0, V, (3,), generator=g)  # the hint region differs
    labels = torch.full((1, 10), -100)
    labels[0, 7:] = 1  # the recovery turn
    return {"sdpo_student_input_ids": student, "sdpo_teacher_input_ids": teacher, "sdpo_loss_mask": labels}


def test_all_three_channels_add_with_their_weights_and_give_finite_gradients(tiny_lm):
    config = load_config(["--loss.replay.weight", "0.3", "--loss.sdpo.weight", "0.7"]).loss
    batch = {**_packed(_samples()), **_replay_batch(), **_sdpo_batch()}
    ref_model = copy.deepcopy(tiny_lm).eval()
    out = compose_loss(tiny_lm, batch, config, ref_model=ref_model)
    m = {k: v.item() for k, v in out.metrics.items()}
    assert out.loss.item() == pytest.approx(m["loss/rl"] + 0.3 * m["loss/replay"] + 0.7 * m["loss/sdpo"], rel=1e-6)
    # the policy equals its frozen reference: every DPO margin is 0, the loss is log 2
    assert m["loss/replay"] == pytest.approx(torch.log(torch.tensor(2.0)).item(), rel=1e-6)
    assert m["sdpo/tokens"] == 3
    for channel_batch, key in [(_replay_batch(), "loss/replay"), (_sdpo_batch(), "loss/sdpo")]:
        tiny_lm.zero_grad()
        only = compose_loss(tiny_lm, channel_batch, config, ref_model=ref_model)
        assert set(k for k in only.metrics if k.startswith("loss/")) == {key, "loss/total"}
        only.loss.backward()
        grads = [p.grad for p in tiny_lm.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        assert sum(g.abs().sum() for g in grads) > 0


def test_sdpo_channel_equals_jsd_over_full_logits_at_masked_positions(tiny_lm):
    batch = _sdpo_batch()
    config = load_config(
        ["--loss.sdpo.weight", "1", "--loss.sdpo.jsd_beta", "0.3", "--loss.sdpo.temperature", "0.8"]
    ).loss
    got = compose_loss(tiny_lm, batch, config).metrics["loss/sdpo"]
    student = tiny_lm(input_ids=batch["sdpo_student_input_ids"]).logits[:, :-1]
    teacher = tiny_lm(input_ids=batch["sdpo_teacher_input_ids"]).logits[:, :-1]
    expected = generalized_jsd(student, teacher, batch["sdpo_loss_mask"][:, 1:], beta=0.3, temperature=0.8)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)


def test_channels_switch_off_by_weight_or_missing_inputs(tiny_lm):
    rl_only = load_config([]).loss
    batch = {**_packed(_samples()), **_replay_batch(), **_sdpo_batch()}
    assert set(k for k in compose_loss(tiny_lm, batch, rl_only).metrics if k.startswith("loss/")) == {
        "loss/rl",
        "loss/total",
    }
    weighted = load_config(
        ["--loss.replay.weight", "1", "--loss.replay.variant", "simpo", "--loss.sdpo.weight", "1"]
    ).loss
    out = compose_loss(tiny_lm, _packed(_samples()), weighted)  # weights on, inputs absent
    assert "loss/replay" not in out.metrics and "loss/sdpo" not in out.metrics
    with pytest.raises(ValueError, match="no live loss channel"):
        compose_loss(tiny_lm, _sdpo_batch(), rl_only)


def test_dpo_without_any_reference_is_refused(tiny_lm):
    config = load_config(["--loss.replay.weight", "1"]).loss
    with pytest.raises(ValueError, match="reference"):
        compose_loss(tiny_lm, _replay_batch(), config)
    batch = {**_replay_batch(), "dpo_ref_chosen_logprob": torch.zeros(2), "dpo_ref_rejected_logprob": torch.zeros(2)}
    assert torch.isfinite(compose_loss(tiny_lm, batch, config).loss)


def test_empty_rl_batch_still_backpropagates(tiny_lm):
    batch = _packed(_samples())
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    out = compose_loss(tiny_lm, batch, DppoKlLoss())
    assert out.loss.item() == 0.0
    out.loss.backward()  # every rank must be able to run backward
