"""A role's actors as separately replaceable ranks.

Generators and teachers are stateless between calls (a generator's weights are pushed to
it), so a dead one is replaced by a fresh actor in a new proc on the same host while the
others keep working: Monarch fails only calls that reach the dead rank. A run's proc meshes are freed together
(`stop_meshes`), without waiting on a host that is gone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from meshrl.topology.placement import Placement

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcMesh:
    """A proc mesh with the host indices it spans, so a shutdown knows which sit on a lost host."""

    procs: Any
    hosts: frozenset[int]
    role: str


class ActorPool:
    """The actors of one role, spawned as one mesh over the role's hosts and addressed by rank."""

    def __init__(self, placement: Placement, role: str, name: str, actor: type, *args: Any) -> None:
        self.placement, self.role, self.name, self.actor, self.args = placement, role, name, actor, args
        procs = placement.procs(role)
        mesh = procs.spawn(name, actor, *args).flatten("rank")
        self.proc_meshes = [ProcMesh(procs, frozenset(range(getattr(placement.topology, role).hosts)), role)]
        self.ranks = [mesh.slice(rank=i) for i in range(mesh.extent["rank"])]
        self.replaced = 0

    def __len__(self) -> int:
        return len(self.ranks)

    def __getitem__(self, rank: int) -> Any:
        """The one-actor mesh of `rank`."""
        return self.ranks[rank]

    def replace(self, rank: int, timeout_s: float = 120.0) -> dict[str, Any]:
        """A new actor for a dead rank, in a new proc on the same host; returns its `info`."""
        procs = self.placement.replacement_procs(self.role, rank)
        self.proc_meshes.append(ProcMesh(procs, frozenset({self.placement.host_index(self.role, rank)}), self.role))
        mesh = procs.spawn(self.name, self.actor, *self.args, rank).flatten("rank")
        info = mesh.info.call().get(timeout=timeout_s).item(rank=0)
        self.ranks[rank] = mesh.slice(rank=0)
        self.replaced += 1
        log.warning("%s rank %d replaced by pid %s on %s", self.role, rank, info.get("pid"), info.get("host"))
        return info

    def infos(self) -> list[dict[str, Any]]:
        return [mesh.info.call_one().get() for mesh in self.ranks]


def stop_meshes(meshes: list[ProcMesh], lost_hosts: frozenset[int] = frozenset(), timeout_s: float = 30.0) -> None:
    """Free proc meshes all at once (each stop takes Monarch a second or two), then wait for them
    within one deadline. A mesh on a lost host is asked to stop but not waited for: its stop cannot
    finish before Monarch's own timeout (about 30 s), and its live procs stop without the answer."""
    stopping = [(mesh, mesh.procs.stop()) for mesh in meshes]
    deadline = time.monotonic() + timeout_s
    for mesh, future in stopping:
        if mesh.hosts & lost_hosts:
            log.warning(
                "not waiting for the %s proc mesh on lost host(s) %s to stop",
                mesh.role,
                sorted(mesh.hosts & lost_hosts),
            )
            continue
        try:
            future.get(timeout=max(0.1, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - a dead proc or host is what we are cleaning up after
            log.warning("stopping a %s proc mesh: %s: %s", mesh.role, type(exc).__name__, exc)
