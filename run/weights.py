"""The weight publisher: each new policy version from the trainer to the generators and to the
ingress, and a replaced generator brought to the current version.

This is the one place a weight path plugs in (a new engine's, an adapter's). The controller does
not wait for the generators' loads: they are kept as pending pulls and settled before the next
version is published (the trainer refills its buffer in place and removes older files, so earlier
reads must be done first).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from monarch.actor import ActorError

from meshrl.configs.schema import RunConfig
from meshrl.ingress.server import IngressServer
from meshrl.run.meshes import Meshes
from meshrl.run.run_dir import RunDir
from meshrl.topology.faults import RunStopped, SupervisionError
from meshrl.trainer.lora import lora_generators


class WeightPublisher:
    """Policy versions from trainer rank 0 to every generator rank (and the ingress's copy).

    `on_dead(rank)` is called for a generator found dead while its load was settled, `on_failed(rank,
    error)` for one whose load raised (its engine refuses to sample: replaced like a failed rank);
    the rollout feed owns what they had in flight, and sets both once it exists."""

    def __init__(self, config: RunConfig, run: RunDir, meshes: Meshes, ingress: IngressServer | None) -> None:
        self.config, self.run, self.meshes, self.ingress = config, run, meshes, ingress
        self.pulls: dict[int, Any] = {}  # generator rank -> its pending weight load
        self.version = 0  # the newest version published to the generators
        self.ingress_version = -1  # the newest version handed to the ingress
        self.on_dead: Callable[[int], None] = lambda rank: None
        self.on_failed: Callable[[int, ActorError], None] = lambda rank, error: None

    def publish(self, version: int, wait: bool = False) -> float:
        """The new policy to every generator and to the ingress (for outside workers and the
        verifier); returns the seconds the controller spent on it."""
        start = time.perf_counter()
        self._load(list(range(len(self.meshes.generators))), version, wait)
        self.publish_ingress(version)
        if wait:
            self.settle()
        return time.perf_counter() - start

    def publish_ingress(self, version: int) -> None:
        """Trainer rank 0 writes the version's safetensors file into the ingress's folder (a
        filesystem the controller shares, as for checkpoints); the ingress serves it in chunks."""
        if self.ingress is None or version == self.ingress_version:
            return
        path = self.run.root / "ingress" / f"step_{version}.safetensors"
        self.meshes.trainer_value("policy_weights_file", str(path), self.config.model.lora is not None)
        self.ingress.publish(version, path)
        self.ingress_version = version

    def reload(self, rank: int) -> None:
        """A dead generator rank replaced on its host and given the current version before it is
        dealt work; a replacement that dies at once stops the run."""
        self.pulls.pop(rank, None)
        self.meshes.replace(self.meshes.generators, rank)
        try:
            self._load([rank], self.version, wait=True)
            self.pulls.pop(rank).get()
        except SupervisionError:
            raise RunStopped(
                f"generator rank {rank} died again right after it was replaced; see the worker's log"
            ) from None
        except ActorError as error:
            raise RunStopped(
                f"generator rank {rank} could not load policy version {self.version} right after it was replaced: "
                f"{str(error).strip().splitlines()[-1]}"
            ) from None

    def settle(self) -> None:
        """Wait for the weight loads in flight; a generator that died meanwhile goes to `on_dead`,
        one whose load raised to `on_failed`."""
        while self.pulls:
            rank, future = self.pulls.popitem()
            try:
                future.get()
            except SupervisionError:
                self.on_dead(rank)
            except ActorError as error:
                self.on_failed(rank, error)

    def _load(self, ranks: list[int], version: int, wait: bool) -> None:
        """Trainer rank 0's weights → these generator ranks, through the trainer's registered RDMA
        buffer or a safetensors file (both read by the generators themselves) or as pickled
        tensors; the loads are left in `pulls`. `wait`: a generator applies them before its next
        decode step rather than between steps."""
        self.version = version  # a generator replaced while earlier loads settle gets this one
        self.settle()  # the buffer is refilled in place, old files removed: earlier reads must be done
        generators, sync = self.meshes.generators, self.config.generator.weight_sync
        adapters = lora_generators(self.config)  # LoRA on HF engines: the adapters alone travel
        if sync == "rdma":
            buffer, layout = self.meshes.trainer_value("policy_weights_rdma", adapters)
            for rank in ranks:
                self.pulls[rank] = generators[rank].pull_weights.call_one(buffer, layout, version, wait)
        elif sync == "filesystem":
            path = self.meshes.trainer_value("policy_weights_file", str(self.run.weights_file(version)), adapters)
            self.run.prune_weights(keep=Path(path))  # every earlier version's reads are settled
            for rank in ranks:
                self.pulls[rank] = generators[rank].read_weights.call_one(path, version, wait)
        else:
            weights = self.meshes.trainer_value("policy_weights", adapters)
            for rank in ranks:
                self.pulls[rank] = generators[rank].load_weights.call_one(weights, version, wait)
