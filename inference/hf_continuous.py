"""The HF engine on transformers' continuous batching, for a GPU.

transformers' `ContinuousBatchingManager` keeps every running request in one paged KV cache and
steps them together in a background thread (prefills and decodes in one varlen forward, flash
attention and CUDA graphs on a GPU), where `HFEngine`'s own decode loop left-pads per-conversation
caches and pays Python per token. The contract is `HFEngine`'s, as `VLLMEngine` keeps it:

- each token's logprob is the processed one (after temperature and top-p; greedy turns report
  temperature-1 logprobs), which transformers returns with `return_logprobs`;
- stop ids end a turn (they are the request's end-of-sequence ids), and `max_new_tokens` bounds it;
- a weight update pauses the generation loop (`manager.pause()`, which transformers made for updates
  in place), stamps what was sampled so far with the old version, then copies. Requests already
  running keep their KV, as `HFEngine`'s turns do.

What it costs: every turn is a request over its whole conversation, and prefix sharing stays off
(transformers' block hashes carry no policy version, so a request could reuse blocks computed by
older weights), so each turn prefills the conversation again, where `HFEngine` keeps each
conversation's KV across turns.

What it does not keep: `HFEngine` gives every sequence its own seeded generator, so a seed fixes
each conversation's tokens whatever shares its batch. Here one generator, seeded with the run's
seed when the manager starts, draws for all requests in the order the loop batches them, which
depends on timing: a seeded run is reproducible only with `generator.hf_batching = "rows"`.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any

from torch import Tensor
from transformers import GenerationConfig, PreTrainedModel

from meshrl.inference.completion import Completion, RequestBatch, RequestSequence, check_sampling
from meshrl.inference.hf_engine import HFEngine

PAGE = 256  # tokens per KV page: transformers' default; a request's last page may waste PAGE - 1 tokens
STOP_S = 30.0  # the longest a close waits for the generation loop to leave its step
CPU_KV_TOKENS = 8192  # a manager's KV tokens on a CPU when the run gives no limits (the default takes most of RAM)


class ContinuousHFEngine(HFEngine):
    """`HFEngine`'s contract served by transformers' continuous batching; `kv_tokens` sizes the paged
    cache (transformers infers it from free GPU memory when None, on a GPU only)."""

    def __init__(
        self, model: PreTrainedModel, eos_token_ids: list[int], *, seed: int = 0, kv_tokens: int | None = None
    ) -> None:
        super().__init__(model, eos_token_ids)
        if kv_tokens is None and model.device.type != "cuda":
            kv_tokens = CPU_KV_TOKENS
        self.seed, self.kv_tokens = seed, kv_tokens
        self._manager: Any = None
        self._sampling: tuple[float, float] | None = None  # (temperature, top_p) the manager samples with
        self._drained: list[tuple[Any, int]] = []  # outputs taken during a weight update, with their version
        self._running = 0
        self._requests = 0

    @classmethod
    def from_pretrained(
        cls, path: str, dtype: str = "float32", device: str = "cpu", *, seed: int = 0, kv_tokens: int | None = None
    ) -> ContinuousHFEngine:
        plain = HFEngine.from_pretrained(path, dtype=dtype, device=device)
        return cls(plain.model, plain.eos_token_ids, seed=seed, kv_tokens=kv_tokens)

    def load_weights(self, state_dict: dict[str, Tensor], version: int) -> None:
        """Copy in a new version with the generation loop paused; what it sampled before is the old version's."""
        if self._manager is None or not self._manager.is_running():
            return super().load_weights(state_dict, version)
        with self._manager.pause():
            self._drained += [(output, self._version) for output in self._queued()]
            super().load_weights(state_dict, version)

    def sequence(self, ids: list[int], seed: int | None = None) -> ContinuousSequence:
        return ContinuousSequence(ids)

    def batch(self) -> ContinuousBatch:
        return ContinuousBatch(self)

    def begin_turns(
        self,
        seqs: list[ContinuousSequence],  # type: ignore[override]
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        stop_token_ids: list[int] | None = None,
    ) -> list[bool]:
        """Queue each turn as a request over its whole conversation; its tokens come in `ContinuousBatch.step`."""
        check_sampling([seq.ids for seq in seqs], temperature, top_p, max_new_tokens)
        manager = self._manager_for(temperature, top_p)
        stops = sorted(set(self.eos_token_ids) | set(stop_token_ids or []))
        for seq in seqs:
            seq.turn = Completion(list(seq.ids), [], [], "length")
            seq.stops = set(stops)
            seq.request_id = f"turn-{self._requests}"
            self._requests += 1
            accepted = manager.add_request(list(seq.ids), request_id=seq.request_id, max_new_tokens=max_new_tokens,
                                           streaming=True, eos_token_id=stops)  # fmt: skip
            if accepted is None:
                raise RuntimeError("transformers' continuous batching manager refused a request (it is stopping)")
            self._running += 1
        return [True] * len(seqs)

    def _manager_for(self, temperature: float, top_p: float) -> Any:
        """The running manager if it samples as asked, else a new one (only when no request runs: a run
        and an evaluation's greedy or sampled pass each keep one sampling)."""
        if self._manager is not None and self._sampling == (temperature, top_p) and self._manager.is_running():
            return self._manager
        if self._running and self._manager is not None and self._manager.is_running():
            raise RuntimeError(
                f"continuous batching samples every running request alike: T {self._sampling} is running, "
                f"T ({temperature}, {top_p}) was asked for"
            )
        self.close()
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        # A fresh generation config: the checkpoint's own (top_k 20, temperature 0.6 for Qwen3) must not
        # shape the distribution the trainer scores.
        sampled = temperature > 0
        config = GenerationConfig(do_sample=sampled, temperature=temperature if sampled else None,
                                  top_p=top_p if sampled and top_p < 1.0 else None, top_k=0,
                                  eos_token_id=list(self.eos_token_ids), pad_token_id=self.eos_token_ids[0])  # fmt: skip
        sizes = {}
        if self.kv_tokens is not None:
            sizes = {"num_blocks": math.ceil(self.kv_tokens / PAGE) + 1, "max_batch_tokens": min(self.kv_tokens, 8192)}
        # Synchronous batching: with async double-buffering a step's tokens arrive after the next step
        # was prepared, so a pause for a weight update would stamp them with the new version.
        batching = ContinuousBatchingConfig(return_logprobs=True, allow_block_sharing=False, seed=self.seed,
                                            page_size=PAGE, use_async_batching=False, **sizes)  # fmt: skip
        self._manager = self.model.init_continuous_batching(
            generation_config=config, continuous_batching_config=batching
        )
        self._manager.start()
        self._sampling, self._running = (temperature, top_p), 0
        _open.add(self)
        return self._manager

    def _queued(self, wait: float = 0.0) -> list[Any]:
        """Outputs waiting in the manager's queue: the first after up to `wait` seconds, the rest at once."""
        first = self._manager.get_result(timeout=wait) if wait else None
        out = [] if first is None else [first]
        queue = self._manager.output_router.output_queue
        while not queue.empty():
            out.append(queue.get_nowait())
        return out

    def outputs(self, wait: float) -> list[tuple[Any, int]]:
        """Streamed outputs since the last call, each with the policy version it was sampled under."""
        drained, self._drained = self._drained, []
        return drained + [(output, self._version) for output in self._queued(wait)]

    def finished(self) -> None:
        self._running -= 1

    def close(self) -> None:
        """Stop the manager's generation loop now (requests still running are failed) and free its cache.
        Its thread is not a daemon: an engine left open would keep its process from exiting."""
        if self._manager is not None:
            manager, self._manager, self._sampling, self._running = self._manager, None, None, 0
            manager.stop(block=True, timeout=STOP_S, hard_stop=True)
            manager.destroy()
        _open.discard(self)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the manager's thread may be gone already
            pass


_open: weakref.WeakSet[ContinuousHFEngine] = weakref.WeakSet()  # engines whose loop runs, closed at exit


def _close_open() -> None:
    for engine in list(_open):
        engine.close()


# Before the interpreter joins non-daemon threads (`atexit` runs only after): concurrent.futures'
# executors stop their workers through the same hook.
threading._register_atexit(_close_open)


class ContinuousSequence(RequestSequence):
    """One conversation's ids and current turn; the manager's paged cache holds its KV while it runs,
    and frees a finished request's blocks."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__(ids)
        self.stops: set[int] = set()


class ContinuousBatch(RequestBatch):
    """The manager's running requests; `step` collects the tokens its loop sampled since the last step."""

    WAIT = 0.05  # seconds a step waits for the first new output, so the scheduler's loop does not spin

    def __init__(self, engine: ContinuousHFEngine) -> None:
        super().__init__()
        self.engine = engine

    def step(self) -> list[ContinuousSequence]:
        """The tokens sampled since the last step; returns the sequences whose turn ended."""
        ended = []
        for output, version in self.engine.outputs(self.WAIT):
            seq = self.running.get(output.request_id)
            if seq is None:  # one batch at a time runs an engine's requests: an output never goes astray
                raise RuntimeError(f"continuous batching answered {output.request_id}, which this batch did not add")
            if output.error is not None:
                raise RuntimeError(f"continuous batching failed request {output.request_id}: {output.error}")
            turn = seq.turn
            new = list(output.generated_tokens[len(turn.completion_ids) :])
            turn.logprobs += list(output.logprobs[len(turn.completion_ids) :])
            turn.completion_ids += new
            turn.versions += [version] * len(new)
            if len(turn.logprobs) != len(turn.completion_ids):  # a preempted request's tokens lose theirs
                raise RuntimeError(f"continuous batching returned {len(turn.completion_ids)} tokens but "
                                   f"{len(turn.logprobs)} logprobs for {output.request_id}")  # fmt: skip
            if output.is_finished():
                turn.finish_reason = (
                    "stop" if turn.completion_ids and turn.completion_ids[-1] in seq.stops else "length"
                )
                seq.ids += turn.completion_ids
                self.engine.finished()
                ended.append(self.running.pop(output.request_id))
        return ended
