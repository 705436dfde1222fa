"""Where the generator, trainer and teacher meshes run: this host, attached workers, or a SLURM job.

All three placements end in one Monarch host mesh; each role spans its first
`topology.<role>.hosts` hosts with `procs` processes on each (roles may share hosts, as a
colocated trainer and generator do). Attaching and SLURM go through Monarch's own
`attach_to_workers` and `SlurmJob`; nothing here opens a socket itself.

The processes this host starts for a role, first or replacing a dead one, ignore SIGINT: a terminal's
Ctrl-C reaches the whole foreground process group, and only the controller decides how a run ends
(run/stopping.py). A worker host's processes are its `meshrl worker`'s.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from monarch.actor import attach_to_workers, enable_transport, this_host
from monarch.job import SlurmJob

from meshrl.configs.schema import ROLES, TopologyConfig
from meshrl.topology.faults import worker_reachable
from meshrl.topology.worker import tls_env


def slurm_job(topology: TopologyConfig) -> SlurmJob:
    """The SLURM job that starts one Monarch worker per node, for the largest role, with the GPUs
    of every role on each node."""
    s = topology.slurm
    roles = [getattr(topology, role) for role in ROLES]
    gpus = sum(r.procs * r.gpus_per_proc for r in roles)  # roles take consecutive GPU ranges (topology.devices)
    return SlurmJob(
        meshes={"meshrl": max(r.hosts for r in roles)},
        python_exe=s.python_exe,
        slurm_args=s.sbatch_args,
        monarch_port=s.port,
        job_name=s.job_name,
        time_limit=s.time_limit,
        partition=s.partition,
        account=s.account,
        qos=s.qos,
        gpus_per_node=gpus or None,
        **({"log_dir": s.log_dir} if s.log_dir else {}),
    )


class Placement:
    """The host mesh of a run and the proc meshes of its roles."""

    def __init__(self, topology: TopologyConfig) -> None:
        self.topology = topology
        if topology.mode == "local":
            self.hosts = this_host()
        elif topology.mode == "attach":
            self.hosts = self._attach()
        else:
            job = slurm_job(topology)
            job.apply()
            self.hosts = job.state(cached_path=None).meshrl

    def _attach(self) -> Any:
        topology = self.topology
        scheme = topology.workers[0].partition("://")[0]
        wanted = tls_env(topology.tls.cert, topology.tls.key, topology.tls.ca) if scheme == "tls" else {}
        if any(os.environ.get(name) != path for name, path in wanted.items()):
            raise RuntimeError(
                f"tls:// workers: set {', '.join(f'{k}={v}' for k, v in wanted.items())} before Monarch is "
                "imported (it reads them when it loads); `meshrl train` does so from topology.tls"
            )
        enable_transport(topology.controller_address or f"{scheme}://127.0.0.1:0")
        hosts = attach_to_workers(ca="trust_all_connections", workers=topology.workers, name="meshrl")
        try:
            hosts.initialized.get(timeout=topology.attach_timeout_s)
        except Exception as exc:  # noqa: BLE001 - any attach failure: one message naming the workers
            raise RuntimeError(
                f"could not attach to topology.workers {topology.workers} within {topology.attach_timeout_s:.0f} s "
                f"({type(exc).__name__}: {exc}); is `meshrl worker --address ADDRESS` running for each, "
                "with certificates from the same CA for tls://?"
            ) from None
        return hosts

    def procs(self, role: str) -> Any:
        """A fresh proc mesh for `role`: `procs` processes on each of its hosts."""
        place = getattr(self.topology, role)
        return _spawn_procs(self._host_range(0, place.hosts), place.procs)

    def _host_range(self, start: int, stop: int) -> Any:
        """Hosts [start, stop) of the placement (this host alone in local mode)."""
        return self.hosts if self.topology.mode == "local" else self.hosts.slice(hosts=slice(start, stop))

    def host_index(self, role: str, rank: int) -> int:
        """The host of a role's flattened rank (ranks run hosts-major)."""
        return rank // getattr(self.topology, role).procs

    def host_name(self, role: str, rank: int) -> str:
        """The host of a role's rank as an operator knows it: its worker address where there is one."""
        index = self.host_index(role, rank)
        if self.topology.mode == "attach":
            return self.topology.workers[index]
        return (
            "this host"
            if self.topology.mode == "local"
            else f"SLURM node {index} of job {self.topology.slurm.job_name}"
        )

    def host_alive(self, role: str, rank: int) -> bool:
        """Whether the host of a role's rank can still run processes (attached workers are probed;
        this host is alive; a SLURM node is assumed alive until a respawn there fails)."""
        if self.topology.mode != "attach":
            return True
        return worker_reachable(self.topology.workers[self.host_index(role, rank)])

    def replacement_procs(self, role: str, rank: int) -> Any:
        """One fresh proc on the host of a role's rank, for an actor replacing a dead one."""
        index = self.host_index(role, rank)
        return _spawn_procs(self._host_range(index, index + 1), 1)


def _spawn_procs(hosts: Any, procs: int) -> Any:
    """`procs` processes on each of `hosts`, started with SIGINT ignored (an ignored signal stays ignored
    across exec; a handled one does not). Monarch starts them in the background, so SIGINT is ignored
    here until they are up: a Ctrl-C in that window (a fraction of a second) is not seen."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        mesh = hosts.spawn_procs(per_host={"procs": procs})
        mesh.initialized.get()
    finally:
        signal.signal(signal.SIGINT, before)
    return mesh
