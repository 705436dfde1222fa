"""Routing replay on the tiny mixture of experts: what it removes, what it costs, and whether a run learns.

    python benchmarks/routing_replay.py mismatch [--prompts 64 --new-tokens 48 --steps 4]
    python benchmarks/routing_replay.py runs [--seeds 0 1 2] [--out runs/routing_replay]

`mismatch`: the HF engine samples rollouts from the tiny Qwen3-MoE in bf16, recording each token's
experts; the trainer (float32 master weights, TrainerCore) scores the same tokens with its own routing
and with the recorded routing replayed, on the sampler's weights (only the numerics differ: bf16 with a
KV cache against a float32 full forward, or bf16 autocast) and after `--steps` RL steps on other
rollouts (off policy by that many versions). Per setting it prints the routing drift (the share of
token × layer whose own top-k is not the recorded one), the training-inference mismatch KL (r − log r − 1
over the sampled tokens, r = p_train / p_sample, as the losses report it), its free / replayed ratio,
and the time of a trainer forward + backward with and without replay (in this process, back to back).

`runs`: `meshrl train @ configs/local.toml --model.dtype bfloat16` (sampler and trainer numerics differ)
for the dense tiny model, the MoE (4 experts, top-2) with routing replay (the default) and without it, per seed;
prints each run's mean reward over its last quarter of RL steps, its mean routing drift and mismatch KL,
and its mean trainer step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MOE = ["--model.tiny.family", "qwen3_moe", "--model.tiny.experts_per_token", "2", "--model.tiny.num_experts"]
# The runs' MoE has 4 experts: with 8, the 800 warm-start steps did not teach it the task (RL began at
# reward 0.10, the dense model at 0.55) and neither MoE arm learned, with replay or without.
RUN_MOE = [*MOE, "4"]
ARMS = {"dense": [], "moe_replay": RUN_MOE, "moe_free": [*RUN_MOE, "--trainer.routing_replay", "false"]}


def mismatch(args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    from meshrl.configs import load_config
    from meshrl.inference.hf_engine import HFEngine
    from meshrl.models.tiny import ensure_tiny
    from meshrl.rollouts.batches import rl_shards
    from meshrl.rollouts.episodes import Rollout
    from meshrl.tasks.base import Prompt
    from meshrl.trainer.core import TrainerCore

    torch.manual_seed(0)
    config = load_config([*MOE, "8", "--model.tiny.num_layers", "4"])
    path = str(ensure_tiny(Path(args.out) / "model", config.model.tiny))
    sampler = HFEngine.from_pretrained(path, dtype="bfloat16", record_routing=True)
    g = torch.Generator().manual_seed(0)
    vocab = sampler.model.config.vocab_size
    prompts = [torch.randint(3, vocab, (16,), generator=g).tolist() for _ in range(args.prompts)]

    def sample(seed: int) -> list[Rollout]:
        turns = sampler.generate(prompts, temperature=1.0, top_p=1.0, max_new_tokens=args.new_tokens, seed=seed)
        return [
            Rollout(Prompt(str(i), []), [], p + t.completion_ids, [False] * len(p) + [True] * len(t.completion_ids),
                    [0.0] * len(p) + t.logprobs, t.versions, routing=t.routing)
            for i, (p, t) in enumerate(zip(prompts, turns))
        ]  # fmt: skip

    rollouts = sample(0)
    record = rollouts[0].routing
    print(f"record: {record.shape[1]} MoE layers x top-{record.shape[2]}, {record.dtype}: "
          f"{record.shape[1] * record.shape[2] * record.itemsize} bytes a token")  # fmt: skip
    batches = rl_shards(rollouts, [1.0] * len(rollouts), 4096, 0, 1).shards[0]
    for dtype in ("float32", "bfloat16"):
        core = TrainerCore(load_config([*MOE, "8", "--model.tiny.num_layers", "4", "--model.dtype", dtype]), path)
        for steps in (0, args.steps):
            if steps:  # RL steps on other rollouts, recorded at the same weights: the trainer moves on
                for seed in range(1, steps + 1):
                    other = sample(seed)
                    shards = rl_shards(other, [(-1.0) ** i for i in range(len(other))], 4096, 0, 1)
                    core.train_step(shards.shards, [None], shards.tokens)
            row = measure(core, batches, np)
            print(f"trainer {dtype:8s} {steps} steps off: drift {row['drift']:.4f} | mismatch KL free "
                  f"{row['free']:.3g} replayed {row['replayed']:.3g} ({row['free'] / row['replayed']:.2f}x) | "
                  f"forward+backward {row['time_free'] * 1e3:.0f} ms free, {row['time_replayed'] * 1e3:.0f} ms "
                  f"replayed ({row['time_replayed'] / row['time_free']:.2f}x)")  # fmt: skip


def measure(core, batches: list[dict], np) -> dict[str, float]:
    """Drift and mismatch KL over `batches`, free and replayed, and a forward + backward's time each way."""
    import torch

    from meshrl.loss_adapters.logprobs import sequence_token_logprobs
    from meshrl.models.routing import RoutingRecorder, moe_routers

    recorder = RoutingRecorder(moe_routers(core.model))  # after replay's hooks: the routing each forward used
    kls: dict[str, list[float]] = {"free": [], "replayed": []}
    times: dict[str, list[float]] = {"free": [], "replayed": []}
    drifted = counted = 0
    for batch in batches:
        mask, sampled = batch["loss_mask"], batch["inference_logprobs"]
        for mode in ("free", "replayed"):
            routed = batch["routed_experts"] if mode == "replayed" else None
            kwargs = {"position_ids": batch["position_ids"], "routed_experts": routed}
            with core._autocast(), torch.no_grad():
                logprobs = sequence_token_logprobs(core.model, batch["input_ids"], 1024, 1.0, mask, **kwargs)
            used = recorder.take(*batch["input_ids"].shape)
            if mode == "free":
                known = (batch["routed_experts"].numpy() < 8).all(-1)
                own = np.sort(used, -1) != np.sort(batch["routed_experts"].numpy(), -1)
                drifted += int((own.any(-1) & known).sum())
                counted += int(known.sum())
            log_ratio = (logprobs.float() - sampled)[mask]
            kls[mode].append(float((log_ratio.exp() - log_ratio - 1).mean()))
            start = time.perf_counter()
            with core._autocast():
                sequence_token_logprobs(core.model, batch["input_ids"], 1024, 1.0, mask, **kwargs).sum().backward()
            times[mode].append(time.perf_counter() - start)
            recorder.take(*batch["input_ids"].shape)
            core.model.zero_grad(set_to_none=True)
    return {"drift": drifted / counted, **{k: statistics.fmean(v) for k, v in kls.items()},
            **{f"time_{k}": sum(v) for k, v in times.items()}}  # fmt: skip


def runs(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        for arm, extra in ARMS.items():
            run_dir = out / f"{arm}_seed{seed}"
            if not (args.reuse and (run_dir / "final").is_dir()):
                command = [sys.executable, "-m", "meshrl.cli.main", "train", "@", str(REPO / "configs" / "local.toml"),
                           "--model.dtype", "bfloat16", "--seed", str(seed), "--output-dir", str(run_dir), "--overwrite",
                           "--metrics.progress", "plain", *extra]  # fmt: skip
                with (out / f"{arm}_seed{seed}.log").open("w") as log:
                    subprocess.run(command, cwd=REPO, stdout=log, stderr=log, check=True,
                                   env={**os.environ, "RUST_LOG": "warn"})  # fmt: skip
            print(summary(arm, seed, run_dir), flush=True)


def summary(arm: str, seed: int, run_dir: Path) -> str:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase") != "warm_start"]
    last = rl[-max(1, len(rl) // 4) :]

    def mean(key: str, among: list[dict]) -> float:
        values = [r[key] for r in among if isinstance(r.get(key), (int, float))]
        return statistics.fmean(values) if values else float("nan")

    kl = "unmasked_mismatch_kl" if any("unmasked_mismatch_kl" in r for r in rl) else "mismatch_kl"
    return (f"{arm:10s} seed {seed}: reward first quarter {mean('reward/mean', rl[: len(last)]):.3f}, last quarter "
            f"{mean('reward/mean', last):.3f} | routing drift {mean('moe/routing_drift', rl):.4f} | {kl} "
            f"{mean(kl, rl):.3g} | time/train {mean('time/train', rl):.3f} s")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["mismatch", "runs"])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--steps", type=int, default=4, help="mismatch: RL steps the trainer moves on")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="runs/routing_replay")
    parser.add_argument("--reuse", action="store_true", help="runs: keep finished runs in OUT")
    args = parser.parse_args()
    (mismatch if args.what == "mismatch" else runs)(args)


if __name__ == "__main__":
    main()
