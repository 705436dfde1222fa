"""`meshrl rollout-worker`: generate rollouts for a controller from outside its mesh.

Needs no Monarch and no shared filesystem: the spec brings the task's import path (the task's
package must be installed here), the sampling parameters and the model's config and tokenizer;
weights come over the same connection, version by version (in a LoRA run the adapters alone,
after the base model once: an HF engine holds the adapters itself, vLLM gets them merged here).
Episodes run on the same `EpisodeScheduler` as the mesh's generators. The worker leases a few
groups at a time, follows new policy versions as the controller announces them, rides out
network cuts and controller restarts (requests are retried; leases of a restarted controller are
void and simply dropped), and stops at SIGTERM after closing its sockets (SIGUSR1 prints every
thread's stack to its log).
"""

from __future__ import annotations

import base64
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from meshrl.configs.schema import LoraConfig, TaskConfig
from meshrl.inference.backends import EngineLimits, make_engine
from meshrl.ingress.client import Cancelled, IngressError, Refused, RolloutClient, to_episode
from meshrl.ingress.protocol import GroupResult, Spec
from meshrl.rollouts.chat import ChatSettings
from meshrl.rollouts.episodes import EpisodeFormat, EpisodeLimits
from meshrl.rollouts.scheduler import EpisodeScheduler, GroupRequest, Sampling
from meshrl.tasks.base import Prompt, make_task
from meshrl.trainer.lora import AdaptedWeight, add_lora, lora_plan, merge_adapters


@dataclass
class WorkerStats:
    leased: int = 0
    verdicts: Counter[str] = field(default_factory=Counter)
    weight_versions: int = 0
    retries: int = 0


def write_model_dir(spec: Spec, weights: dict[str, torch.Tensor], directory: Path) -> Path:
    """The spec's model files plus the weights, as an HF model directory the engines load."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in spec.model_files.items():
        if Path(name).name != name or name.startswith("."):
            raise IngressError(f"the controller sent a model file named {name!r}: not a plain file name")
        (directory / name).write_bytes(base64.b64decode(content))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    return directory


def spec_limits(spec: Spec) -> EpisodeLimits:
    """The run's episode limits as the spec carries them: the verifier rebuilds each episode under
    the same ones, so a worker that bounded (or elided) otherwise would be rejected."""
    elide = spec.context_policy == "elide"
    return EpisodeLimits(spec.max_episode_tokens, spec.max_new_tokens, spec.max_tool_result_tokens, elide)


print_now = partial(print, flush=True)  # a worker's log is tailed (by people, by tests): each line as it happens


class RolloutWorker:
    def __init__(
        self,
        client: RolloutClient,
        *,
        max_groups: int = 2,
        max_episodes: int = 16,
        max_tokens: int = 65536,
        backend: str = "auto",
        log: Callable[[str], None] = print_now,
    ) -> None:
        self.client, self.max_groups, self.log, self.backend = client, max_groups, log, backend
        self.max_episodes, self.max_tokens = max_episodes, max_tokens
        self._tmp = tempfile.TemporaryDirectory(prefix="meshrl-worker-")  # the model as fetched
        self.model_dir = Path(self._tmp.name)
        self.stats = WorkerStats()
        self.held: dict[str, float] = {}  # lease id -> its expiry (time.monotonic())
        self.scheduler: EpisodeScheduler | None = None
        self.loaded: tuple[str | None, int] = (None, -1)  # (controller epoch, policy version) running
        self.lora: LoraConfig | None = None  # the run's adapters' settings (a LoRA run)
        self.base: dict[str, torch.Tensor] = {}  # LoRA on vLLM: the base weights the adapters merge into
        self.plan: list[AdaptedWeight] = []  # ... and how (`lora_plan`)

    def start(self) -> None:
        """Fetch the spec and the newest weights and start the engine."""
        spec = self.client.spec()
        version, weights = self.client.weights()
        self.lora = LoraConfig(**spec.lora) if spec.lora is not None else None
        base = self.client.weights(base=True)[1] if self.lora is not None else weights
        path = write_model_dir(spec, base, self.model_dir)
        if self.max_tokens < spec.max_episode_tokens:
            raise ValueError(
                f"--max-tokens {self.max_tokens} cannot hold one episode of this run ({spec.max_episode_tokens} tokens)"
            )
        gpus = [0] if torch.cuda.is_available() else []
        backend = self.backend if self.backend != "auto" else "vllm" if gpus and _has_vllm() else "hf"
        sizes = EngineLimits(spec.max_episode_tokens, self.max_tokens, self.max_episodes)
        engine = make_engine(backend, str(path), spec.dtype, gpus, sizes, spec.vllm_log_level,
                             record_routing=spec.record_routing)  # fmt: skip
        if self.lora is not None and backend == "hf":
            add_lora(engine.model, self.lora).eval()  # the trainer's adapters, under the same names
        elif self.lora is not None:
            self.base, self.plan = base, lora_plan(str(path), self.lora)
        engine.load_weights(self._policy(weights), version)
        task = make_task(TaskConfig(import_path=spec.task_import_path, kwargs=spec.task_kwargs))
        chat = ChatSettings(spec.renderer, spec.tool_parser, spec.chat_template_kwargs)
        episodes = EpisodeFormat(AutoTokenizer.from_pretrained(str(path)), task, chat, spec_limits(spec))
        sampling = Sampling(spec.temperature, spec.top_p, spec.max_new_tokens)
        self.scheduler = EpisodeScheduler(
            engine, episodes, sampling, max_episodes=self.max_episodes, max_tokens=self.max_tokens
        )
        self.loaded = (self.client.epoch, version)
        self.log(f"worker: {backend} engine on {'cuda' if gpus else 'cpu'}, policy version {version}")

    def run(self, stop: threading.Event) -> WorkerStats:
        """Lease, generate, submit until `stop` is set; a controller that does not answer is waited for."""
        try:
            if self.scheduler is None:
                self._retrying(self.start, stop)
            while not stop.is_set():
                self._retrying(self._round, stop)
        except Cancelled:
            pass  # stopped mid-request
        finally:
            self.close()
        return self.stats

    def _retrying(self, action, stop: threading.Event) -> None:
        """Run `action` until it succeeds: an unreachable controller, one with no weights yet, or a
        version replaced while it downloaded are waited out; a refused key is final."""
        while not stop.is_set():
            try:
                action()
                return
            except Refused:
                raise
            except IngressError as exc:
                self.stats.retries += 1
                self.log(f"worker: {exc}; retrying")
                stop.wait(1.0)

    def _round(self) -> None:
        """One round: follow the policy version, top up leases, hand back finished groups."""
        assert self.scheduler is not None
        self._follow()
        now = time.monotonic()
        self.held = {
            lease_id: expiry for lease_id, expiry in self.held.items() if expiry > now
        }  # expired: free the slot
        leases = self.client.lease(max(0, self.max_groups - len(self.held)))  # n = 0: the newest version only
        if leases:
            self._follow()  # a restarted controller's first answer: its weights before its groups start
            self.log(f"worker: leased {len(leases)} groups")
            self.stats.leased += len(leases)
            for lease in leases:
                self.held[lease.lease_id] = time.monotonic() + lease.expires_in_s
                prompt = Prompt(lease.prompt_id, lease.messages, None, lease.info)
                self.scheduler.submit(
                    [GroupRequest(lease.lease_id, prompt, lease.samples, lease.seed, lease.min_version)]
                )
        finished = self.scheduler.take(0.2 if self.held else 0.0)
        if finished:
            results = [GroupResult(lease_id=g.key, episodes=[to_episode(r) for r in g.rollouts]) for g in finished]
            verdicts = self.client.submit(results)
            for group in finished:
                self.held.pop(group.key, None)
            self.stats.verdicts.update(v.status for v in verdicts)
            rejected = [f"{v.lease_id[-6:]}: {v.reason}" for v in verdicts if v.status == "rejected"]
            self.log(f"worker: submitted {len(verdicts)} groups: {dict(Counter(v.status for v in verdicts))}"
                     + (f"; rejected {rejected}" if rejected else ""))  # fmt: skip
        elif not self.held:
            time.sleep(0.2)  # nothing leased: the controller has no groups to hand out yet

    def _follow(self) -> None:
        """Run the policy version the controller last announced. A restarted controller (a new
        epoch) voids earlier leases and keeps none of the old versions: groups it leases must not
        start on weights it cannot check."""
        if (self.client.epoch, self.client.version) == self.loaded:
            return
        version, weights = self.client.weights()
        # Judged by the controller the weights came from: one that dies while a new version is
        # fetched is retried, and the retry may reach its restarted successor.
        restarted = self.client.epoch != self.loaded[0]
        if restarted:
            self.held.clear()
        landed = self.scheduler.load_weights(self._policy(weights), version)
        self.loaded = (self.client.epoch, version)
        self.stats.weight_versions += 1
        if restarted:
            landed.wait(timeout=60)  # between decode steps: old versions may be numbered as high as the new
            self.log(f"worker: following the restarted controller, policy version {version}")

    def _policy(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the engine loads for a version: its weights, its adapters (an HF engine holding
        them), or the adapted layers merged with the base (vLLM)."""
        if self.lora is None or not self.base:
            return weights
        return merge_adapters(self.base, weights, self.plan)  # the whole model: vLLM takes whole updates

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        self.client.close()
        self._tmp.cleanup()


def _has_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True
