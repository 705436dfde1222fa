"""Long rows on a CPU: a trainer step's peak memory and time against the row's length, per
`trainer.activation_checkpointing` mode, and a packed row against one sample of its length.

    python benchmarks/long_context.py [--seq 2048 4096 8192 16384] [--modes none full selective]
                                      [--packed 2048] [--model DIR]

A small Qwen3-shaped model (12 layers, d_model 256, 4/2 heads of 64, vocabulary 32000) with random
weights, float32, one RL row a step. Each measurement runs in a fresh process (glibc's mmap
threshold fixed at 64 KiB: `CHILD_ENV`): its peak resident memory during the step, less the peak of
a warm-up step on 256 tokens (weights, AdamW state, allocator), is what the row's length costs. Ratios are against `none` (no checkpointing) at the
same length, measured in the same run; `--packed N` adds a row of N-token samples (position ids
restarting), scored document by document, beside one sample of the row's length.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from meshrl.configs import load_config
from meshrl.trainer.core import TrainerCore

CONFIG = dict(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=12, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, tie_word_embeddings=True, max_position_embeddings=65536)  # fmt: skip


# glibc's malloc keeps freed blocks below its (growing) mmap threshold in the heap, so a process's
# peak RSS also counts memory already freed; a fixed 64 KiB threshold gives every tensor over that
# its own mapping, returned when it is freed, and the peak RSS is the tensors' peak.
CHILD_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}


def row(seq: int, sample: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(seq) % sample
    mask = (positions >= sample // 8)[None]
    return {"input_ids": torch.randint(0, vocab, (1, seq), generator=g), "loss_mask": mask,
            "advantages": torch.randn(1, seq, generator=g) * mask, "inference_logprobs": -torch.rand(1, seq) * mask,
            "position_ids": positions[None]}  # fmt: skip


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(path: str, mode: str, seq: int, sample: int) -> dict[str, float]:
    """One step's extra peak memory (MB) and seconds, in this process."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    core = TrainerCore(load_config(["--trainer.activation_checkpointing", mode]), path)
    vocab = core.model.config.vocab_size
    warm = row(256, 256, vocab)
    core.train_step([[warm]], [None], int(warm["loss_mask"].sum()))
    base = peak_mb()
    batch = row(seq, sample, vocab, seed=1)
    start = time.perf_counter()
    core.train_step([[batch]], [None], int(batch["loss_mask"].sum()))
    return {"seconds": time.perf_counter() - start, "peak_mb": peak_mb() - base}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--modes", nargs="+", default=["none", "full", "selective"])
    parser.add_argument("--packed", type=int, default=2048)
    parser.add_argument("--model", help="an HF model directory to measure instead of the 12-layer shape "
                        "(e.g. a run's tiny_model/, to size a preset's budget)")  # fmt: skip
    parser.add_argument("--one", nargs=4, help=argparse.SUPPRESS)  # path mode seq sample: a child's measurement
    args = parser.parse_args()
    if args.one:
        path, mode, seq, sample = args.one
        print(json.dumps(measure(path, mode, int(seq), int(sample))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        if args.model:
            tmp = args.model
        else:
            Qwen3ForCausalLM(Qwen3Config(**CONFIG)).save_pretrained(tmp)
        print(f"{'row':<28}{'mode':<11}{'s/step':>8}{'peak MB':>10}{'MB/1k tok':>11}{'memory vs none':>16}"
              f"{'time vs none':>14}", flush=True)  # fmt: skip
        for seq in args.seq:
            samples = [seq] + ([args.packed] if args.packed and args.packed < seq else [])
            for sample in samples:
                label = f"{seq} tokens" + (f", {seq // sample}x{sample} packed" if sample < seq else "")
                results = {}
                for mode in args.modes:
                    done = subprocess.run([sys.executable, __file__, "--one", tmp, mode, str(seq), str(sample)],
                                          capture_output=True, text=True, check=True, env=CHILD_ENV)  # fmt: skip
                    results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
                    r, none = results[mode], results.get("none", results[mode])
                    print(f"{label:<28}{mode:<11}{r['seconds']:>8.2f}{r['peak_mb']:>10.0f}"
                          f"{r['peak_mb'] / seq * 1000:>11.1f}{r['peak_mb'] / max(none['peak_mb'], 1):>16.2f}"
                          f"{r['seconds'] / none['seconds']:>14.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
