"""Which GPUs of its host each generator, trainer and teacher process uses.

On every host the roles take consecutive GPU ranges in `ROLES` order: the generator's procs
first (`procs × gpus_per_proc` GPUs), then the trainer's, then the teacher's. A role with
`gpus_per_proc = 0` runs on CPU. So a colocated generator and trainer never share a GPU
unless the host has too few, which is refused when the process starts.
"""

from __future__ import annotations

import os

import torch

from meshrl.configs.schema import ROLES, TopologyConfig


def role_gpus(topology: TopologyConfig, role: str, rank: int) -> list[int]:
    """The host-local GPU indices of `role`'s rank `rank` (ranks run hosts-major)."""
    offset = 0
    for name in ROLES:
        place = getattr(topology, name)
        if name == role:
            start = offset + (rank % place.procs) * place.gpus_per_proc
            return list(range(start, start + place.gpus_per_proc))
        offset += place.procs * place.gpus_per_proc
    raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")


def proc_device(topology: TopologyConfig, role: str, rank: int) -> torch.device:
    """The torch device of a role's process: its first GPU, or the CPU; refuses GPUs the host lacks."""
    gpus = role_gpus(topology, role, rank)
    if not gpus:
        return torch.device("cpu")
    available = torch.cuda.device_count()
    if gpus[-1] >= available:
        raise RuntimeError(
            f"topology.{role}.gpus_per_proc: {role} rank {rank} needs GPUs {gpus} of its host, which has {available}"
            " (GPUs are given out generator, trainer, teacher in turn; see README 'Devices')"
        )
    return torch.device("cuda", gpus[0])


def cpu_threads() -> int:
    """Intra-op threads of a CPU process: every core of its host. The generator and trainer
    processes share the host and compute at once only part of a step: a train-bound step
    (SmolLM2: 9 s of generation, 27 s of training on one core) left half the cores idle when each
    had its share. OpenMP's idle workers must sleep for the sharing to work (OMP_WAIT_POLICY =
    PASSIVE, which `meshrl` sets for every process it starts): spinning ones slowed 1 s training
    steps to 7-11 s on 2 cores."""
    return len(os.sched_getaffinity(0))
