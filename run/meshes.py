"""The run's meshes: where they are placed, spawning them, replacing a dead rank, and the hosts
found lost.

Generators and teachers are pools of replaceable ranks, however many hosts they span: a dead one
is respawned on its host while the others keep working. A rank whose host is gone, or a trainer
process that died, stops the run (`HostLost`, `RunStopped`); which hosts were lost is kept here
so the shutdown does not wait on them.
"""

from __future__ import annotations

from typing import Any

from monarch.spmd import setup_torch_elastic_env

from meshrl.actors.generator import GeneratorActor
from meshrl.actors.teacher import TeacherActor
from meshrl.actors.trainer import TrainerActor
from meshrl.configs.schema import RunConfig
from meshrl.run.run_dir import RunDir
from meshrl.topology.faults import HostLost, RunStopped, install_fault_hook
from meshrl.topology.placement import Placement
from meshrl.topology.pool import ActorPool, ProcMesh, stop_meshes


class Meshes:
    """The trainer mesh (one SPMD group) and the generator and teacher pools of a run."""

    def __init__(self, config: RunConfig, model_path: str, run: RunDir) -> None:
        """Place the meshes (topology config) and spawn their actors. Every mesh's actors are spawned
        before any is waited on, so they import and load side by side."""
        install_fault_hook()
        self.config, self.run = config, run
        self.lost_hosts: frozenset[int] = frozenset()  # host indices found gone (their meshes are not waited on)
        self.placement = Placement(config.topology)
        self.generators = ActorPool(self.placement, "generator", "generator", GeneratorActor, config, model_path)
        self.trainer_procs = self.placement.procs("trainer")
        setup_torch_elastic_env(self.trainer_procs)
        self.trainers = self.trainer_procs.spawn("trainer", TrainerActor, config, model_path).flatten("rank")
        trainers_ready = self.trainers.setup.call()
        self.teachers: ActorPool | None = None
        if config.teachers.members:
            cache = str(run.root / "teacher_cache.jsonl")
            self.teachers = ActorPool(self.placement, "teacher", "teacher", TeacherActor, config, model_path, cache)
        self.actors: list[dict[str, Any]] = list(trainers_ready.get().values()) + self.generators.infos()
        run.check_shared(lambda path: self.trainers.read_text.call(path).get().item(rank=0))
        if self.teachers is not None:
            self.actors += self.teachers.infos()
        run.write_topology(self.actors)

    def trainer_value(self, endpoint: str, *args: Any) -> Any:
        """Call a trainer endpoint on every rank (under FSDP2 the full weights are an all-gather)
        and return rank 0's answer."""
        return getattr(self.trainers, endpoint).call(*args).get().item(rank=0)

    def generator_alive(self, rank: int) -> bool:
        """Whether a generator rank's host still accepts connections (attach mode; a TCP connect)."""
        return self.placement.host_alive("generator", rank)

    def replace(self, pool: ActorPool, rank: int) -> None:
        """A dead generator or teacher rank: stop the run if its host is gone, else respawn it there."""
        role = pool.role
        if not self.placement.host_alive(role, rank):
            raise HostLost(self.placement.host_name(role, rank), role, rank, "its worker does not answer")
        try:
            info = pool.replace(rank)
        except Exception as exc:  # noqa: BLE001 - a host that cannot start a proc is as good as lost
            raise HostLost(self.placement.host_name(role, rank), role, rank, f"{type(exc).__name__}: {exc}") from None
        self.actors = [a for a in self.actors if (a["role"], a["rank"]) != (role, rank)] + [info]
        self.run.write_topology(self.actors)

    def host_lost(self, lost: HostLost) -> None:
        """Remember a lost host: the shutdown does not wait on its meshes."""
        self.lost_hosts |= {self.placement.host_index(lost.role, lost.rank)}

    def trainer_lost(self, error: Exception) -> RunStopped:
        """A trainer process died: no checkpoint can be taken; name a lost host if there is one."""
        place = self.config.topology.trainer
        firsts = range(0, place.size, place.procs)  # one rank per host: each host is probed once
        gone = [r for r in firsts if not self.placement.host_alive("trainer", r)]
        self.lost_hosts |= {self.placement.host_index("trainer", r) for r in gone}
        lost = [self.placement.host_name("trainer", r) for r in gone]
        where = f"worker host {', '.join(lost)} is lost" if lost else "a trainer process died"
        latest = self.run.latest_checkpoint()
        resume = f"checkpoint {latest.name}" if latest is not None else "no checkpoint yet (rerun starts over)"
        return RunStopped(f"{where} ({error}). Newest complete: {resume}; fix it and rerun with --resume.")

    def shutdown(self) -> None:
        """Stop every proc mesh (those on lost hosts are not waited on)."""
        meshes = [mesh for pool in (self.generators, self.teachers) if pool is not None for mesh in pool.proc_meshes]
        meshes.append(ProcMesh(self.trainer_procs, frozenset(range(self.config.topology.trainer.hosts)), "trainer"))
        stop_meshes(meshes, self.lost_hosts)
