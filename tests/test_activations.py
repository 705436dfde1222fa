"""Long rows in the trainer: activation checkpointing gives the unchecked step's gradients, and a
sample packed among others is scored exactly as alone (document-by-document attention)."""

from __future__ import annotations

import pytest
import torch

from meshrl.configs import load_config
from meshrl.loss_adapters.logprobs import sequence_token_logprobs
from meshrl.models.gguf import ensure_gguf
from meshrl.models.tiny import ensure_tiny
from meshrl.trainer.activations import checkpointed_layers
from meshrl.trainer.core import TrainerCore
from tests.test_gguf import SMOLLM2
from tests.test_moe import MOE
from tests.test_trainer import dpo_batch, rl_batch, sdpo_batch
from tests.test_trainer_core import QWEN_TIED

CHANNELS = ["--loss.replay.weight", "0.5", "--loss.sdpo.weight", "0.3"]
SHAPES = {
    "qwen3": QWEN_TIED,
    "moe": MOE,
    "lora": [*QWEN_TIED, "--model.lora", '{"r": 4, "lora_alpha": 8}'],
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    out = {name: str(ensure_tiny(root / name, load_config(args).model.tiny)) for name, args in SHAPES.items()}
    out["smollm2"] = str(ensure_gguf(SMOLLM2, root / "smollm2"))
    return out


def _gradients(core: TrainerCore) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Gradients of one warm-start pass, then of the RL, replay and SDPO passes of a step (the
    reference scoring its pairs), from one fixed set of batches; and the step's metrics."""
    vocab = core.model.config.vocab_size
    grads: dict[str, torch.Tensor] = {}
    batch = rl_batch(core.model, 1, length=24)
    passes = [({"input_ids": batch["input_ids"], "loss_mask": batch["loss_mask"]}, "sft"),
              (batch, "rl"), (dpo_batch(2, vocab), "aux"), (sdpo_batch(3, vocab, [4, 2]), "aux")]  # fmt: skip
    for data, kind in passes:
        if kind == "sft":
            core.sft_step(data)  # the warm start steps the model: its gradient is the step it took
            continue
        loss, _, _ = core._loss(data, 12.0 if kind == "rl" else None)
        loss.backward()
    for name, p in core.model.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.detach().clone()
    core.optimizer.zero_grad(set_to_none=True)
    metrics = core.train_step([[rl_batch(core.model, 4)]], [{**dpo_batch(5, vocab), **sdpo_batch(6, vocab, [3])}], 10)
    return grads, metrics


@pytest.mark.parametrize(
    "shape, mode",
    [(shape, mode) for shape in ("qwen3", "moe", "lora") for mode in ("full", "selective")] + [("smollm2", "full")],
)
def test_checkpointed_layers_give_the_unchecked_gradients(paths, shape, mode):
    args = [*SHAPES.get(shape, []), *CHANNELS, "--trainer.lr", "1e-3"]
    if shape == "moe":
        args += ["--trainer.router_aux_loss_coef", "0.1"]
    plain = TrainerCore(load_config(args), paths[shape])
    checked = TrainerCore(load_config([*args, "--trainer.activation_checkpointing", mode]), paths[shape])
    layers = len(checked.model.get_decoder().layers)
    assert checked.checkpointed_layers == (layers if mode == "full" else (layers + 1) // 2) > 0
    expected, expected_metrics = _gradients(plain)
    got, metrics = _gradients(checked)
    assert got.keys() == expected.keys() and got
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    # every metric alike, the MoE routers' counts too (the recompute in backward is not counted twice)
    assert metrics.keys() == expected_metrics.keys()
    for name, value in expected_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-8, nan_ok=True), name
    if shape == "moe":  # the routers count a forward's tokens once, not again in the recompute
        assert "moe/expert_load_max" in metrics and "moe/aux_loss" in metrics
        checked.router.take(checked.device)
        batch = rl_batch(checked.model, 7, length=24)
        loss, _, _ = checked._loss(batch, 12.0, counted=True)
        counted = checked.router.tokens
        loss.backward()
        assert checked.router.tokens == counted > 0


def test_offloaded_checkpoints_give_the_same_gradients(paths):
    args = [*QWEN_TIED, *CHANNELS]
    expected, _ = _gradients(TrainerCore(load_config(args), paths["qwen3"]))
    offload = ["--trainer.activation_checkpointing", "full", "--trainer.activation_offload", "true"]
    got, _ = _gradients(TrainerCore(load_config([*args, *offload]), paths["qwen3"]))
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_selective_checkpointing_picks_every_kth_layer_and_offload_needs_checkpointing():
    config = load_config(["--trainer.activation_checkpointing", "selective",
                          "--trainer.activation_checkpointing_every", "3"])  # fmt: skip
    assert checkpointed_layers(config.trainer, 7) == [True, False, False, True, False, False, True]
    with pytest.raises(ValueError, match="activation_offload needs trainer.activation_checkpointing"):
        load_config(["--trainer.activation_offload", "true"])


@pytest.mark.parametrize("shape", ["qwen3", "smollm2"])
def test_a_sample_packed_among_others_scores_as_alone(paths, shape):
    """Every token after a document's first (whose context is the document before) scores as in the
    sample alone: the trainer's attention never crosses a document, with no T×T mask built."""
    core = TrainerCore(load_config(SHAPES.get(shape, [])), paths[shape])
    g = torch.Generator().manual_seed(0)
    lengths = [17, 40, 9, 30]
    ids = torch.randint(3, core.model.config.vocab_size, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = sequence_token_logprobs(core.model, ids, 64, 1.0, position_ids=positions)[0]
        start = 0
        for n in lengths:
            alone = sequence_token_logprobs(core.model, ids[:, start : start + n], 64)[0]
            # float32 rounding of other matmul shapes only (SmolLM2's logprobs near -11: 1.5e-6 relative);
            # attention across a document would move them by orders of magnitude more
            torch.testing.assert_close(packed[start + 1 : start + n], alone[1:], rtol=1e-5, atol=2e-6)
            start += n
