"""Python objects a config names by import path (`loss.import_path`, `task.import_path`)."""

from __future__ import annotations

import difflib
import importlib
import inspect
import typing
from collections.abc import Callable
from typing import Any

from pydantic import TypeAdapter, ValidationError


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


def checked_kwargs(path: str, function: Callable[..., Any], kwargs: dict[str, Any], key: str) -> dict[str, Any]:
    """`kwargs` checked against `function`'s signature and coerced to its annotations as pydantic does
    a config's fields (`"8"` from the command line becomes 8 for an `int`); a name it does not take or
    a value its annotation refuses is a ValueError of one line naming `key.name` and `path`."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without one: nothing to check against
        return dict(kwargs)
    parameters = {name: p for name, p in signature.parameters.items()
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}  # fmt: skip
    open_ended = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    try:
        hints = typing.get_type_hints(function.__init__ if inspect.isclass(function) else function)
    except (NameError, TypeError):  # an annotation that names what its module imports only for type checkers
        hints = {}
    checked = {}
    for name, value in kwargs.items():
        if name not in parameters:
            if open_ended:
                checked[name] = value
                continue
            close = difflib.get_close_matches(name, parameters, n=1)
            raise ValueError(
                f"{key}.{name}: {path} takes no {name!r}"
                + (f" — did you mean {close[0]!r}?" if close else "")
                + f" (it takes: {', '.join(parameters) or 'nothing'})"
            )
        if name not in hints:
            checked[name] = value
            continue
        try:
            checked[name] = TypeAdapter(hints[name]).validate_python(value)
        except ValidationError as exc:
            reason = exc.errors()[0]["msg"]
            hint = hints[name]
            shown = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
            raise ValueError(f"{key}.{name}: {value!r} does not fit {path}'s {name}: {shown} ({reason})") from None
    return checked
