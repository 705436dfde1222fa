"""Checking a worker's group against what the controller computes itself.

Nothing a worker sends is taken on trust. Each episode is rebuilt turn by turn through the
same `EpisodeFormat` the mesh's generators use: the prompt is rendered here and must be the
submission's first tokens; each sampled turn is cut where the engine would have stopped; its
tool calls are run through the task again and the tool turn must tokenize to the submitted
tokens; the reward trained on is computed here, with the prompt's hidden answer, and the
worker's claimed reward must be the one the task gives on the prompt as leased (what an honest
worker can compute). Then a random fraction of the sampled tokens, chosen after
the submission arrived, is re-scored with the policy version each claims, and an episode whose
claimed behaviour logprobs differ from the recomputed ones by more than `tolerance` (mean
absolute difference, nats) is rejected. What the worker cannot forge without being caught is
then: which prompt it answered, what the tools said, the reward trained on, and (up to the tolerance,
for the tokens checked) the logprobs the trainer's importance ratios use.

A mixture of experts' episode carries its routed experts (routing replay), which the trainer's forward
then takes, so a worker could pick experts that favour its answer. A re-scored context is scored under
its claimed routing (the logprobs must match under the experts the trainer will use), and the claim is
held to the controller's own router under the claimed version: at most `routing_tolerance` of its
positions' (layer by layer) experts may differ.

An episode that elided tool results (`generator.context_policy = "elide"`) is rebuilt the same way:
the controller's `EpisodeFormat` elides where the run's budget makes it, so each submitted context
must end where the rule elides and the next must start as the shorter context it builds; the
elided messages must be the rule's, and each context's logprobs are re-scored as a row of its own.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from meshrl.inference.completion import Completion
from meshrl.inference.hf_engine import HFEngine
from meshrl.ingress.protocol import Context, Episode
from meshrl.loss_adapters.logprobs import sequence_token_logprobs
from meshrl.models.routing import decode_record, extended, force_routing
from meshrl.rollouts.episodes import EpisodeFormat, Rollout, Segment
from meshrl.tasks.base import Prompt, ToolResult

REWARD_ATOL = 1e-6


class Rejected(Exception):
    """A submission that failed a check: `reason` is the counter it goes to (`ingress/rejected/REASON`)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class VerifyStats:
    checked_tokens: int = 0
    seconds: float = 0.0
    max_accepted_diff: float = 0.0  # the largest mean |Δ logprob| of an accepted episode (context)
    diffs: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))  # mean |Δ| of re-scored contexts


@dataclass
class _Cursor:
    """How far a replay has read a submission: token `pos` of its context `k`, after `sampled` sampled tokens."""

    contexts: list[Context]
    pos: int
    k: int = 0
    sampled: int = 0

    @property
    def context(self) -> Context:
        return self.contexts[self.k]

    def where(self) -> str:
        return f"token {self.pos}" + (f" of context {self.k}" if len(self.contexts) > 1 else "")


@dataclass
class _Row:
    """A context of an episode as the trainer gets it (a row): what `Verifier.rescore` checks."""

    name: str  # "episode I" (or "episode I context K", of an episode that elided tool results)
    segment: Segment
    versions: list[int]  # of its sampled tokens


@dataclass
class Scored:
    """A re-scored context: its logprobs, and a mixture of experts' own routing of it (None: dense)."""

    logprobs: torch.Tensor
    own_routing: np.ndarray | None


class Scorer:
    """The policy at a claimed version, loaded from the versions the controller keeps, scoring
    token ids the way the trainer does (temperature-scaled log-softmax, full forward)."""

    def __init__(self, model_path: str, dtype: str, temperature: float, weights_path: Callable[[int], Path | None]):
        # a mixture of experts: its own routing recorded (hooks first), and a claimed routing replayed
        self.engine = HFEngine.from_pretrained(model_path, dtype=dtype, record_routing=True)
        force_routing(self.engine.model)
        self.temperature = temperature
        self.weights_path = weights_path
        self.loaded: int | None = None

    def has(self, version: int) -> bool:
        return self.weights_path(version) is not None

    @property
    def experts(self) -> tuple[int, int, int] | None:
        """(MoE layers, k, num_experts) of a mixture of experts; None for a dense model."""
        recorder = self.engine.recorder
        return None if recorder is None else (len(recorder.chosen), recorder.k, recorder.num_experts)

    @torch.inference_mode()
    def logprobs(self, version: int, ids: list[int], routing: np.ndarray | None = None) -> Scored:
        """Logprob of each of `ids` given its prefix under policy `version` (position 0 is 0), the forward
        routed as `routing` claims where it claims (a mixture of experts), and its own routing."""
        if self.loaded != version:
            path = self.weights_path(version)
            if path is None:
                raise Rejected("bad_tokens", f"policy version {version} is no longer kept")
            self.engine.load_weights(load_file(str(path)), version)
            self.loaded = version
        batch = torch.tensor([ids], device=self.engine.device)
        routed = extended(routing, len(ids))
        routed = None if routed is None else torch.from_numpy(routed)[None].to(self.engine.device)
        logprobs = sequence_token_logprobs(
            self.engine.model, batch, temperature=self.temperature, routed_experts=routed
        )
        own = self.engine.recorder.take(1, len(ids))[0] if self.engine.recorder is not None else None
        return Scored(logprobs[0].float().cpu(), own)


class Verifier:
    def __init__(
        self,
        episodes: EpisodeFormat,
        scorer: Scorer,
        *,
        max_new_tokens: int,
        fraction: float,
        tolerance: float,
        routing_tolerance: float = 0.1,
    ) -> None:
        self.format, self.scorer = episodes, scorer
        self.max_new_tokens = max_new_tokens
        self.fraction, self.tolerance, self.routing_tolerance = fraction, tolerance, routing_tolerance
        self.vocab = len(episodes.tokenizer)
        self.max_len = int(getattr(scorer.engine.model.config, "max_position_embeddings", 1 << 30))
        self.stops = set(episodes.stop_ids) | set(scorer.engine.eos_token_ids)
        self.replays_tools = bool(getattr(episodes.task, "replayable_tools", True))
        self.rng = random.Random()  # positions to re-score: unpredictable to the worker
        self.stats = VerifyStats()

    def check_group(
        self, prompt: Prompt, samples: int, min_version: int, newest: int, episodes: list[Episode]
    ) -> list[Rollout]:
        """The group's rollouts as rebuilt here (reward computed here), or `Rejected`."""
        start = time.perf_counter()
        try:
            if len(episodes) != samples:
                raise Rejected("malformed", f"{len(episodes)} episodes for a lease of {samples}")
            rollouts = [self.replay(prompt, ep, min_version, newest) for ep in episodes]
            self.rescore(rollouts)
            return rollouts
        finally:
            self.stats.seconds += time.perf_counter() - start

    # ------------------------------------------------------------------ structure, tools, reward

    def replay(self, prompt: Prompt, ep: Episode, min_version: int, newest: int) -> Rollout:
        """Rebuild the episode from its sampled turns; every other token is derived here."""
        self._check_tokens(ep, min_version, newest)
        rollout = self.format.start(prompt)
        at = _Cursor(ep.contexts(), len(rollout.token_ids))
        if not _starts_with(at.context, rollout.token_ids):
            raise Rejected(
                "prompt_mismatch", "the first tokens are not the leased prompt as the chat template renders it"
            )
        try:
            self._replay_turns(ep, rollout, at)
        finally:
            self.format.end(rollout)  # an `Episodic` task's state, if its tools were answered here
        if at.k + 1 != len(at.contexts):
            raise Rejected("elision_mismatch", f"the episode ends in context {at.k} of the {len(at.contexts)} sent")
        if at.pos != len(at.context.token_ids):
            raise Rejected("bad_tokens", f"{len(at.context.token_ids) - at.pos} tokens after the episode ended")
        if ep.elided != sorted(rollout.elided):
            raise Rejected(
                "elision_mismatch", f"elided messages {ep.elided}, the budget elides {sorted(rollout.elided)}"
            )
        for segment, context in zip([*rollout.earlier, rollout], at.contexts, strict=True):
            segment.routing = self._claimed_routing(context)
        if ep.finish_reason != rollout.finish_reason:
            raise Rejected(
                "bad_tokens", f"finish_reason {ep.finish_reason!r}, the tokens say {rollout.finish_reason!r}"
            )
        if _normal(ep.messages) != _normal(rollout.messages):
            theirs = [m for m in _normal(ep.messages) if m.get("role") == "tool"]
            ours = [m for m in _normal(rollout.messages) if m.get("role") == "tool"]
            reason = "tool_mismatch" if theirs != ours else "messages_mismatch"
            raise Rejected(reason, "the messages are not those the tokens and the task's tools give")
        self.format.score(rollout)  # with the prompt's hidden answer: the reward trained on
        knowable = self._leased_reward(prompt, rollout)
        if not math.isfinite(ep.reward) or abs(ep.reward - knowable) > REWARD_ATOL:
            raise Rejected(
                "reward_mismatch", f"claimed reward {ep.reward}, the task gives {knowable} on what the lease carries"
            )
        return rollout

    def _replay_turns(self, ep: Episode, rollout: Rollout, at: _Cursor) -> None:
        """Add the episode's turns from the cursor on, checking each, until the episode ends; where
        the budget elides tool results, the replay goes on in the next submitted context."""
        while True:
            calls = self._replay_turn(ep, rollout, at)
            contexts = len(rollout.earlier)
            if not self.format.goes_on(rollout, calls):
                return
            if len(rollout.earlier) != contexts:
                self._next_context(rollout, at)

    def _replay_turn(self, ep: Episode, rollout: Rollout, at: _Cursor) -> list[dict[str, Any]]:
        """Add the sampled turn at the cursor, and the tool turn answering it; returns its tool calls."""
        ids, mask, pos = at.context.token_ids, at.context.loss_mask, at.pos
        end = pos
        while end < len(ids) and mask[end]:
            end += 1
        turn = ids[pos:end]
        if not turn and end == len(ids) and at.k + 1 < len(at.contexts):
            raise Rejected("elision_mismatch", f"the context ends at {at.where()}, where the budget elides nothing")
        if not turn:
            raise Rejected("bad_tokens", f"a sampled turn should start at {at.where()}")
        if len(turn) > self.max_new_tokens or any(t in self.stops for t in turn[:-1]):
            raise Rejected("bad_tokens", f"the turn at {at.where()} runs past a stop token or max_new_tokens")
        finish = "stop" if turn[-1] in self.stops else "length"
        if finish == "length" and len(turn) != self.max_new_tokens:
            raise Rejected("bad_tokens", f"the turn at {at.where()} ends without a stop token before max_new_tokens")
        versions = ep.versions[at.sampled : at.sampled + len(turn)]
        at.sampled += len(turn)
        calls = self.format.add_turn(rollout, Completion([], turn, at.context.logprobs[pos:end], finish, versions))
        at.pos = end
        if calls:
            results = self._tool_results(rollout, calls, ep)
            tool_ids = self.format.add_tool_results(rollout, calls, results)
            if ids[end : end + len(tool_ids)] != tool_ids or any(mask[end : end + len(tool_ids)]):
                raise Rejected("tool_mismatch", f"the tool turn at {at.where()} is not what the task's tools answer")
            at.pos += len(tool_ids)
        return calls

    def _next_context(self, rollout: Rollout, at: _Cursor) -> None:
        """The budget had tool results elided (`EpisodeFormat.elide`, the rule the worker ran): the
        submitted context must end here, and the next one start as the shorter context built here."""
        if at.pos != len(at.context.token_ids):
            raise Rejected("elision_mismatch", f"the context goes on past {at.where()}, where the budget elides")
        if at.k + 1 == len(at.contexts):
            raise Rejected("elision_mismatch", f"the budget elides after {at.where()}, and no context follows")
        at.k, at.pos = at.k + 1, len(rollout.token_ids)
        if not _starts_with(at.context, rollout.token_ids):
            raise Rejected(
                "elision_mismatch",
                f"context {at.k} does not begin as the episode with messages {sorted(rollout.elided)} elided",
            )

    def _claimed_routing(self, context: Context) -> np.ndarray | None:
        """A context's claimed routed experts, well-formed for this model (whether they are its router's
        is `rescore`'s check)."""
        if context.routing is None:
            return None
        if self.scorer.experts is None:
            raise Rejected("bad_routing", "routed experts for a model without experts")
        try:
            return decode_record(context.routing, *self.scorer.experts, len(context.token_ids) - 1, "routing")
        except ValueError as exc:
            raise Rejected("bad_routing", str(exc)) from None

    def _leased_reward(self, prompt: Prompt, rollout: Rollout) -> float:
        """The reward an honest worker computes: the task scoring the episode on the prompt as
        leased, without its hidden answer (tests, reference solutions). Where the reward needs
        that answer, this differs from the one trained on, and the claim is held to this one."""
        if prompt.answer is None:
            return float(rollout.reward)
        leased = replace(rollout, prompt=Prompt(prompt.prompt_id, prompt.messages, None, prompt.info))
        self.format.score(leased)
        return float(leased.reward)

    def _check_tokens(self, ep: Episode, min_version: int, newest: int) -> None:
        contexts = ep.contexts()
        if len(contexts) > self.format.task.max_turns:  # each holds a sampled turn
            raise Rejected("bad_tokens", f"{len(contexts)} contexts for at most {self.format.task.max_turns} turns")
        for context in contexts:
            self._check_context(context)
        sampled = sum(sum(context.loss_mask) for context in contexts)
        if len(ep.versions) != sampled:
            raise Rejected("bad_tokens", f"{len(ep.versions)} versions for {sampled} sampled tokens")
        if any(b < a for a, b in zip(ep.versions, ep.versions[1:])):
            raise Rejected("bad_tokens", "policy versions go backwards")
        if ep.versions and not (min_version <= ep.versions[0] and ep.versions[-1] <= newest):
            raise Rejected(
                "bad_tokens", f"versions {ep.versions[0]}..{ep.versions[-1]} outside {min_version}..{newest}"
            )
        if any(not self.scorer.has(v) for v in set(ep.versions)):
            raise Rejected("bad_tokens", "a claimed policy version is no longer kept")

    def _check_context(self, context: Context) -> None:
        n = len(context.token_ids)
        if not (len(context.loss_mask) == len(context.logprobs) == n) or n > self.max_len:
            raise Rejected(
                "bad_tokens", f"{n} token ids, {len(context.loss_mask)} mask entries, {len(context.logprobs)} logprobs"
            )
        if any(not 0 <= t < self.vocab for t in context.token_ids):
            raise Rejected("bad_tokens", f"token ids outside the vocabulary of {self.vocab}")
        for lp, m in zip(context.logprobs, context.loss_mask):
            if not math.isfinite(lp) or lp > 1e-6 or (not m and lp != 0.0):
                raise Rejected("bad_tokens", f"logprob {lp} is not a sampled token's log-probability")

    def _tool_results(self, rollout: Rollout, calls: list[dict[str, Any]], ep: Episode) -> list[ToolResult]:
        """The task answers the calls again; a task whose tools cannot be replayed (it says
        `replayable_tools = False`) is taken at the worker's word, read from its messages."""
        if self.replays_tools:
            return [self.format.call_tool(rollout, call) for call in calls]
        at = len(rollout.messages)
        theirs = ep.messages[at : at + len(calls)]
        if len(theirs) != len(calls) or any(
            m.get("role") != "tool" or not isinstance(m.get("content"), str) for m in theirs
        ):
            raise Rejected("tool_mismatch", f"the messages lack the tool turn after message {at}")
        return [ToolResult(m["content"], bool(m.get("is_error", False))) for m in theirs]

    # ------------------------------------------------------------------ logprobs

    def rescore(self, rollouts: list[Rollout]) -> None:
        """Re-score a random `fraction` of each context's sampled tokens (at least one) with the
        version that claims them, each context a row as the trainer scores it; reject an episode
        any of whose contexts has a mean |Δ logprob| over `tolerance` (honest ones cannot dilute it)."""
        if self.fraction <= 0:
            return
        rows = _rows(rollouts)
        picks: dict[int, dict[int, list[int]]] = {}  # version -> row index -> positions
        for n, row in enumerate(rows):
            positions = [p for p, m in enumerate(row.segment.loss_mask) if m]
            chosen = [j for j in range(len(positions)) if self.rng.random() < self.fraction]
            if not chosen and positions:
                chosen = [self.rng.randrange(len(positions))]
            for j in chosen:
                picks.setdefault(row.versions[j], {}).setdefault(n, []).append(positions[j])
        diffs: dict[int, list[float]] = {}
        for version in sorted(picks):
            for n, positions in picks[version].items():
                segment, routing = rows[n].segment, rows[n].segment.routing
                end = max(max(positions) + 1, 0 if routing is None else len(routing))
                scored = self.scorer.logprobs(version, segment.token_ids[:end], routing)
                diffs.setdefault(n, []).extend(abs(scored.logprobs[p].item() - segment.logprobs[p]) for p in positions)
                self.stats.checked_tokens += len(positions)
                if routing is not None and len(routing):
                    self._check_routing(rows[n].name, routing, scored.own_routing[: len(routing)], version)
        means = {n: sum(d) / len(d) for n, d in sorted(diffs.items())}
        for n, mean in means.items():
            self.stats.diffs.append(mean)
            if mean > self.tolerance:
                raise Rejected(
                    "logprob_mismatch",
                    f"{rows[n].name}: mean |Δ logprob| {mean:.3g} over {len(diffs[n])} tokens > tolerance {self.tolerance}",
                )
        self.stats.max_accepted_diff = max([self.stats.max_accepted_diff, *means.values()])

    def _check_routing(self, name: str, claimed: np.ndarray, own: np.ndarray, version: int) -> None:
        """The claimed experts (position by position and layer by layer, as sets) against the router's own."""
        differs = (np.sort(claimed, -1) != np.sort(own, -1)).any(-1)
        share = float(differs.mean())
        if share > self.routing_tolerance:
            raise Rejected(
                "routing_mismatch",
                f"{name}: {share:.3g} of its claimed routed experts are not version {version}'s router's "
                f"(routing_tolerance {self.routing_tolerance})",
            )


def _rows(rollouts: list[Rollout]) -> list[_Row]:
    """Every context of every rollout, with the versions of its sampled tokens."""
    rows = []
    for i, rollout in enumerate(rollouts):
        versions, segments = iter(rollout.versions), rollout.segments()
        for k, segment in enumerate(segments):
            name = f"episode {i}" + (f" context {k}" if len(segments) > 1 else "")
            rows.append(_Row(name, segment, list(islice(versions, sum(segment.loss_mask)))))
    return rows


def _starts_with(context: Context, ids: list[int]) -> bool:
    """Whether `context` begins with `ids`, none of them sampled in it."""
    return context.token_ids[: len(ids)] == ids and not any(context.loss_mask[: len(ids)])


def _normal(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as JSON carries them (tuples become lists, keys strings), to compare like with like."""
    return json.loads(json.dumps(messages))
