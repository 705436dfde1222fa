"""Evaluate a policy: a saved one (`meshrl eval --checkpoint`), or the training one every
`eval.interval` steps on a thread of the controller, beside training (it never waits for it)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from meshrl.configs.schema import RunConfig
from meshrl.inference.backends import make_engine
from meshrl.models.resolve import resolve_model
from meshrl.rollouts.chat import ChatSettings
from meshrl.rollouts.episodes import EpisodeFormat, EpisodeLimits, engine_limits
from meshrl.rollouts.evaluation import EvalPlan, EvalResult, eval_prompts, evaluate
from meshrl.rollouts.scheduler import Sampling
from meshrl.run.run_dir import RunDir, write_atomic
from meshrl.tasks.base import make_task


def model_dir(checkpoint: str | Path) -> Path:
    """An HF model directory from what a user names: a run directory (its newest complete
    checkpoint), a checkpoint directory (its model/), or a model directory (an export)."""
    path = Path(checkpoint)
    if (path / "config.toml").is_file() and not (path / "config.json").is_file():
        latest = RunDir(path).latest_checkpoint()
        if latest is None:
            raise ValueError(f"{path / 'checkpoints'}: no complete checkpoint to evaluate")
        path = latest
    if (path / "model" / "config.json").is_file():
        path = path / "model"
    if not (path / "config.json").is_file():
        raise ValueError(f"{checkpoint}: not a run, checkpoint or HF model directory (no config.json found)")
    return path


def plan_for(config: RunConfig) -> EvalPlan:
    g, e = config.generator, config.eval
    return EvalPlan(
        prompts=eval_prompts(make_task(config.task), e.n, config.seed),
        k=e.k,
        success_threshold=e.success_threshold,
        sampling=Sampling(g.temperature, g.top_p, g.max_new_tokens),
        max_episodes=g.max_concurrent_episodes,
        max_tokens=g.max_concurrent_tokens,
        seed=config.seed,
    )


def _episodes(config: RunConfig, path: str | Path) -> EpisodeFormat:
    tokenizer = AutoTokenizer.from_pretrained(path)
    return EpisodeFormat(tokenizer, make_task(config.task), ChatSettings.of(config.model), EpisodeLimits.of(config))


def evaluate_checkpoint(config: RunConfig, checkpoint: str | Path, out: Path | None = None) -> EvalResult:
    """Evaluate a saved model on this host (the first GPU if any, else the CPU) with the run's
    generator backend (vLLM's CPU build on a CPU host: 2.9x the HF engine's tokens/s on SmolLM2);
    the result is also written to `out` as JSON when given."""
    path = model_dir(checkpoint)
    gpus = [0] if torch.cuda.is_available() else []
    g = config.generator
    engine = make_engine(
        g.backend,
        str(path),
        config.model.dtype,
        gpus,
        engine_limits(config),
        g.vllm_log_level,
        g.hf_batching,
        config.seed,
    )
    result = evaluate(engine, _episodes(config, path), plan_for(config))
    if out is not None:
        _write(out, str(path), result)
    return result


def _write(out: Path, checkpoint: str, result: EvalResult) -> None:
    write_atomic(out, json.dumps({"checkpoint": checkpoint, **asdict(result), **result.metrics()}, indent=1) + "\n")


def evaluate_base(config: RunConfig, out: Path | None = None) -> EvalResult:
    """Evaluate the config's own model before any training (`meshrl eval` without --checkpoint):
    `model.path` as a run starts from it, the tiny model built or a GGUF converted in a temporary
    directory, so the run's output_dir stays free for `meshrl train`."""
    with tempfile.TemporaryDirectory(prefix="meshrl-eval-") as tmp:
        result = evaluate_checkpoint(config, resolve_model(config, tmp))
    if out is not None:
        _write(out, config.model.path, result)
    return result


class BackgroundEval:
    """Evaluations of the training policy on one thread of the controller, on a CPU HF engine of
    its own: `start` hands it a version's weights unless one is still running; `done` returns
    the finished one's metrics (with the version they are of) once."""

    def __init__(self, config: RunConfig, model_path: str) -> None:
        self.config, self.model_path = config, model_path
        self.plan = plan_for(config)
        self.engine: Any = None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval")
        self.running: Future[dict[str, float]] | None = None

    def start(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Evaluate `weights` on the pool's thread, unless an evaluation is still running (then skipped)."""
        if self.running is None:
            self.running = self.pool.submit(self._evaluate, weights, version)

    def _evaluate(self, weights: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        if self.engine is None:
            self.engine = make_engine("hf", self.model_path, self.config.model.dtype, [])
            self.episodes = _episodes(self.config, self.model_path)
        self.engine.load_weights(weights, version)
        return {**evaluate(self.engine, self.episodes, self.plan).metrics(), "eval/policy_version": float(version)}

    def round(self, step: int, weights: Callable[[], dict[str, torch.Tensor]]) -> dict[str, float]:
        """After `step` steps: every `eval.interval` steps the policy's `weights()` go to an
        evaluation (unless one is still running: skipped); a finished one's metrics go into this
        step's record. The last step evaluates the final policy and waits for it; the step before
        waits for a running round and starts none, so no round's result is left for the last
        step's record, which holds the final policy's. `deterministic`: every round is waited for,
        and its metrics are in the record of the step it evaluated."""
        last, before_last = step == self.config.max_steps, step == self.config.max_steps - 1
        stats = self.done(wait=before_last)
        if (step % self.config.eval.interval == 0 and not before_last) or last:
            self.start(weights(), step)
        return self.done(wait=True) if last or self.config.deterministic else stats

    def done(self, wait: bool = False) -> dict[str, float]:
        """The finished evaluation's metrics, or {} (none finished); `wait` waits for a running one.
        An evaluation that failed raises here, in the controller."""
        if self.running is None or not (wait or self.running.done()):
            return {}
        future, self.running = self.running, None
        return future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
