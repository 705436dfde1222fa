"""What an inference engine returns for one prompt, whichever backend produced it.

The HF and vLLM engines share this type and the sampling-argument checks, so the
generator actor and the loss see the same contract from either backend.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

FinishReason = Literal["stop", "length"]


@dataclass
class Completion:
    """One sampled completion.

    `logprobs[i]` is the log-probability of `completion_ids[i]` under the distribution it
    was drawn from (after temperature and top-p; greedy reports temperature-1 logprobs).
    A stop/eos token that ended the completion is its last element. `versions[i]` is the
    policy version loaded when token i was sampled: weights may change mid-completion.
    `routing`: a mixture of experts' routed experts at every position of prompt and completion but
    the last (`models.routing`), set when the turn ends, where the engine records them.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    versions: list[int] = field(default_factory=list)
    routing: np.ndarray | None = None


class RequestSequence:
    """One conversation on an engine that holds its KV memory itself (vLLM, transformers' continuous
    batching): its ids, its current turn, and the request that samples that turn."""

    cached = 0  # the engine manages its KV memory: nothing counts against the scheduler's cap

    def __init__(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("a sequence needs at least one token to condition on")
        self.ids = list(ids)
        self.turn: Completion | None = None
        self.request_id = ""

    def extend(self, ids: list[int]) -> None:
        """Append ids the model did not sample (a tool turn); the next turn's request carries them."""
        self.ids += ids

    def release(self) -> None:
        """Nothing to drop: the engine frees or evicts a request's blocks itself."""


class RequestBatch:
    """Such an engine's running turns, by request id; a backend's `step` collects their tokens."""

    def __init__(self) -> None:
        self.running: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.running)

    def add(self, seq: RequestSequence) -> None:
        self.running[seq.request_id] = seq


def request_seeds(seed: int | None, count: int) -> list[int | None]:
    """One seed per request, drawn from `seed`.

    Each sequence samples from its own generator, so one shared seed would make the copies of
    a prompt (samples_per_prompt duplicates it) sample identical completions.
    """
    if seed is None:
        return [None] * count
    rng = random.Random(seed)
    return [rng.getrandbits(63) for _ in range(count)]


def check_sampling(prompts: list[list[int]], temperature: float, top_p: float, max_new_tokens: int) -> None:
    """Refuse arguments both backends would otherwise treat differently (or silently clamp)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty: generation needs at least one token to condition on")


def generate_all(
    engine: Any,
    prompts: list[list[int]],
    *,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    stop_token_ids: list[int] | None,
    seed: int | None,
) -> list[Completion]:
    """One completion per prompt, through an engine's sequences and batch (HF or vLLM), all
    advanced together; deterministic given `seed` (each prompt samples from its own seed)."""
    check_sampling(prompts, temperature, top_p, max_new_tokens)
    seqs = [engine.sequence(prompt, s) for prompt, s in zip(prompts, request_seeds(seed, len(prompts)))]
    batch = engine.batch()
    going = engine.begin_turns(seqs, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                               stop_token_ids=stop_token_ids)  # fmt: skip
    for seq, on in zip(seqs, going):
        if on:
            batch.add(seq)
    while len(batch):
        batch.step()
    return [seq.turn for seq in seqs]
