"""Python objects a config names by import path (`loss.import_path`, `task.import_path`)."""

from __future__ import annotations

import importlib


def import_object(path: str) -> object:
    """Resolve 'pkg.mod.name' or 'pkg.mod:name'."""
    module_name, sep, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not name:
        raise ValueError(f"import path {path!r} must look like 'pkg.module.name' or 'pkg.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} of {path!r}: {exc}") from exc
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {name!r} (from {path!r})") from None
