"""The rollout feed: what each step trains on, from the generators and the ingress lane.

Generation never waits on the controller. Generators are fed groups (one prompt, sampled
`samples_per_prompt` times) up to `max_async_level` policy versions ahead, each tagged with the
oldest version it may start on, and stream finished groups back through long-polled `take` calls;
outside workers lease the first groups of a step through the ingress, and what they give back
the generators run. A step's groups are gathered, refilled (dynamic sampling) and stripped of
rollouts too stale to train on. The generators are one lane (run/generator_lane.py, with their
faults), the ingress another: this is where a new source of groups plugs in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshrl.configs.schema import RunConfig
from meshrl.ingress.server import IngressServer
from meshrl.rollouts.episodes import Rollout, fresh_rollouts
from meshrl.rollouts.scheduler import FinishedGroup, GroupRequest
from meshrl.run.generator_lane import GeneratorLane
from meshrl.run.record import Timeline
from meshrl.run.streams import GroupStreams, rng_state


@dataclass
class Offer:
    """A group offered to outside workers and not yet back, and the step it is for."""

    step: int
    group: GroupRequest


@dataclass
class StepRequest:
    """One step's groups, and the prompt streams as they were before its prompts were drawn: a
    checkpoint taken while it is in flight saves those, so a resumed run draws the same prompts
    again instead of skipping them."""

    streams_before: dict[str, Any]
    asked: list[GroupRequest]  # what it asked for: a step whose rollouts were all lost asks for it again
    groups: list[FinishedGroup] = field(default_factory=list)

    @property
    def keys(self) -> list[str]:
        return [group.key for group in self.asked]


@dataclass
class Refill:
    """A step's dynamic sampling: its groups found with all rewards equal, the extra groups asked
    for, and the tied groups they replaced (out of the batch)."""

    uninformative: int
    extra: int
    replaced: list[FinishedGroup] = field(default_factory=list)


@dataclass
class StepRollouts:
    """What a step trains on: its request (the groups that came back), its dynamic sampling, and
    the rollouts fresh enough to train on (never empty)."""

    request: StepRequest
    refill: Refill
    fresh: list[Rollout]


class RolloutFeed:
    """Draws each step's groups, deals them to the generator lane (its first ones offered to the
    ingress), and gathers them back."""

    def __init__(
        self,
        config: RunConfig,
        streams: GroupStreams,
        generators: GeneratorLane,
        ingress: IngressServer | None,
        timeline: Timeline,
    ) -> None:
        self.config, self.streams, self.generators = config, streams, generators
        self.ingress, self.timeline = ingress, timeline
        self.requests: dict[int, StepRequest] = {}  # by step, oldest first
        self.offered: dict[str, Offer] = {}  # groups offered to outside workers, not yet back, by key
        self.dropped_stale = 0

    # ------------------------------------------------------------------ a step's rollouts

    def collect(self, step: int) -> StepRollouts:
        """The step's groups, refilled, and their fresh rollouts. A step left with none (every
        generator of it died, or all it got was too stale) asks for its own groups again."""
        while True:
            self._feed(step)
            request = self._gather(step)
            refill = self._refill(request, step)
            rollouts = [r for group in request.groups for r in group.rollouts]
            fresh = fresh_rollouts(rollouts, step, self.config.generator.max_off_policy_steps)
            self.dropped_stale += len(rollouts) - len(fresh)
            if fresh:
                return StepRollouts(request, refill, fresh)
            self._ask_again(request, step)

    def counters(self) -> dict[str, int]:
        """The running totals (checkpointed: they go on across a resume)."""
        return {
            "dropped_stale": self.dropped_stale,
            "lost_rollouts": self.generators.lost_rollouts,
            "generator_errors": self.generators.errors,
        }

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the prompt streams where the oldest step still in flight drew
        from (a resumed run draws its prompts again), dynamic sampling's stream, a curriculum's
        summaries of the steps done, the counters."""
        return {
            **self.checkpoint_streams(),
            "refill_rng": rng_state(self.streams.refill_rng),
            "curriculum": self.streams.summaries,
            **self.counters(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.streams.restore(state)
        self.streams.summaries = list(state.get("curriculum", []))  # absent from checkpoints of earlier versions
        self.dropped_stale, self.generators.lost_rollouts = state["dropped_stale"], state["lost_rollouts"]
        self.generators.errors = state.get("generator_errors", 0)  # absent from checkpoints of earlier versions

    def checkpoint_streams(self) -> dict[str, Any]:
        """The prompt streams a checkpoint records: where the oldest step still in flight drew from."""
        oldest = min(self.requests, default=None)
        return self.requests[oldest].streams_before if oldest is not None else self.streams.state()

    def _feed(self, step: int) -> None:
        """Keep the generators a step beyond what they may start: its groups wait on the
        generator for the weights they need and start the moment those land."""
        level = self.config.generator.max_async_level
        ahead = max(self.requests, default=step - 1) + 1
        while ahead < self.config.max_steps and ahead <= step + level + 1:
            self._request(ahead)
            ahead += 1

    def _request(self, step: int) -> None:
        """Deal a step's groups round-robin to the generators (its first ones offered to outside
        workers when the ingress is on)."""
        before = self.streams.state()
        groups = self.streams.step_groups(step, self._in_flight(step))
        self.requests[step] = StepRequest(before, groups)
        if self.ingress is not None:  # the step's first groups are offered to outside workers
            n = self.config.ingress.groups_per_step
            offered, groups = groups[:n], groups[n:]
            for group in offered:
                self.offered[group.key] = Offer(step, group)
            self.ingress.offer(step, offered)
        self.generators.deal(step, groups)

    def _in_flight(self, step: int) -> list[str]:
        """The prompt ids of the step's groups not yet back."""
        dealt = [slot.group for slot in self.generators.slots.values() if slot.step == step]
        offered = [offer.group for offer in self.offered.values() if offer.step == step]
        return [group.prompt.prompt_id for group in offered + dealt]

    def _ask_again(self, request: StepRequest, step: int) -> None:
        """Deal a step's own groups again (same prompts and seeds, new keys) to the mesh's
        generators: drawing new ones would take later steps' prompts out of the streams, and a
        checkpoint's record of the streams (the oldest request's `streams_before`) would no longer
        say where a resumed run draws from."""
        groups = [self.streams.rekey(group, step) for group in request.asked]
        self.requests[step] = StepRequest(request.streams_before, groups)
        self.generators.deal(step, groups)

    def _refill(self, request: StepRequest, step: int) -> Refill:
        """DAPO's dynamic sampling: while the step has groups whose rewards are all equal (they
        carry no advantage), ask the mesh's generators for as many fresh groups, up to
        `generator.refill_uninformative` extra groups in all. Their prompts and seeds come from a
        stream of their own, so the steps' regular prompts are those of a run without refills."""
        budget = self.config.generator.refill_uninformative
        tied = [group for group in request.groups if uninformative(group)]
        first, extra, replaced = len(tied), 0, []
        while budget and tied and extra < budget:
            groups = self.streams.refill_groups(step, min(len(tied), budget - extra), self._in_flight(step))
            extra += len(groups)
            self.requests[step] = StepRequest(request.streams_before, groups)
            self.generators.deal(step, groups)
            added = self._gather(step).groups
            # as in DAPO, a replaced group leaves the batch (and the loss normaliser) for the one that came back
            replaced += tied[: len(added)]
            request.groups = [g for g in request.groups if all(g is not r for r in replaced)] + added
            tied = tied[len(added) :] + [group for group in added if uninformative(group)]
        return Refill(uninformative=first, extra=extra, replaced=replaced)

    # ------------------------------------------------------------------ gathering

    def _gather(self, step: int) -> StepRequest:
        """Wait until every group of `step` is back or lost, taking finished groups of any step
        as they come."""
        request = self.requests[step]
        while any(key in self.generators.slots or key in self.offered for key in request.keys):
            for group, slot_step, lane in self.generators.poll(wait_s=0.01):
                self._arrived(group, slot_step, lane)
            if self.ingress is not None:
                self._poll_ingress(step)
        request = self.requests.pop(step)
        request.groups.sort(key=drawn)  # the order they were drawn in, not the order they finished
        return request

    def _poll_ingress(self, step: int) -> None:
        """Take the verified outside groups; what the ingress gives back (offers of this step
        nobody leased, expired leases, rejected submissions) the mesh's generators run."""
        for group in self.ingress.collect():
            if (offer := self.offered.pop(group.key, None)) is not None:
                self._arrived(group, offer.step, "ingress")
            elif (slot := self.generators.slots.pop(group.key, None)) is not None:  # reclaimed, yet it came
                self._arrived(group, slot.step, "ingress")
        by_step: dict[int, list[GroupRequest]] = {}
        for group in self.ingress.reclaim(step):
            if (offer := self.offered.pop(group.key, None)) is not None:
                by_step.setdefault(offer.step, []).append(group)
        for slot_step, groups in sorted(by_step.items()):
            self.generators.deal(slot_step, groups)

    def _arrived(self, group: FinishedGroup, step: int, lane: str) -> None:
        """A finished group joins its step's request."""
        self.requests[step].groups.append(group)
        self.timeline.add(lane, group.started, group.finished, step)


def drawn(group: FinishedGroup) -> int:
    """Where the group was drawn in the run (`GroupStreams` keys groups `step/n`)."""
    return int(group.key.rpartition("/")[2])


def uninformative(group: FinishedGroup) -> bool:
    """Every rollout of the group got the same reward: their advantages are all 0."""
    return len({r.reward for r in group.rollouts}) <= 1
