"""Chunked vs naive token logprobs (forward + backward) in one process: peak memory and time.

    python benchmarks/chunked_logprobs.py [--tokens 4096] [--vocab 32000] [--hidden 512] [--device cpu]

Peak memory is measured above a baseline taken after the inputs exist: on CUDA from the
allocator's peak counter, on CPU from the process's resident set sampled every 0.2 ms
(PyTorch's CPU allocator hands large blocks back to the OS, so RSS tracks live tensors).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import torch

from meshrl.loss_adapters.logprobs import chunked_token_logprobs, naive_token_logprobs

PAGE = 4096


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def peak_bytes(fn: Callable[[], None], device: torch.device) -> int:
    """Peak memory above the level before `fn` ran."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    base, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], _rss()) - base


def seconds(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    device = torch.device(args.device)
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device=device, requires_grad=True)
    weight = (torch.randn(args.vocab, args.hidden, device=device) * args.hidden**-0.5).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), device=device)
    upstream = torch.randn(args.tokens, device=device)

    def run(logprobs: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            hidden.grad = weight.grad = None
            (logprobs() * upstream).sum().backward()

        return step

    variants = {
        "naive": run(lambda: naive_token_logprobs(hidden, weight, labels)),
        "chunked": run(lambda: chunked_token_logprobs(hidden, weight, labels, args.chunk_size)),
    }
    for step in variants.values():  # warm-up (allocator, kernels, threads)
        step()
    results = {}
    for name, step in variants.items():
        hidden.grad = weight.grad = None
        results[name] = (peak_bytes(step, device), seconds(step, device, args.repeats))

    print(f"T={args.tokens} V={args.vocab} H={args.hidden} chunk={args.chunk_size} device={device} "
          f"threads={torch.get_num_threads()}")  # fmt: skip
    for name, (peak, secs) in results.items():
        print(f"{name:>8}: peak {peak / 2**20:8.1f} MiB   fwd+bwd {secs * 1000:8.1f} ms")
    (naive_peak, naive_s), (chunk_peak, chunk_s) = results["naive"], results["chunked"]
    print(f"   ratio: peak {chunk_peak / naive_peak:.3f} of naive (goal ≤ 0.25)   "
          f"time {chunk_s / naive_s:.3f}× naive (goal ≤ 1.3)")  # fmt: skip


if __name__ == "__main__":
    main()
