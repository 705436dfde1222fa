"""Teacher rounds: imperfect states to the teacher actors, their answers mined into replay pairs.

Each step the answers that have come back are mined (`mine_pairs`: an action enough teachers agree
on, unlike the student's) and the free teacher actors get states drawn evenly from the step's
imperfect rollouts, then states of the ingested traces (`task.traces`). The controller never waits for a
teacher: a round still out is counted late and looked at again next step.
"""

from __future__ import annotations

import base64
import functools
import pickle
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from transformers import PreTrainedTokenizerBase

from meshrl.actors.teacher import TeacherAnswers
from meshrl.configs.schema import RunConfig
from meshrl.rollouts.batches import rollout_trace
from meshrl.rollouts.episodes import Rollout, cap_trace
from meshrl.run.meshes import Meshes
from meshrl.run.record import Timeline
from meshrl.run.streams import rng_from, rng_state, stream_seed
from meshrl.tasks.base import Grading
from meshrl.topology.faults import SupervisionError
from meshrl.traces.collator import TraceCollator, to_message
from meshrl.traces.errors import ErrorClassifier
from meshrl.traces.pairs import (
    Action,
    DpoPair,
    ReplayState,
    Why,
    mine,
    normalize_action,
    outcome_key,
    trace_states,
)
from meshrl.traces.schema import TraceExample

# The controller's teacher counters (cumulative, checkpointed): rounds, and what mining each answered state gave.
COUNTS = ("actor_failures", "late_rounds", *(f"mined_{why}" for why in get_args(Why)))


def offline_states(config: RunConfig, tokenizer: PreTrainedTokenizerBase, collator: TraceCollator) -> list[ReplayState]:
    """States of the ingested traces named in task.traces, for teacher replay. A state whose
    context leaves no room for a reply in one micro-batch is left out, named: its pair rows
    could never be trained whole."""
    room = config.trainer.micro_batch_tokens - config.generator.max_new_tokens

    def fits(state: ReplayState) -> bool:
        return len(collator.prompt_ids([to_message(m) for m in state.state_messages])) <= room

    states = []
    for path in config.task.traces:
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                example = TraceExample.model_validate_json(line)
            except ValueError as exc:
                raise ValueError(f"task.traces: {path}:{n}: not a trace example: {exc}") from None
            example = cap_trace(example, tokenizer, config.generator.max_tool_result_tokens)
            found = trace_states(example)
            fitting = [state for state in found if fits(state)]
            if len(fitting) < len(found):
                print(f"task.traces: {path}:{n} (trace {example.trace_id}): {len(found) - len(fitting)} of "
                      f"{len(found)} states leave no room for a reply within trainer.micro_batch_tokens "
                      f"{config.trainer.micro_batch_tokens}; left out", flush=True)  # fmt: skip
            states += fitting
    return states


class TeacherRounds:
    """The teacher actors' rounds in flight, the pairs mined since the last step, and the teachers'
    counters over the run (checkpointed)."""

    def __init__(
        self,
        config: RunConfig,
        meshes: Meshes,
        offline: list[ReplayState],
        timeline: Timeline,
        grading: Grading | None = None,
    ) -> None:
        self.config, self.meshes, self.offline, self.timeline = config, meshes, offline, timeline
        self.grading = grading  # `teachers.agree_by = "outcome"`: the task that labels what actions do
        self.rng = random.Random(stream_seed(config) + 3)  # offline states for the teachers
        self.rounds: dict[int, _Round] = {}  # teacher rank -> its round in flight
        self.pairs: list[DpoPair] = []
        self.counts = dict.fromkeys(COUNTS, 0)
        self.totals: dict[str, float] = {}  # counters of teacher actors gone (died, or before a resume)
        self.latest: dict[int, dict[str, float]] = {}  # teacher rank -> its live actor's counters

    def take_pairs(self) -> list[DpoPair]:
        """The pairs mined since the last call."""
        pairs, self.pairs = self.pairs, []
        return pairs

    def round(self, rollouts: list[Rollout], step: int) -> dict[str, float]:
        """Mine the teacher answers that have come back; send this step's imperfect states to the
        teacher actors that are free; the teachers' counters. Never waits for a teacher."""
        pool = self.meshes.teachers
        if pool is None:
            return {}
        for rank, pending in list(self.rounds.items()):
            try:  # deterministic: a round's answers are mined the step after it was sent, always
                reply: TeacherAnswers = pending.future.get(timeout=None if self.config.deterministic else 0.001)
            except TimeoutError:
                self.counts["late_rounds"] += 1
                continue
            except SupervisionError:
                del self.rounds[rank]
                self.counts["actor_failures"] += 1
                for name, value in self.latest.pop(rank, {}).items():
                    self.totals[name] = self.totals.get(name, 0.0) + value
                if pool[rank] is pending.actor:
                    self.meshes.replace(pool, rank)
                continue
            del self.rounds[rank]
            self.latest[rank] = reply.totals
            self.timeline.add(f"teacher {rank}", pending.sent, time.time(), step)
            for state, context, actions in zip(pending.states, pending.contexts, reply.actions):
                mined = mine(state, actions, self.config.teachers.min_agree, self._key(state, context))
                self.counts[f"mined_{mined.why}"] += 1
                if mined.pair is not None:
                    self.pairs.append(mined.pair)
        free = [rank for rank in range(len(pool)) if rank not in self.rounds]
        if free:
            states, contexts = self._states(rollouts)
            for i, rank in enumerate(free):
                if states[i :: len(free)]:
                    self._send(rank, states[i :: len(free)], contexts[i :: len(free)])
        return {f"teacher/{k}": float(v) for k, v in {**self.run_totals(), **self.counts}.items()}

    def _key(self, state: ReplayState, context: dict[str, Any]) -> Callable[[Action], str]:
        """How actions at `state` are told equal: by their text, or (`teachers.agree_by = "outcome"`,
        at a rollout's state, whose prompt is known) by the task's label of what each does."""
        prompt = context.get("prompt")
        if self.grading is None or prompt is None:
            return normalize_action
        return outcome_key(functools.partial(self.grading.action_outcome, prompt, state.state_messages))

    def _send(self, rank: int, states: list[ReplayState], contexts: list[dict[str, Any]]) -> None:
        """A round of `states` to teacher actor `rank`, with what the run's other actors spent."""
        actor = self.meshes.teachers[rank]
        elsewhere = self.run_totals().get("usd_spent", 0.0) - self.latest.get(rank, {}).get("usd_spent", 0.0)
        future = actor.replay.call_one([s.state_messages for s in states], contexts, elsewhere)
        self.rounds[rank] = _Round(actor, future, states, contexts, time.time())

    def _states(self, rollouts: list[Rollout]) -> tuple[list[ReplayState], list[dict[str, Any]]]:
        """Up to `states_per_step` states: drawn evenly from every imperfect rollout's states, then
        offline ones. Not the worst rollouts' first: those failed earliest (a guess where a lookup was
        due, reward 0), so their pairs held only first-turn actions and, with nothing mined where the
        teachers answer, pushed the policy off answering at all (measured in docs/concepts/losses.md)."""
        classifier = ErrorClassifier()
        budget = self.config.teachers.states_per_step
        found = [
            (state, {"prompt": r.prompt})
            for r in rollouts
            if r.reward < 1.0 and not r.earlier  # an episode that elided tool results has no one row of ids
            for state in trace_states(rollout_trace(r, classifier))
        ]
        picked = self.rng.sample(found, min(len(found), budget))
        picked += [(state, {}) for state in self.rng.sample(self.offline, min(len(self.offline), budget // 2))]
        picked = picked[:budget]
        return [state for state, _ in picked], [context for _, context in picked]

    def run_totals(self) -> dict[str, float]:
        """Teacher counters over the run: the live actors' plus those of actors before them
        (replaced ones, and the run before a resume)."""
        totals = dict(self.totals)
        for latest in self.latest.values():
            for name, value in latest.items():
                totals[name] = totals.get(name, 0.0) + value
        return totals

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the offline-state stream, the counters, the pairs not yet trained
        on, and the rounds still out (a resumed run sends them again: their pairs are not lost)."""
        return {
            "teacher_rng": rng_state(self.rng),
            "teacher_totals": self.run_totals(),
            "teacher_counts": dict(self.counts),  # a copy: the checkpoint is written while the next step mines
            "pairs": [p.model_dump() for p in self.pairs],
            "teacher_rounds": [
                {"rank": rank, "states": [s.model_dump() for s in out.states], "contexts": _packed(out.contexts)}
                for rank, out in sorted(self.rounds.items())
            ],
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.rng.setstate(rng_from(state["teacher_rng"]))
        self.totals, self.counts = state["teacher_totals"], {**self.counts, **state["teacher_counts"]}
        self.pairs = [DpoPair.model_validate(p) for p in state["pairs"]]
        pool = self.meshes.teachers
        for out in state.get("teacher_rounds", []):  # absent from checkpoints of earlier versions
            if pool is not None and out["rank"] < len(pool):
                states = [ReplayState.model_validate(s) for s in out["states"]]
                self._send(out["rank"], states, pickle.loads(base64.b64decode(out["contexts"])))


def _packed(contexts: list[dict[str, Any]]) -> str:
    """Contexts hold the task's Prompt objects (any answer type): pickled into the run's own checkpoint."""
    return base64.b64encode(pickle.dumps(contexts)).decode()


@dataclass
class _Round:
    """States sent to a teacher actor, awaiting its answers (mined into pairs when they come)."""

    actor: Any
    future: Any  # -> TeacherAnswers
    states: list[ReplayState]
    contexts: list[dict[str, Any]]
    sent: float
