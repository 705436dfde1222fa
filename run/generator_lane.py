"""The generator lane: groups dealt round-robin to the mesh's generator ranks and taken back as
they finish, through long-polled `take` calls, and what happens when a rank fails.

A rank that dies loses its groups in flight (counted) and is replaced on its host with the
current weights; a rank whose call raised (its scheduler stopped on an engine or task error) is
replaced the same way and its groups are dealt again, once; a rank slow to answer has its host
probed, so a lost host stops the run at once instead of after Monarch's supervision timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from monarch.actor import ActorError

from meshrl.rollouts.scheduler import FinishedGroup, GroupRequest
from meshrl.run.weights import WeightPublisher
from meshrl.topology.faults import SupervisionError

TAKE_WAIT_S = 1.0  # a generator's `take` answers within this, with whatever groups have finished
# A generator call unanswered this long has its worker host probed (attach mode; a TCP connect):
# a host that is gone is noticed at once instead of after Monarch's supervision timeout.
HOST_PROBE_S = 2.0


@dataclass
class GroupSlot:
    """A group dealt to a generator and not yet back: the step it is for, the rank and actor
    asked (a replaced rank has a new one), the request, and whether it was dealt again already
    after a generator failed on it."""

    step: int
    rank: int
    actor: Any
    group: GroupRequest
    redealt: bool = False


@dataclass
class PendingTake:
    """A generator's long-polled `take` (-> list[FinishedGroup]) and when its host was last
    known to answer (the call was made, or a probe found the host up)."""

    future: Any
    probed: float


class GeneratorLane:
    """`generators`: the pool (indexable by rank, `len` ranks); `alive(rank)`: whether a rank's
    host still answers; `weights` brings a replaced rank to the current version."""

    def __init__(self, generators: Any, alive: Callable[[int], bool], weights: WeightPublisher | None) -> None:
        self.generators, self.alive, self.weights = generators, alive, weights
        self.slots: dict[str, GroupSlot] = {}  # groups in flight, by key
        self.takes: dict[int, PendingTake] = {}  # generator rank -> its pending `take`
        self.dealt = 0  # groups dealt so far (round-robin)
        self.lost_rollouts = 0  # in flight on a generator that died
        self.errors = 0  # generator calls that raised (the rank was replaced)

    def deal(self, step: int, groups: list[GroupRequest], redealt: bool = False) -> None:
        """Hand groups round-robin to the generator ranks."""
        by_rank: dict[int, list[GroupRequest]] = {}
        for group in groups:
            rank = self.dealt % len(self.generators)
            self.dealt += 1
            by_rank.setdefault(rank, []).append(group)
            self.slots[group.key] = GroupSlot(step, rank, self.generators[rank], group, redealt)
        for rank, rank_groups in by_rank.items():
            submitted = self.generators[rank].submit.call_one(rank_groups)
            while True:
                try:
                    self._answer(rank, submitted, HOST_PROBE_S)
                    break
                except TimeoutError:
                    if self._probe_host(rank):
                        break

    def poll(self, wait_s: float) -> list[tuple[FinishedGroup, int, str]]:
        """The groups finished since the last poll, each with its step and lane (`generator r`);
        waits up to `wait_s` per rank."""
        arrived = []
        for rank in range(len(self.generators)):
            if rank not in self.takes:
                self.takes[rank] = PendingTake(self.generators[rank].take.call_one(TAKE_WAIT_S), time.monotonic())
            pending = self.takes[rank]
            try:
                groups = self._answer(rank, pending.future, wait_s)
            except TimeoutError:
                if time.monotonic() - pending.probed > HOST_PROBE_S:
                    pending.probed = time.monotonic()
                    self._probe_host(rank)
                continue
            if groups is None:  # the rank died or failed, and was replaced
                continue
            del self.takes[rank]
            for group in groups:
                slot = self.slots.pop(group.key, None)  # None: dropped meanwhile
                if slot is not None:
                    arrived.append((group, slot.step, f"generator {rank}"))
        return arrived

    def _answer(self, rank: int, future: Any, timeout: float) -> Any:
        """A rank's call answered within `timeout` (else TimeoutError); None when the rank died or
        its call raised, either handled here (the rank replaced)."""
        try:
            return future.get(timeout=timeout)
        except SupervisionError:
            self.died(rank)
        except ActorError as error:
            self.failed(rank, error)
        return None

    def died(self, rank: int) -> None:
        """Count the rank's groups in flight as lost, and replace it with one on the current
        version (once, however many calls found it dead)."""
        dead = self.generators[rank]
        for key, slot in list(self.slots.items()):
            if slot.actor is dead:
                self.lost_rollouts += slot.group.samples
                del self.slots[key]
        self.takes.pop(rank, None)
        self.weights.reload(rank)

    def _probe_host(self, rank: int) -> bool:
        """A rank slow to answer: if its host no longer accepts connections, handle the rank as
        dead now (which stops the run: its host is lost). Whether it was handled as dead."""
        if self.alive(rank):
            return False
        self.died(rank)
        return True

    def failed(self, rank: int, error: ActorError) -> None:
        """A rank's call raised: it is replaced like a dead one, and its groups are dealt again,
        once (a group that fails a second generator is counted lost, so no deterministic failure loops)."""
        self.errors += 1
        print(f"generator rank {rank} failed and is replaced: {str(error).strip().splitlines()[-1]}", flush=True)
        failed = self.generators[rank]
        again = [(key, slot) for key, slot in self.slots.items() if slot.actor is failed and not slot.redealt]
        for key, _ in again:
            del self.slots[key]
        try:  # free its engine now; its process ends with the run
            failed.close.call_one().get(timeout=HOST_PROBE_S * 5)
        except Exception:  # noqa: BLE001 - a generator too broken to close is replaced all the same
            pass
        self.died(rank)
        by_step: dict[int, list[GroupRequest]] = {}
        for _, slot in again:
            by_step.setdefault(slot.step, []).append(slot.group)
        for step, groups in sorted(by_step.items()):
            self.deal(step, groups, redealt=True)
