"""Model directories a run builds for itself (the tiny model, a converted GGUF), written so that a
crash never leaves one that looks complete."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def ensure_model_dir(directory: str | Path, build: Callable[[Path], None]) -> Path:
    """`directory`, holding an HF model and its tokenizer: `build(tmp)` saves them into a temporary
    sibling that is renamed into place, unless a complete directory is there already."""
    directory = Path(directory)
    if (directory / "config.json").exists() and (directory / "tokenizer.json").exists():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        build(tmp)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory
