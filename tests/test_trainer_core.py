"""TrainerCore in one process on models shaped like real checkpoints (Qwen3 with tied
embeddings and grouped-query attention)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from meshrl.configs import load_config
from meshrl.loss_adapters.logprobs import sequence_token_logprobs
from meshrl.models.tiny import ensure_tiny
from meshrl.trainer import checkpoint
from meshrl.trainer import core as core_module
from meshrl.trainer.core import TrainerCore, Weighted, grad_buckets
from tests.test_trainer import dpo_batch, rl_batch, sdpo_batch

QWEN_TIED = [
    "--model.tiny.family", "qwen3", "--model.tiny.tie_embeddings", "true", "--model.tiny.hidden_size", "32",
    "--model.tiny.num_layers", "2", "--model.tiny.num_heads", "4", "--model.tiny.num_kv_heads", "2",
    "--model.tiny.vocab_size", "256",
]  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tied_embeddings_with_a_dpo_reference_checkpoint_and_resume(tmp_path, dtype):
    """The reference comes back exactly, float32 under bf16 compute too (loaded in bf16 it rounded 16
    of 25 tensors, and an unchanged policy's replay margin went from 0 to -2.1e-4 after each resume)."""
    config = load_config([*QWEN_TIED, "--loss.replay.weight", "0.5", "--loss.replay.variant", "dpo",
                          "--model.dtype", dtype])  # fmt: skip
    model_path = str(ensure_tiny(tmp_path / "model", config.model.tiny))
    core = TrainerCore(config, model_path)
    assert core.model.lm_head.weight is core.model.get_input_embeddings().weight
    vocab = core.model.config.vocab_size
    core.train_step([[rl_batch(core.model, 1)]], [dpo_batch(2, vocab)], rl_tokens=10)
    core.save(tmp_path / "ckpt")  # the reference's state dict shares the embedding with the head

    resumed = TrainerCore(config, model_path)
    resumed.load(tmp_path / "ckpt")
    for name, value in core.ref_model.state_dict().items():
        assert torch.equal(resumed.ref_model.state_dict()[name], value), name
    for name, value in core.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name
    assert resumed.ref_model.lm_head.weight is resumed.ref_model.get_input_embeddings().weight
    if dtype == "bfloat16":  # a policy equal to its reference: every pair's margin is 0 exactly
        resumed.ref_model.load_state_dict(resumed.model.state_dict())
        resumed.save(tmp_path / "same")
        again = TrainerCore(config, model_path)
        again.load(tmp_path / "same")
        _, metrics, _ = again._loss(dpo_batch(2, vocab))
        assert metrics["replay/margin"] == 0


def _sft_batch(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    batch = rl_batch(model, 3)
    return {"input_ids": batch["input_ids"], "loss_mask": batch["loss_mask"]}


def test_rl_starts_with_fresh_adamw_moments_unless_kept(tmp_path):
    config = load_config([*QWEN_TIED, "--loss.replay.weight", "0.5", "--trainer.warm_start_lr", "0.003"])
    model_path = str(ensure_tiny(tmp_path / "model", config.model.tiny))
    core = TrainerCore(config, model_path)
    core.sft_step([_sft_batch(core.model)])
    assert core.optimizer.state  # the warm start's moments
    core.start_rl()
    assert not core.optimizer.state
    for name, value in core.model.state_dict().items():  # the reference is the warm-started policy
        assert torch.equal(core.ref_model.state_dict()[name], value), name
    core.train_step([[rl_batch(core.model, 1)]], [None], rl_tokens=10)
    assert {int(s["step"]) for s in core.optimizer.state.values()} == {1}  # AdamW counts from RL's first step

    kept = TrainerCore(load_config([*QWEN_TIED, "--trainer.warm_start_keep_optimizer", "true"]), model_path)
    kept.sft_step([_sft_batch(kept.model)])
    moments = {id(p): s["exp_avg"].clone() for p, s in kept.optimizer.state.items()}
    kept.start_rl()
    assert {id(p) for p in kept.optimizer.state} == moments.keys()
    assert all(torch.equal(s["exp_avg"], moments[id(p)]) for p, s in kept.optimizer.state.items())


def test_each_channel_s_gradient_norm_is_its_gradient_alone_and_measuring_leaves_the_step_as_it_was(tmp_path):
    """`metrics.channel_grad_norms`: each channel's norm is the step's gradient norm when that channel
    trains alone (same batches, same reference), a channel without rows logs none, and the step with
    the norms measured moves the weights as the step without."""
    args = [*QWEN_TIED, "--loss.replay.weight", "0.5", "--loss.sdpo.weight", "0.3"]
    model_path = str(ensure_tiny(tmp_path / "model", load_config(args).model.tiny))

    def step(shards: list, aux: dict | None, measured: bool = False) -> tuple[dict, dict]:
        core = TrainerCore(load_config([*args, "--metrics.channel_grad_norms", str(measured).lower()]), model_path)
        vocab = core.model.config.vocab_size
        rl = [rl_batch(core.model, 1), rl_batch(core.model, 2)] if "rl" in shards else []
        parts = {"dpo": dpo_batch(3, vocab), "sdpo": sdpo_batch(4, vocab, [3, 2])}
        batch = {k: v for name in aux or () for k, v in parts[name].items()} or None
        metrics = core.train_step([rl], [batch], rl_tokens=sum(int(b["loss_mask"].sum()) for b in rl))
        return metrics, core.weights()

    measured, weights = step(["rl"], ("dpo", "sdpo"), measured=True)
    plain, plain_weights = step(["rl"], ("dpo", "sdpo"))
    assert measured["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6) and "grad_norm/rl" not in plain
    for name, value in plain_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-7)
    alone = {"rl": step(["rl"], None)[0], "replay": step([], ("dpo",))[0], "sdpo": step([], ("sdpo",))[0]}
    for channel, metrics in alone.items():
        assert measured[f"grad_norm/{channel}"] == pytest.approx(metrics["grad_norm"], rel=1e-5), channel
    assert len({round(measured[f"grad_norm/{c}"], 6) for c in alone}) == 3  # three different parts
    without_sdpo, _ = step(["rl"], ("dpo",), measured=True)
    assert "grad_norm/sdpo" not in without_sdpo and without_sdpo["grad_norm/replay"] == measured["grad_norm/replay"]


def test_bfloat16_computes_over_float32_master_weights(tmp_path):
    """At lr 1e-6 pure bf16 weights would stay put (98% unchanged in the issue); float32 masters move."""
    config = load_config([*QWEN_TIED, "--model.dtype", "bfloat16", "--trainer.lr", "1e-6",
                          "--loss.replay.weight", "0.5"])  # fmt: skip
    model_path = str(ensure_tiny(tmp_path / "model", config.model.tiny))
    core = TrainerCore(config, model_path)
    assert {p.dtype for p in core.model.parameters()} == {torch.float32}
    assert {p.dtype for p in core.ref_model.parameters()} == {torch.float32}  # computes as the policy does
    before = {k: v.clone() for k, v in core.weights().items()}
    metrics = core.train_step([[rl_batch(core.model, 1)]], [dpo_batch(2, core.model.config.vocab_size)], 10)
    assert metrics["skipped_steps"] == 0
    after = core.weights()
    moved = sum(int((after[k] != v).sum()) for k, v in before.items() if "norm" not in k)
    total = sum(v.numel() for k, v in before.items() if "norm" not in k)
    assert moved / total > 0.9
    assert {s["exp_avg"].dtype for s in core.optimizer.state.values()} == {torch.float32}
    assert {v.dtype for v in core.weights(torch.bfloat16).values()} == {torch.bfloat16}  # what generators get


def test_the_dpo_reference_is_the_starting_policy_exactly_in_bfloat16(tmp_path):
    """Before any step the reference and the policy score both sides alike, so every pair's
    β·margin is 0 exactly (a bf16 copy of the reference gave -2.0e-3 on this shape)."""
    config = load_config([*QWEN_TIED, "--model.dtype", "bfloat16", "--loss.replay.weight", "0.5"])
    core = TrainerCore(config, str(ensure_tiny(tmp_path / "model", config.model.tiny)))
    _, metrics, _ = core._loss(dpo_batch(2, core.model.config.vocab_size))
    assert metrics["replay/margin"] == 0 and metrics["replay/reward_chosen"] == 0


def test_ref_kl_scores_its_reference_and_distills_toward_it(tmp_path):
    """`loss.type = "ref_kl"` gets per-token ref_logprobs from the trainer's frozen reference: the
    starting policy by default (the signal is 0 at the start), or `reference_path`, which a few
    steps on one batch pull the policy toward. Zero-advantage rows train (their signal is not A)."""
    config = load_config([*QWEN_TIED, "--loss.type", "ref_kl", "--trainer.lr", "3e-3"])
    model_path = str(ensure_tiny(tmp_path / "model", config.model.tiny))
    core = TrainerCore(config, model_path)
    batch = {**rl_batch(core.model, 1), "advantages": torch.zeros(1, 20)}
    assert core.train_step([[batch]], [None], rl_tokens=10)["ref_kl"] == 0

    teacher = str(ensure_tiny(tmp_path / "teacher", config.model.tiny, seed=1))
    core = TrainerCore(load_config([*QWEN_TIED, "--loss.type", "ref_kl", "--trainer.lr", "3e-3",
                                    "--loss.reference_path", teacher]), model_path)  # fmt: skip

    def gap() -> float:  # mean |lp_ref − lp_policy| over the batch's sampled tokens
        with torch.no_grad():
            policy, ref = (sequence_token_logprobs(m, batch["input_ids"]) for m in (core.model, core.ref_model))
        return float((ref - policy).abs()[batch["loss_mask"]].mean())

    gaps = [gap()]
    for _ in range(6):
        core.train_step([[batch]], [None], rl_tokens=10)
        gaps.append(gap())
    assert gaps[0] > 0.1 and gaps[-1] < 0.5 * gaps[0], gaps
    with pytest.raises(ValueError, match="loss.reference_path"):
        load_config(["--loss.type", "ref_kl", "--loss.reference_path", teacher, "--loss.replay.weight", "0.1"])


def test_a_step_s_masked_token_metrics_are_over_its_masked_tokens(tmp_path):
    """Two micro-batches: in one every loss token is masked (A < 0, the sampler put it at 0.95), in
    the other none is. Every masked token has A < 0: 1.0, not 0.5 (the micro-batches' means weighed
    by all their tokens). A step with nothing masked logs NaN (null), one with no rows no loss/total."""
    config = load_config(QWEN_TIED)
    core = TrainerCore(config, str(ensure_tiny(tmp_path / "model", config.model.tiny)))
    masked = rl_batch(core.model, 1)
    mask = masked["loss_mask"]
    masked.update(advantages=-mask.float(), inference_logprobs=math.log(0.95) * mask)
    step = core.train_step([[masked, rl_batch(core.model, 2)]], [None], rl_tokens=20)
    assert step["masked_advantage_negative"] == 1.0 and step["masked_advantage_positive"] == 0.0
    assert step["is_masked"] == 0.5
    assert math.isnan(core.train_step([[rl_batch(core.model, 3)]], [None], rl_tokens=10)["masked_advantage_negative"])
    assert math.isnan(core.train_step([[]], [None], rl_tokens=0)["loss/total"])


def test_a_mean_over_no_item_is_nan_not_zero():
    weighted = Weighted()
    weighted.add("masked_mismatch_kl", math.nan, 0.0)  # a micro-batch with nothing masked
    assert math.isnan(weighted.reduced(1)["masked_mismatch_kl"])
    weighted.add("masked_mismatch_kl", 0.5, 4.0)
    assert weighted.reduced(1) == {"masked_mismatch_kl": 0.5}


def test_gradient_buckets_bound_each_all_reduce_copy():
    grads = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(5), torch.zeros(5)]
    buckets = grad_buckets(grads, cap_bytes=80)
    assert [[g.numel() for g in b] for b in buckets] == [[10, 10], [30], [5, 5]]  # a 120-byte grad goes alone
    assert [g for b in buckets for g in b] == grads


def test_a_background_checkpoint_holds_the_state_of_its_snapshot_while_training_goes_on(tmp_path, monkeypatch):
    """The write is held back until a step has run after the snapshot: the checkpoint must hold
    the snapshot's weights, moments and step count, not the live ones the step overwrote."""
    config = load_config([*QWEN_TIED, "--loss.replay.weight", "0.5"])
    model_path = str(ensure_tiny(tmp_path / "model", config.model.tiny))
    core = TrainerCore(config, model_path)
    vocab = core.model.config.vocab_size
    core.train_step([[rl_batch(core.model, 1)]], [dpo_batch(2, vocab)], rl_tokens=10)
    snapshot = {name: value.clone() for name, value in core.weights().items()}
    moments = [s["exp_avg"].clone() for s in core.optimizer.state.values()]

    release = threading.Event()
    write = checkpoint.write_checkpoint
    monkeypatch.setattr(core_module, "write_checkpoint", lambda *args: (release.wait(30), write(*args)))
    core.save(tmp_path / "ckpt", wait=False)
    assert not core.checkpoint_written(wait=False)
    core.train_step([[rl_batch(core.model, 3)]], [dpo_batch(4, vocab)], rl_tokens=10)  # moves the live state
    release.set()
    assert core.checkpoint_written(wait=True)

    resumed = TrainerCore(config, model_path)
    resumed.load(tmp_path / "ckpt")
    for name, value in resumed.weights().items():
        assert torch.equal(value, snapshot[name]), name
        assert not torch.equal(value, core.weights()[name]), name
    for saved, expected in zip([s["exp_avg"] for s in resumed.optimizer.state.values()], moments, strict=True):
        assert torch.equal(saved, expected)
    assert resumed.scheduler.last_epoch == 1


def test_a_failed_background_write_is_raised_naming_the_checkpoint(tmp_path):
    config = load_config(QWEN_TIED)
    core = TrainerCore(config, str(ensure_tiny(tmp_path / "model", config.model.tiny)))
    (tmp_path / "taken").write_text("a file where the checkpoint folder should go")
    core.save(tmp_path / "taken" / "step_1", wait=False)
    with pytest.raises(RuntimeError, match="writing checkpoint .*taken/step_1 failed"):
        core.checkpoint_written(wait=True)
    assert core.checkpoint_written(wait=False)  # reported once; the next save starts clean


def test_a_resume_trains_with_the_optimizer_settings_its_config_changed(tmp_path):
    """`--trainer.lr` (betas, weight decay, the schedule) changed on resume with --allow-config-change
    was recorded and then ignored: the checkpoint's param groups and scheduler brought the old ones
    back. Unchanged, a resume's rate is the saved one exactly."""
    args = [*QWEN_TIED, "--trainer.lr", "1e-3", "--trainer.warmup_steps", "4", "--max-steps", "10"]
    config = load_config(args)
    model_path = str(ensure_tiny(tmp_path / "model", config.model.tiny))
    core = TrainerCore(config, model_path)
    for seed in range(2):
        core.train_step([[rl_batch(core.model, seed)]], [None], rl_tokens=10)
    core.save(tmp_path / "ckpt")
    same = TrainerCore(config, model_path)
    same.load(tmp_path / "ckpt")
    assert (
        same.train_step([[rl_batch(core.model, 2)]], [None], 10)["lr"]
        == core.train_step([[rl_batch(core.model, 2)]], [None], 10)["lr"]
    )
    changed = TrainerCore(load_config([*args, "--trainer.lr", "1e-2", "--trainer.weight_decay", "0.5",
                                       "--trainer.betas", "[0.5, 0.9]"]), model_path)  # fmt: skip
    changed.load(tmp_path / "ckpt")
    group = changed.optimizer.param_groups[0]
    assert group["weight_decay"] == 0.5 and tuple(group["betas"]) == (0.5, 0.9)
    assert changed.train_step([[rl_batch(core.model, 2)]], [None], 10)["lr"] == pytest.approx(1e-2 * 3 / 4)


def test_the_warm_start_runs_in_micro_batches_and_takes_the_step_the_whole_batch_takes(tmp_path):
    """Right-padded rows of different lengths and loss tokens: cut into micro-batches of one or two
    rows (a 24-token budget), the step equals one pass over the batch (a 4096-token budget)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (4, 12), generator=g)
    attention = torch.tensor([[1] * n + [0] * (12 - n) for n in (12, 5, 9, 3)])
    loss = attention.clone()
    loss[:, :2] = 0
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss}
    # the run's collator also builds SDPO rows at the demonstrations' error sites (one here): not trained on
    sites = {"sdpo_student_input_ids": ids[:1], "sdpo_teacher_input_ids": ids[:1], "sdpo_loss_mask": loss[:1]}
    steps = {}
    for budget in ("24", "4096"):
        config = load_config([*QWEN_TIED, "--trainer.micro_batch_tokens", budget, "--trainer.warm_start_lr", "0.01"])
        model_path = str(ensure_tiny(tmp_path / "model", config.model.tiny))
        core = TrainerCore(config, model_path)
        before = {k: v.clone() for k, v in core.model.state_dict().items()}
        metrics = core.sft_step([{**batch, **sites} if budget == "24" else batch])
        steps[budget] = ({k: v - before[k] for k, v in core.model.state_dict().items()}, metrics["loss/sft"])
    (cut, cut_loss), (whole, whole_loss) = steps["24"], steps["4096"]
    assert cut_loss == pytest.approx(whole_loss, rel=1e-5)
    for name, step in whole.items():  # AdamW's first step is about lr x sign(grad): 0.01 where the gradient is not ~0
        torch.testing.assert_close(cut[name], step, rtol=0, atol=1e-4)
