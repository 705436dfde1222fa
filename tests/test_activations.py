"""Long rows in the trainer: activation checkpointing gives the unchecked step's gradients, and a
sample packed among others is scored exactly as alone (document-by-document attention)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from meshrl.configs import load_config
from meshrl.loss_adapters.logprobs import sequence_token_logprobs
from meshrl.models.tiny import ensure_tiny
from meshrl.trainer.activations import checkpointed_layers
from meshrl.trainer.attention import WINDOW_BLOCK, use_document_attention
from meshrl.trainer.core import TrainerCore
from tests.test_moe import MOE
from tests.test_trainer import dpo_batch, rl_batch, sdpo_batch
from tests.test_trainer_core import QWEN_TIED

CHANNELS = ["--loss.replay.weight", "0.5", "--loss.sdpo.weight", "0.3"]
SHAPES = {
    "qwen3": QWEN_TIED,
    "moe": MOE,
    "lora": [*QWEN_TIED, "--model.lora", '{"r": 4, "lora_alpha": 8}'],
    "llama": ["--model.tiny.family", "llama"],  # SmolLM2's family (untied here), at the tiny size
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory, smollm2_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    out = {name: str(ensure_tiny(root / name, load_config(args).model.tiny)) for name, args in SHAPES.items()}
    out["smollm2"] = str(smollm2_dir)
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
            core.sft_step([data])  # the warm start steps the model: its gradient is the step it took
            continue
        loss, _, _ = core._loss(data, 12.0 if kind == "rl" else None)
        loss.backward()
    for name, p in core.model.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.detach().clone()
    core.optimizer.zero_grad(set_to_none=True)
    metrics = core.train_step([[rl_batch(core.model, 4)]], [{**dpo_batch(5, vocab), **sdpo_batch(6, vocab, [3])}], 10)
    return grads, metrics


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, mode",
    [(shape, mode) for shape in ("qwen3", "moe", "lora") for mode in ("full", "selective")] + [("llama", "full")],
)
def test_checkpointed_layers_give_the_unchecked_gradients(paths, shape, mode):
    args = [*SHAPES.get(shape, []), *CHANNELS, "--trainer.lr", "1e-3"]
    if shape == "moe":
        args += ["--trainer.router_aux_loss_coef", "0.1"]
    plain = TrainerCore(load_config(args), paths[shape])
    checked = TrainerCore(load_config([*args, "--trainer.activation_checkpointing", mode]), paths[shape])
    layers = len(checked.model.get_decoder().layers)
    assert checked.checkpointed_layers == layers > 0
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


@pytest.mark.slow
def test_offloaded_checkpoints_give_the_same_gradients(paths):
    args = [*QWEN_TIED, *CHANNELS]
    expected, _ = _gradients(TrainerCore(load_config(args), paths["qwen3"]))
    offload = ["--trainer.activation_checkpointing", "full", "--trainer.activation_offload", "true"]
    got, _ = _gradients(TrainerCore(load_config([*args, *offload]), paths["qwen3"]))
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_compiled_layers_under_checkpointing_give_the_eager_gradients(paths):
    """`trainer.compile` (each decoder layer a graph) with full checkpointing, beside the replay
    channel (whose reference is a copy of the compiled policy): the eager gradients."""
    args = [*QWEN_TIED, *CHANNELS, "--trainer.activation_checkpointing", "full"]
    grads, batch = {}, None
    for compiled in (False, True):
        core = TrainerCore(load_config([*args, "--trainer.compile", str(compiled).lower()]), paths["qwen3"])
        layers = core.model.get_decoder().layers
        assert all((layer._compiled_call_impl is not None) == compiled for layer in layers)
        batch = batch or rl_batch(core.model, 4)  # scored by the eager model: one compile, the training one
        loss, _, _ = core._loss(batch, 12.0)
        loss.backward()
        grads[compiled] = {name: p.grad for name, p in core.model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys() and grads[True]
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_checkpointing_every_kth_layer_and_offload_needs_checkpointing():
    config = load_config(["--trainer.activation_checkpointing", "selective",
                          "--trainer.activation_checkpointing_every", "3"])  # fmt: skip
    assert checkpointed_layers(config.trainer, 7) == [True, False, False, True, False, False, True]
    assert checkpointed_layers(load_config(["--trainer.activation_checkpointing", "full"]).trainer, 3) == [True] * 3
    with pytest.raises(ValueError, match="activation_offload needs trainer.activation_checkpointing"):
        load_config(["--trainer.activation_offload", "true"])


def test_selective_checkpointing_recomputes_half_the_matmuls_of_full(paths):
    """Op-level selective checkpointing keeps every other matmul's output (and attention's), so its
    backward runs half as many of the layer's forward matmuls again as full checkpointing does."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Matmuls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
            return func(*args, **(kwargs or {}))

    backward = {}
    for mode in ("none", "full", "selective"):
        core = TrainerCore(load_config([*QWEN_TIED, "--trainer.activation_checkpointing", mode]), paths["qwen3"])
        loss, _, _ = core._loss(rl_batch(core.model, 1, length=24), 12.0)
        with Matmuls() as counted:
            loss.backward()
        backward[mode] = counted.count
    layers = len(core.model.get_decoder().layers)
    recomputed = backward["full"] - backward["none"]  # each layer's forward matmuls, run again
    assert recomputed > 0 and recomputed % layers == 0
    per_layer = recomputed // layers
    assert backward["selective"] - backward["none"] == layers * (per_layer // 2)


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


def _small(config_class: type, **extra) -> torch.nn.Module:
    """A two-layer model of a transformers family, random weights, built here (nothing to download)."""
    config = config_class(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, **extra)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


FAMILIES = {
    "mistral, window 4": ("MistralConfig", {"sliding_window": 4}),
    "qwen2, window 4 on its second layer": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 4,
                                                            "max_window_layers": 1}),
    "llama, no window": ("LlamaConfig", {}),
}  # fmt: skip
# Each kernel where it runs: FlexAttention has no CPU backward (its CPU case checks logits only), and
# varlen is CUDA's flash kernel (bf16).
KERNELS = [("sdpa", "cpu"), ("flex", "cpu"), pytest.param("flex", "cuda", marks=pytest.mark.gpu),
           pytest.param("varlen", "cuda", marks=pytest.mark.gpu)]  # fmt: skip


def _scored(model: torch.nn.Module, ids: torch.Tensor, weights: torch.Tensor, grads: bool, **kwargs) -> tuple:
    """Logits and, if `grads`, every parameter's gradient of a fixed linear function of them."""
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grads), torch.autocast(ids.device.type, torch.bfloat16, enabled=ids.is_cuda):
        logits = model(ids, **kwargs).logits.float()
    if not grads:
        return logits, {}
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("block", [WINDOW_BLOCK, 5])
@pytest.mark.parametrize("kernel, device", KERNELS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_kernel_is_eager_attention_with_or_without_a_sliding_window(family, kernel, device, block, monkeypatch):
    """Each document of a packed row scores, and trains, as transformers' eager attention does it
    alone, a layer's sliding window included (a window was dropped: |documents − eager| 1.49 on a
    windowed Mistral); in blocks of queries smaller than a document too (SDPA's path)."""
    import transformers

    from meshrl.trainer import attention

    if block != WINDOW_BLOCK and kernel != "sdpa":
        pytest.skip("query blocks are the per-document SDPA path's")
    monkeypatch.setattr(attention, "WINDOW_BLOCK", block)
    config_class, extra = FAMILIES[family]
    model = _small(getattr(transformers, config_class), **extra).to(device)
    g = torch.Generator().manual_seed(1)
    lengths = [16, 3, 11]
    ids = torch.randint(0, 64, (1, sum(lengths)), generator=g).to(device)
    weights = torch.randn(1, sum(lengths), 64, generator=g).to(device)
    grads = not (kernel == "flex" and device == "cpu")
    alone = [_scored(model, part, w, grads) for part, w in zip(ids.split(lengths, 1), weights.split(lengths, 1))]
    use_document_attention(model, kernel)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    packed, packed_grads = _scored(model, ids, weights, grads, position_ids=positions)
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if device == "cuda" else {"rtol": 1e-5, "atol": 1e-5}  # bf16 on CUDA
    torch.testing.assert_close(packed, torch.cat([logits for logits, _ in alone], dim=1), **tolerance)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, sum(part[name] for _, part in alone), **tolerance, msg=name)
    assert packed_grads.keys() == (alone[0][1].keys() if grads else set())


def _flash_varlen_contract(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                           enable_gqa=False, **_):  # fmt: skip
    """`varlen_attn` as its documentation defines it, for the CPU (flash kernels are CUDA's): each
    document of the flat (tokens, heads, dim) inputs attends keys within (left, right) of each query,
    −1 meaning unbounded on that side, so the default (−1, −1) attends both ways."""
    out = torch.empty_like(q)
    left, right = window_size
    for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        at = torch.arange(end - start)
        mask = torch.ones(end - start, end - start, dtype=torch.bool)
        if left >= 0:
            mask &= at[None, :] >= at[:, None] - left
        if right >= 0:
            mask &= at[None, :] <= at[:, None] + right
        part = [t[start:end].transpose(0, 1) for t in (q, k, v)]
        out[start:end] = F.scaled_dot_product_attention(
            *part, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        ).transpose(0, 1)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_varlen_path_asks_the_kernel_for_causal_windows(family, monkeypatch):
    """The varlen path's layout, bounds and window arguments, with PyTorch's kernel stood in by its
    documented contract (it runs on CUDA only): a packed row scores as eager attention scores each
    sample alone. Without an explicit causal window the kernel attends both ways."""
    import inspect

    import transformers
    from torch.nn.attention.varlen import varlen_attn

    from meshrl.trainer import attention

    monkeypatch.setattr(
        attention, "_varlen", lambda: (_flash_varlen_contract, set(inspect.signature(varlen_attn).parameters))
    )
    monkeypatch.setattr(attention, "HALF", (torch.float32,))  # the flash path for float32 tensors here
    called, varlen = [], attention.varlen_documents
    monkeypatch.setattr(attention, "varlen_documents", lambda *a: called.append(1) or varlen(*a))
    config_class, extra = FAMILIES[family]
    model = _small(getattr(transformers, config_class), **extra)
    lengths = [16, 3, 11]
    ids = torch.randint(0, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        alone = torch.cat([model(part).logits for part in ids.split(lengths, dim=1)], dim=1)
        use_document_attention(model, "varlen")
        packed = model(ids, position_ids=torch.cat([torch.arange(n) for n in lengths])[None]).logits
    assert called
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_the_documents_are_found_once_per_micro_batch_and_laid_end_to_end():
    """The bounds every layer attends within: found once for a forward's position ids (not per layer),
    as the varlen kernel takes them (one cumulative list over the rows), and as FlexAttention's mask
    reads them (a document index per token)."""
    from meshrl.trainer.attention import documents

    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    found = documents(positions, 2)
    assert documents(positions, 2) is found
    assert found.spans == [[(0, 3), (3, 5), (5, 6)], [(0, 4), (4, 6)]]
    assert found.cu_seqlens.tolist() == [0, 3, 5, 6, 10, 12] and found.cu_seqlens.dtype == torch.int32
    assert found.max_length == 4 and not found.one_each
    assert found.ids.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 1, 1]]
    one_row = documents(torch.arange(5)[None], 3)  # one row's position ids broadcast over three rows
    assert one_row.one_each and one_row.cu_seqlens.tolist() == [0, 5, 10, 15]


def test_a_kernel_the_device_cannot_run_is_refused_naming_the_key():
    from meshrl.trainer.attention import attention_kernel

    cpu = torch.device("cpu")
    assert attention_kernel("auto", cpu) == "sdpa"
    for kernel in ("varlen", "flex"):
        with pytest.raises(ValueError, match=f"trainer.attention = '{kernel}' needs a CUDA device"):
            attention_kernel(kernel, cpu)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_attention_that_sdpa_cannot_compute_is_refused_naming_it(family):
    """Soft-capped attention logits (Gemma 2) and attention sinks (gpt-oss) are not plain attention:
    the trainer refuses such a model when it is set up rather than score another policy."""
    from transformers import Gemma2Config, GptOssConfig

    if family == "gemma2":
        model, match = _small(Gemma2Config, query_pre_attn_scalar=8), r"attn_logit_softcapping = 50.0"
    else:
        model, match = _small(GptOssConfig, num_local_experts=2, num_experts_per_tok=1), "attention sinks"
    with pytest.raises(ValueError, match=rf"model.path: a {family} model .*{match}"):
        use_document_attention(model)
