"""The weight publisher against real HF engines, with plain-Python stand-ins for the actors'
endpoints: each version reaches every generator through the safetensors file the trainer writes,
earlier files are removed once read, and a generator found dead while its load settles is
replaced and brought to the current version before it is dealt work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from monarch.actor import ActorError
from safetensors.torch import load_file

from meshrl.configs.loader import load_config
from meshrl.inference.hf_engine import HFEngine
from meshrl.inference.weights import save_weights_file
from meshrl.models.tiny import ensure_tiny
from meshrl.run.run_dir import RunDir
from meshrl.run.weights import WeightPublisher
from meshrl.topology.faults import RunStopped, SupervisionError


class _Done:
    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def get(self, timeout: float | None = None) -> Any:
        return self.fn(*self.args)


class EngineGenerator:
    """A generator rank's weight endpoints over a real engine; `dead`: its calls fail as a dead
    actor's; `garbled`: the file it reads has a weight of the wrong shape, so its engine refuses the
    load and the call fails as an endpoint that raised."""

    def __init__(self, model: Path, dead: bool = False, garbled: bool = False) -> None:
        self.engine, self.dead, self.garbled = HFEngine.from_pretrained(str(model)), dead, garbled
        self.read_weights = self  # call_one(path, version, wait)

    def call_one(self, path: str, version: int, wait: bool) -> _Done:
        return _Done(self._read, path, version)

    def _read(self, path: str, version: int) -> None:
        if self.dead:
            raise SupervisionError("generator actor died")
        weights = load_file(path)
        if self.garbled:
            weights["model.norm.weight"] = torch.ones(3)
        try:
            self.engine.load_weights(weights, version)
        except Exception as error:  # noqa: BLE001 - what Monarch hands the caller of an endpoint that raised
            raise ActorError(error) from None


class FakeMeshes:
    """Trainer rank 0 with `weights` (the policy) and a generator pool of real engines; a replaced
    rank gets a fresh engine (the model's initial weights), dead again if `replacement_dies`."""

    def __init__(
        self, model: Path, ranks: int, replacement_dies: bool = False, replacement_garbled: bool = False
    ) -> None:
        self.model, self.replacement_dies, self.replacement_garbled = model, replacement_dies, replacement_garbled
        self.generators = [EngineGenerator(model) for _ in range(ranks)]
        self.weights = {k: v.clone() for k, v in self.generators[0].engine.model.state_dict().items()}
        self.replaced: list[int] = []

    def trainer_value(self, endpoint: str, path: str, adapters_only: bool = False) -> str:
        assert endpoint == "policy_weights_file" and not adapters_only  # no model.lora here: full weights
        save_weights_file(self.weights, Path(path))
        return path

    def replace(self, pool: list[EngineGenerator], rank: int) -> None:
        pool[rank] = EngineGenerator(self.model, dead=self.replacement_dies, garbled=self.replacement_garbled)
        self.replaced.append(rank)

    def step(self) -> None:
        """The trainer's optimizer step: every weight moves."""
        for tensor in self.weights.values():
            tensor.add_(0.01)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return ensure_tiny(tmp_path_factory.mktemp("tiny") / "model")


def _publisher(tmp_path: Path, meshes: FakeMeshes) -> WeightPublisher:
    config = load_config(["--output-dir", str(tmp_path), "--generator.weight-sync", "filesystem"])
    return WeightPublisher(config, RunDir(tmp_path), meshes, ingress=None)


def _serves(generator: EngineGenerator, meshes: FakeMeshes, version: int) -> bool:
    state = generator.engine.model.state_dict()
    return generator.engine.version == version and all(torch.equal(state[k], meshes.weights[k]) for k in state)


def test_each_version_reaches_every_generator_and_earlier_files_are_removed(tmp_path, model):
    meshes = FakeMeshes(model, ranks=2)
    publisher = _publisher(tmp_path, meshes)
    for version in (1, 2):
        meshes.step()
        publisher.publish(version)
        publisher.settle()
        assert all(_serves(g, meshes, version) for g in meshes.generators)
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [f"step_{version}.safetensors"]


def test_a_generator_found_dead_while_its_load_settles_is_replaced_on_the_current_version(tmp_path, model):
    meshes = FakeMeshes(model, ranks=2)
    publisher = _publisher(tmp_path, meshes)
    publisher.on_dead = publisher.reload  # the rollout feed also drops what it had in flight
    meshes.step()
    meshes.generators[1].dead = True
    publisher.publish(1, wait=True)
    assert meshes.replaced == [1] and all(_serves(g, meshes, 1) for g in meshes.generators)


def test_a_replacement_that_dies_at_once_stops_the_run(tmp_path, model):
    meshes = FakeMeshes(model, ranks=1, replacement_dies=True)
    publisher = _publisher(tmp_path, meshes)
    with pytest.raises(RunStopped, match="generator rank 0 died again right after it was replaced"):
        publisher.reload(0)


def test_a_generator_whose_load_fails_is_replaced_on_the_current_version(tmp_path, model):
    """The engine refused the version (its endpoint raised): the rollout feed's `failed` handler gets
    the rank (it replaces it and deals its groups again); here it reloads it, as `died` does."""
    meshes = FakeMeshes(model, ranks=2)
    publisher = _publisher(tmp_path, meshes)
    failed: list[int] = []
    publisher.on_failed = lambda rank, error: (failed.append(rank), publisher.reload(rank))
    meshes.step()
    meshes.generators[0].garbled = True
    publisher.publish(1, wait=True)
    assert failed == [0] and meshes.replaced == [0] and all(_serves(g, meshes, 1) for g in meshes.generators)


def test_a_replacement_that_cannot_load_the_current_version_stops_the_run_naming_it(tmp_path, model):
    meshes = FakeMeshes(model, ranks=1, replacement_garbled=True)
    publisher = _publisher(tmp_path, meshes)
    with pytest.raises(
        RunStopped, match=r"generator rank 0 could not load policy version 0 right after it was replaced: .*norm"
    ):
        publisher.reload(0)
