"""A fixed CPU probe, stdlib only, to put suite timings from different machines side by side.

VMs of one kind differ up to 3x in speed; a suite time means little without the machine's
speed measured beside it. Prints the best of 5 for a pure-Python loop and for SHA-256 over
64 MiB (one core each), so two runs on one machine can be checked to have had the same speed.
"""

import hashlib
import time


def _best(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    data = b"\x5a" * (64 << 20)
    loop_s = _best(lambda: sum(i * i for i in range(2_000_000)))
    sha_s = _best(lambda: hashlib.sha256(data).digest())
    print(
        f"cpu_speed: python loop 2e6 {loop_s * 1e3:.1f} ms, sha256 64 MiB {sha_s * 1e3:.1f} ms ({64 / sha_s:.0f} MiB/s)"
    )


if __name__ == "__main__":
    main()
