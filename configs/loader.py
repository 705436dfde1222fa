"""Compose a RunConfig from defaults, `@ file.toml` presets and dotted CLI overrides.

Sources apply left to right: later presets deep-merge over earlier ones, overrides over
both. Free-form dicts (`task.kwargs`, `loss.kwargs`) deep-merge too, keeping their keys verbatim;
an empty table (`{}`) clears one (or a table inside one), and sources that name another factory
(`task.import_path`, `loss.import_path`; a run of command-line overrides counts as one source) start
its kwargs afresh: the earlier ones were another function's.
Every leaf remembers where it was set, so a validation error names the key *and* the file (or
the command line) it came from; an unknown key also the union member that refused it (with where
its tag was set) and the nearest valid key. Over a run's own resolved config (`before`), a source
that switches a union's member (`--loss.type ipo`) keeps the keys the new member takes and drops
the old member's others.
"""

from __future__ import annotations

import copy
import difflib
import itertools
import json
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import BaseModel, ValidationError

from meshrl.configs.keys import models_in, union_tag
from meshrl.configs.schema import FREE_FORM, RunConfig, TaskConfig

COMMAND_LINE = "the command line"


class ConfigError(ValueError):
    """A config source could not be read or the composed config is invalid."""


# A source's place in the order, and its name: where a key was set last.
Origin = tuple[int, str]


def _norm_key(key: str) -> str:
    return key.replace("-", "_")


def _normalise(data: dict[str, Any]) -> dict[str, Any]:
    """Kebab-case keys are accepted for schema keys; free-form dicts (kwargs) keep theirs."""
    out = {}
    for key, value in data.items():
        key = _norm_key(key)
        out[key] = _normalise(value) if isinstance(value, dict) and key not in FREE_FORM else value
    return out


def _merge(
    dst: dict[str, Any], src: dict[str, Any], origin: Origin, where: dict[tuple[str, ...], Origin], prefix=()
) -> None:
    for key, value in src.items():
        path = (*prefix, key)
        clears = not value and any(part in FREE_FORM for part in path)  # `{}` in a free-form dict replaces
        if isinstance(value, dict) and isinstance(dst.get(key), dict) and not clears:
            _merge(dst[key], value, origin, where, path)
            continue
        dst[key] = value
        _forget(where, path)
        _record(value, origin, where, path)


def _forget(where: dict[tuple[str, ...], Origin], path: tuple[str, ...]) -> None:
    for known in [p for p in where if p[: len(path)] == path]:
        del where[known]


# Sections whose `kwargs` are the keyword arguments of the function their `import_path` names, and
# the factory a section names when no source does.
FACTORIES = {"task": TaskConfig.model_fields["import_path"].default, "loss": None}


def _factories_named(sources: list[tuple[str, dict[str, Any]]]) -> dict[str, str]:
    """Section -> the import path the last of `sources` that names one names."""
    named = {}
    for _, partial in sources:
        for section in FACTORIES:
            node = partial.get(section)
            if isinstance(node, dict) and "import_path" in node:
                named[section] = node["import_path"]
    return named


def _drop_replaced_factory_kwargs(
    merged: dict[str, Any], named: dict[str, str], where: dict[tuple[str, ...], Origin]
) -> None:
    """Sources naming another factory than the merged one drop the kwargs set so far (another
    function's), so that they are not merged into the new one's."""
    for section, path in named.items():
        old = merged.get(section)
        if isinstance(old, dict) and "kwargs" in old and path != old.get("import_path", FACTORIES[section]):
            del old["kwargs"]
            _forget(where, (section, "kwargs"))


def _record(value: Any, origin: Origin, where: dict[tuple[str, ...], Origin], path: tuple[str, ...]) -> None:
    where[path] = origin
    if isinstance(value, dict):
        for key, sub in value.items():
            _record(sub, origin, where, (*path, key))


def _parse_value(key: str, raw: str) -> Any:
    """CLI values stay strings for pydantic's lax parsing, except JSON lists/dicts and null."""
    text = raw.strip()
    if text.lower() in ("null", "none"):
        return None
    if text.startswith(("[", "{")):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{COMMAND_LINE}: --{key}: value {raw!r} looks like JSON but does not parse: {exc}"
            ) from None
    return raw


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    parts = dotted.split(".")
    if not all(parts):
        raise ConfigError(f"malformed override key '--{dotted}'")
    # kebab-case is normalised up to (and including) a free-form dict's own key
    for i, part in enumerate(parts):
        parts[i] = _norm_key(part)
        if parts[i] in FREE_FORM:
            break
    out: dict[str, Any] = value
    for part in reversed(parts):
        out = {part: out}
    return out


def read_preset(path: str | Path) -> dict[str, Any]:
    """Read one TOML preset; errors name the file (and line, for syntax errors)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: preset file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read preset: {exc}") from None
    try:
        return _normalise(tomllib.loads(text))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def parse_sources(args: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """Split CLI words into ordered (origin, partial config) sources.

    Forms: `@ file.toml` or `@file.toml`; `--a.b value`, `--a.b=value`; a bare `--flag`
    followed by another `--` word or nothing means true, a bare `--no-flag` (`--a.no-b`) false.
    """
    sources: list[tuple[str, dict[str, Any]]] = []
    i = 0
    while i < len(args):
        word = args[i]
        if word == "@":
            if i + 1 >= len(args):
                raise ConfigError("'@' must be followed by a TOML preset path")
            sources.append((args[i + 1], read_preset(args[i + 1])))
            i += 2
        elif word.startswith("@"):
            sources.append((word[1:], read_preset(word[1:])))
            i += 1
        elif word.startswith("--") and len(word) > 2:
            key, eq, raw = word[2:].partition("=")
            if not eq:
                if i + 1 < len(args) and not args[i + 1].startswith(("--", "@")):
                    raw = args[i + 1]
                    i += 1
                else:
                    head, dot, last = key.rpartition(".")
                    negated = last.startswith(("no-", "no_"))
                    key, raw = (f"{head}{dot}{last[3:]}", "false") if negated else (key, "true")
            sources.append((COMMAND_LINE, _nest(key, _parse_value(key, raw))))
            i += 1
        else:
            raise ConfigError(f"unexpected argument {word!r}: expected '@ preset.toml' or '--dotted.key value'")
    return sources


def _is_union_tag(node: Any, part: Any, rest: tuple[Any, ...]) -> bool:
    """pydantic puts a tagged union's tag into error locations (loss.<type>.key)."""
    if not isinstance(node, dict) or part in node:
        return False
    return part in (node.get("type"), node.get("backend")) or (bool(rest) and rest[0] in node)


def _origin_of(loc: tuple[Any, ...], merged: dict[str, Any], where: dict[tuple[str, ...], Origin]) -> tuple[str, str]:
    """Map a pydantic error location to a dotted key and the last source that set it (or below it)."""
    path: list[str] = []
    node: Any = merged
    for i, part in enumerate(loc):
        if _is_union_tag(node, part, loc[i + 1 :]):
            continue
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            node = None
        path.append(str(part))
    if not path:  # a check across sections: it read every source
        return "", ", ".join(dict.fromkeys(origin for _, origin in sorted(set(where.values())))) or "the defaults"
    for n in range(len(path), 0, -1):
        prefix = tuple(path[:n])
        origins = [origin for p, origin in where.items() if p[:n] == prefix]
        if origins:
            return ".".join(path), max(origins)[1]
    return ".".join(path), "the defaults"


@dataclass
class _Place:
    """Where an unknown key sits: the config model it is not a field of, the dotted path to that model
    (no union tags), and, when the model is a tagged union's member, its tag field and value and
    whether the merged sources gave that tag (else the schema's default member)."""

    model: type[BaseModel]
    path: tuple[str, ...]
    tag: tuple[str, str] | None = None
    tag_given: bool = False


def _place(loc: tuple[Any, ...], merged: dict[str, Any]) -> _Place | None:
    """Walk a pydantic error location from RunConfig to the model holding its last part: list
    indices are skipped, and a union's tag part picks the member pydantic validated."""
    models: list[type[BaseModel]] = [RunConfig]
    place = _Place(RunConfig, ())
    node: Any = merged
    for part in loc[:-1]:
        if isinstance(part, int):
            place.path = (*place.path, str(part))
            node = node[part] if isinstance(node, list) else None
        elif len(models) > 1:  # the union's tag
            tag = union_tag(models)
            models = [m for m in models if m.model_fields[tag].default == part]
            place.tag, place.tag_given = (tag, part), isinstance(node, dict) and tag in node
        elif part in models[0].model_fields:
            models = models_in(models[0].model_fields[part].annotation)
            place.path, place.tag = (*place.path, part), None
            node = node.get(part) if isinstance(node, dict) else None
        else:
            return None
        if not models:
            return None
    place.model = models[0]
    return place if len(models) == 1 else None


def _set_by(path: tuple[str, ...], where: dict[tuple[str, ...], Origin]) -> str:
    """The source that last set `path`, or the list (set whole) it is in."""
    found = next((where[path[:n]] for n in range(len(path), 0, -1) if path[:n] in where), (0, "the defaults"))
    return f"on {found[1]}" if found[1] == COMMAND_LINE else f"in {found[1]}"


def _unknown_key_hint(loc: tuple[Any, ...], merged: dict[str, Any], where: dict[tuple[str, ...], Origin]) -> str:
    """What follows "unknown key 'k'": in a tagged union's member, which member refused it, where its
    tag was set and what it takes (the key may be another loss.type's); and the nearest valid key."""
    place = _place(loc, merged)
    if place is None:
        return ""
    fields = place.model.model_fields
    names = sorted(fields, key=lambda name: bool(models_in(fields[name].annotation)))  # sections last
    hint = ""
    if place.tag is not None:
        tag, value = place.tag
        tag_key = (*place.path, tag)
        given = f"set {_set_by(tag_key, where)}" if place.tag_given else "the default"
        takes = ", ".join(name for name in names if name != tag)
        hint = f" for {'.'.join(tag_key)} '{value}' ({given}), which takes: {takes}"
    close = difflib.get_close_matches(str(loc[-1]), names, n=1)
    return hint + (f" — did you mean '{'.'.join((*place.path, close[0]))}'?" if close else "")


def _format_errors(exc: ValidationError, merged: dict[str, Any], where: dict[tuple[str, ...], Origin]) -> str:
    lines = []
    for err in exc.errors():
        key, origin = _origin_of(tuple(err["loc"]), merged, where)
        if err["type"] == "extra_forbidden":
            lines.append(f"{origin}: unknown key '{key}'{_unknown_key_hint(tuple(err['loc']), merged, where)}")
        else:
            shown = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
            lines.append(f"{origin}: {f'{key}: ' if key else ''}{err['msg']}{shown}")
    return "invalid config:\n  " + "\n  ".join(lines)


# PRIME-RL's names for what meshrl calls otherwise (docs/reference/run-configs.md): its loss section
# lives under `trainer`, and its DPPO+KL loss is `type = "default"`.
PRIME_RL_LOSS_TYPES = {"default": "dppo_kl"}


def _loss_out_of_trainer(partial: dict[str, Any]) -> dict[str, Any]:
    """A copy of a source (later sources must not edit it) with PRIME-RL's `trainer.loss` merged over
    its `loss`, so that each source's loss merges (and names its factory) in the source's turn."""
    partial = copy.deepcopy(partial)
    trainer = partial.get("trainer")
    if isinstance(trainer, dict) and "loss" in trainer:
        loss = trainer.pop("loss")
        if isinstance(loss, dict) and isinstance(partial.get("loss"), dict):
            _merge(partial["loss"], loss, (0, ""), {})
        else:
            partial["loss"] = loss
        if not trainer:
            del partial["trainer"]
    return partial


def _prime_rl_loss_types(merged: dict[str, Any]) -> None:
    loss = merged.get("loss")
    if isinstance(loss, dict) and loss.get("type") in PRIME_RL_LOSS_TYPES:
        loss["type"] = PRIME_RL_LOSS_TYPES[loss["type"]]


TaggedUnion = tuple[tuple[str, ...], str, dict[str, type[BaseModel]]]  # path, tag field, members by tag value


def _tagged_unions(model: type[BaseModel] = RunConfig, path: tuple[str, ...] = ()) -> list[TaggedUnion]:
    """The schema's tagged-union sections outside lists (a list is always set whole)."""
    found: list[TaggedUnion] = []
    for name, field in model.model_fields.items():
        models = models_in(field.annotation)
        if typing.get_origin(field.annotation) is list or not models:
            continue
        if len(models) == 1:
            found += _tagged_unions(models[0], (*path, name))
        else:
            tag = union_tag(models)
            found.append(((*path, name), tag, {m.model_fields[tag].default: m for m in models}))
    return found


TAGGED_UNIONS = _tagged_unions()


def _drop_switched_members_keys(merged: dict[str, Any], where: dict[tuple[str, ...], Origin], resolved: int) -> None:
    """A run's own config (the first `resolved` sources) holds every key of its union members. A later
    source that switches the member (loss.type) keeps the keys the new member takes; the old member's
    others were never asked for, so they go (a preset's stay, and are refused by name)."""
    for path, tag, members in TAGGED_UNIONS:
        node: Any = merged
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        switched = where.get((*path, tag))
        if not isinstance(node, dict) or node.get(tag) not in members or switched is None:
            continue
        taken = members[node[tag]].model_fields
        for key in [key for key in node if key not in taken]:
            set_at = where.get((*path, key))
            if set_at is not None and set_at[0] < min(resolved, switched[0]):
                del node[key]
                for known in [p for p in where if p[: len(path) + 1] == (*path, key)]:
                    del where[known]


def load_config(
    args: list[str] | None = None, before: list[tuple[str, dict[str, Any]]] = (), only: tuple[str, ...] | None = None
) -> RunConfig:
    """Compose defaults, presets and overrides into a validated RunConfig; `before`: (origin,
    partial config) sources applied ahead of `args`, a run's own resolved config (its record and
    recorded changes). `only`: the top-level keys taken from the sources, the rest left at their
    defaults (where a resume's run is, before the run's config that the rest applies over is read)."""
    merged: dict[str, Any] = {}
    where: dict[tuple[str, ...], Origin] = {}
    sources = [(origin, _loss_out_of_trainer(partial)) for origin, partial in [*before, *parse_sources(args or [])]]
    for order, (origin, partial) in enumerate(sources):
        if origin != COMMAND_LINE:
            _drop_replaced_factory_kwargs(merged, _factories_named([(origin, partial)]), where)
        elif order == 0 or sources[order - 1][0] != COMMAND_LINE:  # a run of overrides names its factory as one
            run = list(itertools.takewhile(lambda source: source[0] == COMMAND_LINE, sources[order:]))
            _drop_replaced_factory_kwargs(merged, _factories_named(run), where)
        _merge(merged, partial, (order, origin), where)
    if only is not None:
        merged = {key: value for key, value in merged.items() if key in only}
    _prime_rl_loss_types(merged)
    _drop_switched_members_keys(merged, where, len(before))
    try:
        return RunConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, merged, where)) from None


def to_toml(config: RunConfig) -> str:
    """The resolved config as TOML that `@` reads back to the same config (None fields are omitted, and
    so are the per-invocation flags resume and overwrite)."""
    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True))
