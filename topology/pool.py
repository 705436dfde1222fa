"""A role's actors as separately replaceable ranks.

Generators and teachers are stateless between calls (a generator's weights are pushed to
it), so a dead one is replaced by a fresh actor in a new proc on the same host while the
others keep working: Monarch fails only calls that reach the dead rank.
"""

from __future__ import annotations

import logging
from typing import Any

from meshrl.topology.placement import Placement

log = logging.getLogger(__name__)


class ActorPool:
    """The actors of one role, spawned as one mesh over the role's hosts and addressed by rank."""

    def __init__(self, placement: Placement, role: str, name: str, actor: type, *args: Any) -> None:
        self.placement, self.role, self.name, self.actor, self.args = placement, role, name, actor, args
        procs = placement.procs(role)
        mesh = procs.spawn(name, actor, *args).flatten("rank")
        self.proc_meshes = [procs]
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
        self.proc_meshes.append(procs)
        mesh = procs.spawn(self.name, self.actor, *self.args, rank).flatten("rank")
        info = mesh.info.call().get(timeout=timeout_s).item(rank=0)
        self.ranks[rank] = mesh.slice(rank=0)
        self.replaced += 1
        log.warning("%s rank %d replaced by pid %s on %s", self.role, rank, info.get("pid"), info.get("host"))
        return info

    def infos(self) -> list[dict[str, Any]]:
        return [mesh.info.call_one().get() for mesh in self.ranks]

    def stop(self, timeout_s: float = 30.0) -> None:
        """Free every proc mesh this pool spawned; one that lost a proc or a host may refuse."""
        for procs in self.proc_meshes:
            try:
                procs.stop().get(timeout=timeout_s)
            except Exception as exc:  # noqa: BLE001 - a dead proc or host is what we are cleaning up after
                log.warning("stopping a %s proc mesh: %s: %s", self.role, type(exc).__name__, exc)
