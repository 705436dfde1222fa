"""Every run-config key with its type, default and meaning, read off the pydantic schema: what
`meshrl config keys` prints and what the manual's config reference is generated from, so
neither can drift from the code."""

from __future__ import annotations

import typing
from dataclasses import dataclass

from pydantic import BaseModel

from meshrl.configs.schema import RunConfig


@dataclass(frozen=True)
class ConfigKey:
    """One leaf of the config: `key` is dotted (`trainer.diloco.sync_every`); a tagged union's
    members appear as `loss[tis].cap`, a list of them as `teachers.members[].backend`."""

    key: str
    type: str
    default: str
    description: str

    @property
    def section(self) -> str:
        """The top-level section the key belongs to ('' for the run's own keys)."""
        head, dot, _ = self.key.partition(".")
        return head.split("[")[0] if dot else ""


def type_name(annotation: object) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return "|".join(str(v) for v in typing.get_args(annotation))
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def models_in(annotation: object) -> list[type[BaseModel]]:
    """The config models inside an annotation: itself, a tagged union's members, a list's items."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in models_in(arg)]


def union_tag(models: list[type[BaseModel]]) -> str:
    """The field a tagged union's members are told apart by."""
    return "type" if "type" in models[0].model_fields else "backend"


def config_keys(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[ConfigKey]:
    """Every leaf field under `model`; union members by tag."""
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        default = "(required)" if field.is_required() else repr(field.get_default(call_default_factory=True))
        models = models_in(field.annotation)
        if prefix.endswith("].") and name in ("type", "backend"):
            continue  # the tag is in the key already
        if len(models) == 1 and typing.get_origin(field.annotation) is not list:
            rows += config_keys(models[0], key + ".")
        elif models:
            tag_name = union_tag(models)
            tags = [m.model_fields[tag_name].default for m in models]
            list_key = f"{key}[]" if typing.get_origin(field.annotation) is list else key
            shown = "[]" if list_key != key else repr(getattr(field.get_default(call_default_factory=True), tag_name))
            rows.append(ConfigKey(f"{list_key}.{tag_name}", "|".join(tags), shown, field.description or ""))
            for tag, member in zip(tags, models, strict=True):
                rows += config_keys(member, f"{key}[{tag}].")
        else:
            rows.append(ConfigKey(key, type_name(field.annotation), default, field.description or ""))
    return rows
