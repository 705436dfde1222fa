"""Where a run's `model.path` lives on disk: the tiny model is built and a GGUF file converted into
a directory the caller owns; anything else is already a path or hub id."""

from __future__ import annotations

from pathlib import Path

from meshrl.configs.schema import RunConfig
from meshrl.models.gguf import ensure_gguf, is_gguf
from meshrl.models.tiny import ensure_tiny


def resolve_model(config: RunConfig, directory: str | Path) -> str:
    """The HF model directory or hub id `config.model.path` names; `tiny` and GGUF files are made
    under `directory` on first use and reused after."""
    if config.model.path == "tiny":
        return str(ensure_tiny(Path(directory) / "tiny_model", config.model.tiny, seed=config.seed))
    if is_gguf(config.model.path):
        return str(ensure_gguf(config.model.path, Path(directory) / "gguf_model"))
    return config.model.path
