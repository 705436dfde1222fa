"""TraceCollator throughput against its limit, in one process.

    python benchmarks/collator_throughput.py [--traces 1000] [--repeats 3]

The limit is the same tokenizer batch-encoding every turn's text once (no template, no
masks): a collator cannot be faster than tokenizing what it is given. Both run on the same
synthetic multi-turn agent traces (tool calls, tool errors, recoveries) and the locally
built tiny tokenizer.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from meshrl.models.tiny import build_tokenizer
from meshrl.traces.collator import TraceCollator
from meshrl.traces.schema import TraceExample

WORDS = "the test file error run fix import path value python bash command output check install module".split()


def synthetic_traces(n: int, seed: int = 0) -> list[TraceExample]:
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    traces = []
    for i in range(n):
        turns = [{"role": "system", "content": "You are a coding agent. " + say(20)},
                 {"role": "user", "content": say(rng.randint(10, 60))}]  # fmt: skip
        for step in range(rng.randint(3, 10)):
            call = {"id": f"c{step}", "name": rng.choice(["bash", "read", "edit"]), "arguments": {"cmd": say(6)}}
            turns.append({"role": "assistant", "content": say(rng.randint(5, 40)), "tool_calls": [call]})
            failed = rng.random() < 0.3
            turns.append({"role": "tool", "content": ("error: " if failed else "") + say(rng.randint(10, 80)),
                          "tool_call_id": call["id"], "is_error": failed or None})  # fmt: skip
            if failed:
                turns.append({"role": "assistant", "content": "Recovering: " + say(rng.randint(5, 30)),
                              "tool_error": "tool_error", "error_meta": {"tool_name": call["name"], "excerpt": "error"}})  # fmt: skip
        turns.append({"role": "assistant", "content": say(rng.randint(5, 30))})
        traces.append(TraceExample(trace_id=str(i), source="synthetic", turns=turns, final_reward=rng.random()))
    return traces


def best_of(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    tok = build_tokenizer(512)
    traces = synthetic_traces(args.traces)
    turn_texts = [t.content for tr in traces for t in tr.turns]
    collate = TraceCollator(tok)
    collate_sdpo = TraceCollator(tok, hint_generator=lambda kind, meta: f"Hint: the {meta['tool_name']} call failed.")

    limit = best_of(lambda: tok(turn_texts, add_special_tokens=False), args.repeats)
    plain = best_of(lambda: collate(traces), args.repeats)
    sdpo = best_of(lambda: collate_sdpo(traces), args.repeats)
    print(f"{args.traces} traces, {len(turn_texts)} turns, {sum(map(len, turn_texts)) / 1e6:.2f} M chars")
    print(f"  limit (batch-encode turn texts): {args.traces / limit:8.0f} traces/s")
    print(
        f"  collator, RL/SFT rows:           {args.traces / plain:8.0f} traces/s   {limit / plain:.2f} of the limit (goal ≥ 0.5)"
    )
    print(f"  collator, + SDPO rows:           {args.traces / sdpo:8.0f} traces/s   {limit / sdpo:.2f} of the limit")


if __name__ == "__main__":
    main()
