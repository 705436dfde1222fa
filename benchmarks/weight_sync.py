"""Weight sync per step: pickled tensors vs the trainer's RDMA buffer vs a safetensors file on
disk (PRIME-RL's filesystem path), same model, one process, through the real meshes.

    python benchmarks/weight_sync.py [--syncs 10] [--hidden-size 1024] [--num-layers 8] [--dotted.overrides ...]

Each mode spawns the embedded default's meshes (one trainer, one generator) on a locally built
tiny Llama of the given width and depth, then times `WeightPublisher.publish(v, wait=True)`: from the
controller asking the trainer for version v until the generator has it loaded in its engine.
Medians over the syncs after the first two (the RDMA buffer is registered on the first).
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from pathlib import Path

from safetensors import safe_open

from meshrl.configs import load_config
from meshrl.models.tiny import ensure_tiny
from meshrl.run.controller import Controller
from meshrl.trainer.core import DTYPES

MODES = ("tensors", "rdma", "filesystem")


def time_syncs(base: list[str], mode: str, out: Path, syncs: int) -> list[float]:
    config = load_config([*base, "--generator.weight_sync", mode, "--output-dir", str(out)])
    controller = Controller(config)
    controller.spawn()
    try:
        return [controller.weights.publish(version, wait=True) for version in range(syncs)]
    finally:
        controller.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--syncs", type=int, default=10)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=8)
    args, rest = parser.parse_known_args()
    shape = ["--model.tiny.hidden_size", str(args.hidden_size), "--model.tiny.num_layers", str(args.num_layers),
             "--model.tiny.num_heads", str(max(1, args.hidden_size // 64))]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(["@", "configs/local.toml", *shape, *rest])
        model = ensure_tiny(Path(tmp) / "model", config.model.tiny, seed=config.seed)
        with safe_open(model / "model.safetensors", "pt") as f:
            params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
        base = ["@", "configs/local.toml", *shape, *rest, "--model.path", str(model), "--trainer.warm_start_steps", "0"]
        results = {mode: time_syncs(base, mode, Path(tmp) / mode, args.syncs)[2:] for mode in MODES}
    megabytes = params * DTYPES[config.model.dtype].itemsize / 2**20
    print(f"model: {params / 1e6:.1f} M parameters, {megabytes:.0f} MB in {config.model.dtype} per sync")
    baseline = statistics.median(results["tensors"])
    print(f"{'weight_sync':<12}{'median s':>10}{'min s':>9}{'max s':>9}{'MB/s':>9}{'vs tensors':>12}")
    for mode, times in results.items():
        median = statistics.median(times)
        print(f"{mode:<12}{median:10.3f}{min(times):9.3f}{max(times):9.3f}{megabytes / median:9.0f}"
              f"{median / baseline:12.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
