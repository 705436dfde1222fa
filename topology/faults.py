"""What the controller does when a process or a host of the run fails.

Monarch reports a dead actor two ways: its pending and later calls raise `SupervisionError`,
and the failure reaches the client's `unhandled_fault_hook`, whose default exits the
process. The controller handles failures where it calls the actor (respawn a generator or
a teacher, stop on a trainer or a lost host), so the hook only logs.
"""

from __future__ import annotations

import logging
import socket

import monarch.actor
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

log = logging.getLogger(__name__)

__all__ = ["HostLost", "RunStopped", "SupervisionError", "install_fault_hook", "worker_reachable"]


class RunStopped(RuntimeError):
    """The run cannot go on (a trainer process or a worker host is gone); the message says
    what was lost, which checkpoint holds the run, and how to continue."""


class HostLost(Exception):
    """A host of the run is gone; the controller checkpoints if it can and stops with `RunStopped`."""

    def __init__(self, host: str, role: str, rank: int, why: str) -> None:
        super().__init__(f"{host} ({role} rank {rank}): {why}")
        self.host, self.role, self.rank, self.why = host, role, rank, why


def _log_failure(failure: monarch.actor.MeshFailure) -> None:
    log.warning("mesh failure (handled where its actor is called): %s", failure)


def install_fault_hook() -> None:
    """Keep the controller alive through actor failures: the call sites decide what they mean."""
    monarch.actor.unhandled_fault_hook = _log_failure


def worker_reachable(address: str, timeout_s: float = 3.0) -> bool:
    """Whether a worker's `tcp://` or `tls://` address (dial part of `dial@bind`) accepts a
    connection: a host whose worker loop is gone does not."""
    dial = address.split("@", 1)[0].partition("://")[2]
    host, _, port = dial.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
