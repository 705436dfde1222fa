"""TrainerCore in one process on models shaped like real checkpoints (Qwen3 with tied
embeddings and grouped-query attention)."""

from __future__ import annotations

import torch

from meshrl.configs import load_config
from meshrl.models.tiny import ensure_tiny
from meshrl.trainer.core import TrainerCore
from tests.test_trainer import dpo_batch, rl_batch

QWEN_TIED = [
    "--model.tiny.family", "qwen3", "--model.tiny.tie_embeddings", "true", "--model.tiny.hidden_size", "32",
    "--model.tiny.num_layers", "2", "--model.tiny.num_heads", "4", "--model.tiny.num_kv_heads", "2",
    "--model.tiny.vocab_size", "256",
]  # fmt: skip


def test_tied_embeddings_with_a_dpo_reference_checkpoint_and_resume(tmp_path):
    config = load_config([*QWEN_TIED, "--loss.replay.weight", "0.5", "--loss.replay.variant", "dpo"])
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


def _sft_batch(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    batch = rl_batch(model, 3)
    return {"input_ids": batch["input_ids"], "loss_mask": batch["loss_mask"]}


def test_rl_starts_with_fresh_adamw_moments_unless_kept(tmp_path):
    config = load_config([*QWEN_TIED, "--loss.replay.weight", "0.5", "--trainer.warm_start_lr", "0.003"])
    model_path = str(ensure_tiny(tmp_path / "model", config.model.tiny))
    core = TrainerCore(config, model_path)
    core.sft_step(_sft_batch(core.model))
    assert core.optimizer.state  # the warm start's moments
    core.start_rl()
    assert not core.optimizer.state
    for name, value in core.model.state_dict().items():  # the reference is the warm-started policy
        assert torch.equal(core.ref_model.state_dict()[name], value), name
    core.train_step([[rl_batch(core.model, 1)]], [None], rl_tokens=10)
    assert {int(s["step"]) for s in core.optimizer.state.values()} == {1}  # AdamW counts from RL's first step

    kept = TrainerCore(load_config([*QWEN_TIED, "--trainer.warm_start_keep_optimizer", "true"]), model_path)
    kept.sft_step(_sft_batch(kept.model))
    moments = {id(p): s["exp_avg"].clone() for p, s in kept.optimizer.state.items()}
    kept.start_rl()
    assert {id(p) for p in kept.optimizer.state} == moments.keys()
    assert all(torch.equal(s["exp_avg"], moments[id(p)]) for p, s in kept.optimizer.state.items())
