"""The sandbox's cost: a trivial program through `meshrl.sandbox` against a plain `subprocess.run`
of the same program with the same interpreter, in one process.

    python benchmarks/sandbox.py [--backend bwrap] [--calls 200]

Prints per-call latency p50/p99 (one call at a time) and calls/s with 1, 4 and 16 concurrent
callers (the pool as large as the callers), and each sandbox number's ratio to the plain one.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from meshrl.configs.schema import SandboxConfig
from meshrl.sandbox import make_sandbox

PROGRAM = "print(sum(range(1000)))"


def latencies(call: Callable[[], None], n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        out.append(time.perf_counter() - start)
    return out


def throughput(call: Callable[[], None], n: int, callers: int) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(callers) as pool:
        list(pool.map(lambda _: call(), range(n)))
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="bwrap", choices=["bwrap", "docker", "none"])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    config = SandboxConfig(backend=args.backend, pool_size=16)
    box = make_sandbox(config)
    program = Path(tempfile.mkdtemp()) / "main.py"
    program.write_text(PROGRAM)

    def plain() -> None:
        done = subprocess.run([config.python, "-s", str(program)], capture_output=True, timeout=10, check=True)
        assert done.stdout == b"499500\n"

    def sandboxed() -> None:
        run = box.run_python(PROGRAM)
        assert run.ok and run.stdout == "499500\n", run.report()

    base, boxed = latencies(plain, args.calls), latencies(sandboxed, args.calls)
    for name, fn in (("p50", statistics.median), ("p99", lambda xs: statistics.quantiles(xs, n=100)[98])):
        print(f"latency {name}: plain {fn(base) * 1e3:.1f} ms, sandbox {fn(boxed) * 1e3:.1f} ms "
              f"({fn(boxed) / fn(base):.2f}x)")  # fmt: skip
    for callers in (1, 4, 16):
        a, b = throughput(plain, args.calls, callers), throughput(sandboxed, args.calls, callers)
        print(f"{callers:>2} concurrent: plain {a:.0f} calls/s, sandbox {b:.0f} calls/s ({b / a:.2f}x)")
    box.close()


if __name__ == "__main__":
    main()
