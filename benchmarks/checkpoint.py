"""A checkpoint's cost on the training critical path: the whole synchronous save (snapshot,
write, fsync) against the snapshot alone (what a step waits for since the write moved to a
background thread), one TrainerCore, same process.

    python benchmarks/checkpoint.py [--hidden-size 1024] [--num-layers 8] [--repeats 3]

The model is a locally built tiny Llama of that shape with a DPO reference (as the embedded
default trains), after one optimizer step so AdamW's moments exist.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from meshrl.configs import load_config
from meshrl.models.tiny import ensure_tiny
from meshrl.trainer.core import TrainerCore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = load_config([
        "--model.tiny.hidden_size", str(args.hidden_size), "--model.tiny.num_layers", str(args.num_layers),
        "--model.tiny.num_heads", str(max(1, args.hidden_size // 64)), "--loss.replay.weight", "0.1",
    ])  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        core = TrainerCore(config, str(ensure_tiny(Path(tmp) / "model", config.model.tiny)))
        params = sum(p.numel() for p in core.model.parameters())
        ids = torch.arange(1, 9)[None]
        core.sft_step([{"input_ids": ids, "loss_mask": torch.ones_like(ids)}])
        sync, snapshot, background = [], [], []
        for i in range(args.repeats):
            start = time.perf_counter()
            core.save(Path(tmp) / f"sync_{i}", wait=True)
            sync.append(time.perf_counter() - start)
            start = time.perf_counter()
            core.save(Path(tmp) / f"async_{i}", wait=False)
            snapshot.append(time.perf_counter() - start)
            core.checkpoint_written(wait=True)
            background.append(time.perf_counter() - start)
    print(f"model: {params / 1e6:.1f} M parameters (float32 masters, AdamW moments, DPO reference)")
    s, a, b = statistics.median(sync), statistics.median(snapshot), statistics.median(background)
    print(
        f"synchronous save {s:.3f} s | snapshot (critical path now) {a:.3f} s | background write done after {b:.3f} s"
    )
    print(f"critical path: {a / s:.2f} of the synchronous save")


if __name__ == "__main__":
    main()
