"""Repository tasks: what a build tries and keeps, and what the sandbox costs per episode.

    python benchmarks/repo_tasks.py [--episodes 30] [--cache DIR]

1. Builds the default modules' tasks and the preset's repository sources into `--cache` (a fresh temporary one unless given) and prints,
   per module, the tests, mutation sites, mutations tried and kept and why the rest were dropped;
   FAIL_TO_PASS and PASS_TO_PASS tests per task.
2. Runs the scripted solution (the demonstrations' five turns) of `--episodes` training tasks in
   sandbox workspaces: each tool's latency, the sandbox time of an episode, the reward's time
   (the replay of the writes and the hidden tests), and the demonstration's length in tokens under
   the tiny model's tokenizer. The baseline, in the same process: an empty program in a fresh
   sandbox call against the same program in a workspace.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from meshrl.configs import load_config
from meshrl.configs.schema import TinyModelConfig
from meshrl.models.tiny import ensure_tiny, load_tokenizer
from meshrl.rollouts.episodes import cap_trace
from meshrl.tasks.base import Ending
from meshrl.tasks.repo.demos import solution_steps
from meshrl.tasks.repo.task import RepoFixTask

SANDBOX = {"backend": "bwrap", "pool_size": 4, "wall_time_s": 20.0, "cpu_time_s": 10}  # configs/repo_fix.toml's
MAX_TOOL_TOKENS = 512  # configs/repo_fix.toml's generator.max_tool_result_tokens
PRESET = Path(__file__).resolve().parent.parent / "configs" / "repo_fix.toml"


def median_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f} ms"


def build(cache: str) -> RepoFixTask:
    start = time.perf_counter()
    repos = load_config(["@", str(PRESET)]).task.kwargs.get("repos")  # the preset's PyPI source(s)
    task = RepoFixTask(cache_dir=cache, sandbox=SANDBOX, repos=repos)
    seconds = time.perf_counter() - start
    print(
        f"build: {len(task.tasks)} tasks ({len(task.split_ids)} train, {len(task.eval_ids)} held out) in {seconds:.0f} s"
    )
    print("module                  tests  sites  tried  kept  no test broke  no report (limit)")
    for s in task.build_stats:
        print(
            f"{s.module:<23} {s.tests:>5}  {s.sites:>5}  {s.tried:>5}  {s.kept:>4}  {s.no_test_broke:>13}  {s.no_report:>9}"
        )
    tried, kept = sum(s.tried for s in task.build_stats), sum(s.kept for s in task.build_stats)
    print(f"kept {kept} of {tried} tried ({kept / tried:.0%})")
    operators: dict[str, int] = defaultdict(int)
    for s in task.build_stats:
        for name, count in s.by_operator.items():
            operators[name] += count
    print("kept by operator:", dict(sorted(operators.items(), key=lambda kv: -kv[1])))
    f2p = [len(t.fail_to_pass) for t in task.tasks.values()]
    p2p = [len(t.pass_to_pass) for t in task.tasks.values()]
    print(f"FAIL_TO_PASS per task: median {statistics.median(f2p)}, max {max(f2p)}; "
          f"PASS_TO_PASS: median {statistics.median(p2p)}, max {max(p2p)}")  # fmt: skip
    return task


def episodes(task: RepoFixTask, n: int, tokenizer) -> None:
    fresh, inside = [], []
    workspace = task.sandbox.workspace({"a.py": ""})
    for _ in range(20):
        start = time.perf_counter()
        task.sandbox.run_python("pass")
        fresh.append(time.perf_counter() - start)
        start = time.perf_counter()
        task.sandbox.run_python("pass", workspace)
        inside.append(time.perf_counter() - start)
    workspace.close()
    print(f"baseline: an empty program {median_ms(fresh)} in a fresh call, {median_ms(inside)} in a workspace "
          f"({statistics.median(inside) / statistics.median(fresh):.2f}x)")  # fmt: skip
    by_tool: dict[str, list[float]] = defaultdict(list)
    sandbox_s, score_s, tokens, solved = [], [], [], 0
    for task_id in task.split_ids[:: max(1, len(task.split_ids) // n)][:n]:
        prompt = task.prompt(task_id)
        messages, spent = list(prompt.messages), 0.0
        for i, step in enumerate(solution_steps(task, task_id)):
            message = {"role": "assistant", "content": step.text}
            if step.name is None:
                messages.append(message)
                continue
            start = time.perf_counter()
            result = task.episode_call(f"bench-{task_id}", prompt, step.name, dict(step.arguments))
            took = time.perf_counter() - start
            spent += took
            by_tool["Bash (tests)" if step.name == "Bash" else step.name].append(took)
            call = {"id": f"c{i}", "type": "function", "function": {"name": step.name, "arguments": step.arguments}}
            messages += [message | {"tool_calls": [call]},
                         {"role": "tool", "content": result.content, "tool_call_id": f"c{i}"}]  # fmt: skip
        task.end_episode(f"bench-{task_id}")
        sandbox_s.append(spent)
        start = time.perf_counter()
        solved += task.score(prompt, messages, Ending("agent_completed", "stop")).reward == 1.0
        score_s.append(time.perf_counter() - start)
        ids = tokenizer.apply_chat_template(messages, tokenize=True)
        tokens.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))
    count = len(sandbox_s)
    print(f"{count} scripted episodes (5 turns, 4 tool calls), {solved} solved:")
    for name, values in by_tool.items():
        print(f"  {name:<13} median {median_ms(values)}, max {max(values) * 1000:.0f} ms")
    print(f"  sandbox time per episode: median {median_ms(sandbox_s)}; the reward (replay + hidden tests): "
          f"median {median_ms(score_s)}, max {max(score_s) * 1000:.0f} ms")  # fmt: skip
    capped = []
    for demo in task.demonstrations(random.Random(0), n):
        turns = cap_trace(demo, tokenizer, MAX_TOOL_TOKENS).turns
        ids = tokenizer.apply_chat_template([{"role": t.role, "content": t.content} for t in turns], tokenize=True)
        capped.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))
    print(f"  tokens per demonstration (tiny tokenizer, ChatML): median {statistics.median(tokens):.0f}, "
          f"max {max(tokens)}; with tool results capped at {MAX_TOOL_TOKENS} tokens as the preset trains them: "
          f"median {statistics.median(capped):.0f}, max {max(capped)}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=30)
    parser.add_argument("--cache", default=None, help="a build cache to reuse (default: a fresh one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        task = build(args.cache or str(Path(tmp) / "cache"))
        tokenizer = load_tokenizer(ensure_tiny(Path(tmp) / "tiny", TinyModelConfig()))
        episodes(task, args.episodes, tokenizer)


if __name__ == "__main__":
    main()
