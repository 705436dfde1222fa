"""GPU checks on a Qwen3-0.6B-shaped model with random weights, one process, one GPU.

    python benchmarks/gpu_checks.py [--seq 4096 8192 16384] [--steps 3] [--ac full none] [--packed 2048]
                                    [--attention auto sdpa flex varlen] [--compile] [--lora R] [--small]

1. `TrainerCore` in bf16 (float32 master weights, autocast), one RL row of each `--seq` length per
   step, under each `--ac` (`trainer.activation_checkpointing`) and `--attention` (`trainer.attention`,
   the packed rows' kernel), and with `--compile` also compiled (`trainer.compile`): tokens/s, MFU and
   peak GPU memory;
   with `--packed N`, also a row of N-token samples (position ids restarting: the trainer attends
   them document by document), whose MFU counts attention over N-token documents. MFU is printed in two
   conventions: PRIME-RL's (6·N·tokens + 12·layers·d_model·seq, N with the embedding; its
   benchmark table gives Qwen3-0.6B 11.9k tokens/s at 11.1% MFU on one H100 at seq 16384,
   with activation recomputation and FlashAttention 3) and torchtitan's (6·N without the
   embedding + 12·layers·heads·head_dim·seq). `--lora R` repeats it with `model.lora` (rank R,
   alpha 2R, every linear layer) in the same process: its peak memory and tokens/s beside full
   weights' (MFU counts the full model's FLOPs, as a LoRA step still runs the whole model).
2. bf16 against float32 next-token distributions (the trainer's trunk and head): autocast over
   float32 weights (the trainer's way) and a bf16 copy of the weights (the HF engine's way).
3. The HF engines' sampled tokens/s in bf16 (`generate`, T 1.0): its own decode loop (`rows`) and
   transformers' continuous batching (`continuous`), each against transformers' own `generate` on
   the same batch.

Random weights give near-uniform next-token distributions (entropy close to log V); the parity
check also runs with the logits scaled by 8 (the final norm's weight), nearer a trained model's
entropy. Neither is a trained model: the numbers describe bf16 rounding, not SmolLM2's.
`--small` shrinks the model so the script can be checked on a CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from meshrl.configs import load_config
from meshrl.inference.hf_continuous import PAGE, ContinuousHFEngine
from meshrl.inference.hf_engine import HFEngine
from meshrl.loss_adapters.logprobs import hidden_states, lm_head_weight, sequence_token_logprobs
from meshrl.trainer.core import TrainerCore

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s, from the vendors' sheets
EOS = 151645  # Qwen3's <|im_end|>


def qwen3_config(small: bool) -> Qwen3Config:
    """Qwen3-0.6B's shape: 28 layers, d_model 1024, 16 query / 8 KV heads of 128, tied embedding."""
    if small:
        return Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                           max_position_embeddings=32768, eos_token_id=3, pad_token_id=0)  # fmt: skip
    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       max_position_embeddings=40960, rope_theta=1_000_000.0, eos_token_id=EOS,
                       pad_token_id=151643)  # fmt: skip


def flops_per_token(config: Qwen3Config, seq: int) -> dict[str, float]:
    params = (
        config.vocab_size * config.hidden_size
        + config.num_hidden_layers
        * (
            config.hidden_size * config.head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
            + 3 * config.hidden_size * config.intermediate_size
            + 2 * config.hidden_size
            + 2 * config.head_dim
        )
        + config.hidden_size
    )
    body = params - config.vocab_size * config.hidden_size
    layers = config.num_hidden_layers
    return {
        "prime-rl": 6 * params + 12 * layers * config.hidden_size * seq,
        "torchtitan": 6 * body + 12 * layers * config.num_attention_heads * config.head_dim * seq,
    }


def peak_flops() -> float:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((flops for key, flops in PEAK_BF16.items() if key in name), 989e12)


def synced() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def rl_batch(core: TrainerCore, seq: int, seed: int, sample: int) -> dict[str, torch.Tensor]:
    """One row of `seq` tokens holding samples of `sample` tokens (position ids restarting, as
    rollouts/packing.py packs them; `sample` = `seq`: one sample). Each sample's first eighth is
    prompt, the rest completion with on-policy logprobs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, core.model.config.vocab_size, (1, seq), generator=g)
    positions = torch.arange(seq) % sample
    mask = (positions >= sample // 8)[None]
    batch = {"input_ids": ids, "loss_mask": mask, "advantages": torch.randn(1, seq, generator=g) * mask,
             "position_ids": positions[None]}  # fmt: skip
    with torch.no_grad(), core._autocast():
        logprobs = sequence_token_logprobs(core.model, ids.to(core.device), core.config.model.logprob_chunk_size,
                                           core.config.generator.temperature,
                                           position_ids=batch["position_ids"].to(core.device))  # fmt: skip
    batch["inference_logprobs"] = logprobs.float().cpu() * mask
    return {k: v.to(core.device) for k, v in batch.items()}


def trainer(path: Path, model_config: Qwen3Config, args: argparse.Namespace, device: str) -> None:
    """One fresh core per arm: full weights under each `--ac` mode of `trainer.activation_checkpointing`,
    then (with `--lora` > 0) LoRA adapters of that rank. Each sequence length runs as one sample and,
    with `--packed N`, as a row of N-token samples."""
    arms = {
        f"full ac={ac} attn={attention}" + (" compiled" if compiled else ""): [
            "--trainer.activation_checkpointing", ac, "--trainer.attention", attention,
            "--trainer.compile", str(compiled).lower(),
        ]
        for ac in args.ac for attention in args.attention
        for compiled in [False] + [True] * (args.compile and ac != "selective")  # compile refuses selective
    }  # fmt: skip
    if args.lora:
        arms[f"lora r={args.lora} ac={args.ac[0]}"] = [
            "--trainer.activation_checkpointing", args.ac[0],
            "--model.lora", json.dumps({"r": args.lora, "lora_alpha": 2 * args.lora}),
        ]  # fmt: skip
    for name, overrides in arms.items():
        core = TrainerCore(load_config(["--model.dtype", "bfloat16", *overrides]), str(path), device=device)
        trained = sum(p.numel() for p in core.trainable)
        print(f"trainer {name}: {trained:,} trained parameters, {core.checkpointed_layers} layers checkpointed",
              flush=True)  # fmt: skip
        for seq in args.seq:
            for sample in [seq] + ([args.packed] if args.packed and args.packed < seq else []):
                row = f"{name} seq {seq:>6}" + (f" packed {seq // sample}x{sample}" if sample < seq else "")
                try:
                    step_report(core, model_config, seq, sample, args.steps, device, row)
                except torch.OutOfMemoryError as exc:
                    print(f"trainer {row}: out of memory ({str(exc).splitlines()[0]})", flush=True)
                if device == "cuda":
                    torch.cuda.empty_cache()
        del core
        if device == "cuda":
            torch.cuda.empty_cache()


def step_report(core: TrainerCore, model_config: Qwen3Config, seq: int, sample: int, steps: int, device: str,
                row: str) -> None:  # fmt: skip
    """Warm-up step, then the median of `steps` timed steps on one row of `seq` tokens."""
    batch = rl_batch(core, seq, seed=seq, sample=sample)
    rl_tokens = int(batch["loss_mask"].sum())
    core.train_step([[batch]], [None], rl_tokens)  # warm-up: kernels, allocator, AdamW state
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = synced()
        metrics = core.train_step([[batch]], [None], rl_tokens)
        times.append(synced() - start)
    step_s = statistics.median(times)
    rate = seq / step_s
    mfu = {name: rate * f / peak_flops() for name, f in flops_per_token(model_config, sample).items()}
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    print(f"trainer {row}: {step_s:.3f} s/step, {rate:,.0f} tokens/s, MFU {mfu['prime-rl']:.1%} "
          f"(PRIME-RL's formula) / {mfu['torchtitan']:.1%} (torchtitan's), peak {peak:.1f} GiB, "
          f"loss {metrics['loss/total']:.4f}, grad_norm {metrics['grad_norm']:.3f}", flush=True)  # fmt: skip


def full_log_softmax(model: torch.nn.Module, ids: torch.Tensor, chunk: int = 512) -> list[torch.Tensor]:
    """Float32 log-softmax over the vocabulary at every position, in chunks of positions."""
    hidden = hidden_states(model, ids).flatten(0, 1)
    head = lm_head_weight(model)
    return [(h @ head.T.to(h.dtype)).float().log_softmax(-1) for h in hidden.split(chunk)]


def parity(path: Path, seq: int, device: str, sharpen: float) -> None:
    """bf16 against float32 over whole next-token distributions: the exact KL(float32 || bf16)
    per position, and |Δ logprob| of a token sampled from the float32 distribution there.

    `sharpen` scales the final norm's weight, so the logits: random weights give near-uniform
    distributions, a scale of 8 brings the entropy nearer a trained model's."""
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(sharpen)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=g).to(device)
    with torch.no_grad():
        exact = full_log_softmax(model, ids)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            autocast = full_log_softmax(model, ids)
        bf16 = full_log_softmax(model.to(torch.bfloat16), ids)
        picks = [torch.multinomial(e.exp(), 1, generator=torch.Generator(device).manual_seed(3)) for e in exact]
        entropy = torch.cat([-(e.exp() * e).sum(-1) for e in exact]).mean()
        print(f"parity, logits x{sharpen:g}: {seq} positions, mean entropy {entropy:.2f} nats "
              f"(log V = {math.log(model.config.vocab_size):.2f})")  # fmt: skip
        for name, lows in (("autocast over float32 weights", autocast), ("bf16 weights", bf16)):
            kl = torch.cat([(e.exp() * (e - low)).sum(-1) for e, low in zip(exact, lows)])
            diff = torch.cat(
                [(low.gather(-1, p) - e.gather(-1, p)).squeeze(-1) for e, low, p in zip(exact, lows, picks)]
            )
            print(f"parity {name}: KL mean {kl.mean():.2e} max {kl.max():.2e}; sampled token |Δ logprob| "
                  f"mean {diff.abs().mean():.2e} max {diff.abs().max():.2e}", flush=True)  # fmt: skip
    del model


def engine(path: Path, prompts: int, prompt_len: int, new_tokens: int, device: str) -> None:
    """Each HF engine (`generator.hf_batching` rows and continuous) sampling `prompts` prompts, against
    transformers' own `generate` on the same batch."""
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    g = torch.Generator().manual_seed(2)
    batch = [torch.randint(0, model.config.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    ids = torch.tensor(batch, device=device)
    start = synced()  # the baseline: transformers' own generate, same batch, every row `new_tokens` long
    out = model.generate(ids, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, attention_mask=torch.ones_like(ids))  # fmt: skip
    baseline = (out.shape[0] * (out.shape[1] - prompt_len)) / (synced() - start)
    kv_tokens = prompts * math.ceil((prompt_len + new_tokens) / PAGE) * PAGE  # whole pages per request
    for name, hf in (("rows", HFEngine(model, [model.config.eos_token_id])),
                     ("continuous", ContinuousHFEngine(model, [model.config.eos_token_id], kv_tokens=kv_tokens))):  # fmt: skip
        hf.generate(batch[:2], temperature=1.0, top_p=1.0, max_new_tokens=8, seed=0)  # warm-up
        start = synced()
        turns = hf.generate(batch, temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, seed=1)
        seconds = synced() - start
        sampled = sum(len(t.completion_ids) for t in turns)
        print(f"engine {name}: {prompts} prompts x {prompt_len} tokens, {sampled} sampled in {seconds:.1f} s: "
              f"{sampled / seconds:,.0f} sampled tokens/s (bf16, T 1.0); transformers' generate "
              f"{baseline:,.0f} tokens/s; ratio {sampled / seconds / baseline:.2f}", flush=True)  # fmt: skip
        hf.close()
    del model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--lora", type=int, default=0, help="also a LoRA arm of this rank (0: full weights only)")
    parser.add_argument(
        "--ac",
        nargs="+",
        default=["full", "none"],
        choices=["none", "full", "selective"],
        help="trainer.activation_checkpointing of each full-weights arm (LoRA takes the first)",
    )
    parser.add_argument(
        "--attention",
        nargs="+",
        default=["auto"],
        choices=["auto", "sdpa", "flex", "varlen"],
        help="trainer.attention of each full-weights arm (a packed row's kernel; auto: varlen on a CUDA card)",
    )
    parser.add_argument("--compile", action="store_true", help="each full-weights arm also with trainer.compile")
    parser.add_argument(
        "--packed",
        type=int,
        default=0,
        help="also a packed row of samples of this many tokens at each --seq (0: one sample only)",
    )
    parser.add_argument("--small", action="store_true", help="a tiny model of the same family, for a CPU check")
    parser.add_argument("--skip", nargs="*", default=[], choices=["trainer", "parity", "engine"])
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}")
    config = qwen3_config(args.small)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        torch.manual_seed(0)
        with torch.device(device):
            Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp)
        print(f"built {config.num_hidden_layers}-layer Qwen3 ({time.perf_counter() - start:.0f} s)", flush=True)
        if "trainer" not in args.skip:
            trainer(Path(tmp), config, args, device)
        if "parity" not in args.skip:
            for sharpen in (1.0, 8.0):
                parity(Path(tmp), min(args.seq), device, sharpen)
        if "engine" not in args.skip:
            for prompts in args.prompts:
                engine(Path(tmp), prompts, 128, args.new_tokens, device)


if __name__ == "__main__":
    main()
