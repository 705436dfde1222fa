"""A run's own config: what `--resume` and `meshrl eval` start from, and what a resume may change.

A run writes its resolved config to DIR/config.toml once, when it starts fresh. Every change a
resume makes is appended to DIR/config_changes.jsonl with its date, so config.toml stays the record
of how the run started and the two together say what it trains with now. A resume composes them
with whatever presets and overrides come beside `--resume`, so a forgotten preset changes nothing;
a changed setting that alters training is refused (naming the keys) unless the user passes
`--allow-config-change`. A section whose kind changed (another loss.type, model.lora turned on or
off) is recorded whole, so setting each recorded key replays exactly the config the run used; a
resume whose record would not replay so is refused before anything is recorded, and so is one that
turns model.lora on for a run that trained full weights. `resume` and `overwrite` belong to one
invocation and are never recorded or replayed.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from meshrl.configs.loader import FACTORIES, ConfigError, load_config, read_preset
from meshrl.configs.schema import FREE_FORM, RunConfig

RECORD = "config.toml"
CHANGES = "config_changes.jsonl"
ALLOW_CHANGE = "--allow-config-change"
# Keys a resume changes freely: how long the run goes, where and how it is watched and saved, and
# where its hosts are. Everything else alters what is trained.
FREE_KEYS = ("max_steps", "output_dir", "ckpt.", "metrics.", "eval.", "generator.weight_sync", "topology.mode",
             "topology.workers", "topology.controller_address", "topology.attach_timeout_s", "topology.tls.",
             "topology.slurm.")  # fmt: skip
# What one invocation does with output_dir (resume, overwrite): never part of a run's config, though
# a record an earlier meshrl wrote may hold them.
PER_INVOCATION = tuple(name for name, field in RunConfig.model_fields.items() if field.exclude)


def changed(recorded: BaseModel, now: BaseModel, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """The settings whose values differ: dotted key -> (recorded, now). A section whose kind changed
    (another union member, or turned on or off) is one key with both values whole, so that setting
    the key to its new value replays it; lists and free-form dicts are whole values too."""
    out: dict[str, tuple[Any, Any]] = {}
    for name, field in type(recorded).model_fields.items():
        if field.exclude:
            continue
        was, value, key = getattr(recorded, name), getattr(now, name), f"{prefix}{name}"
        if isinstance(was, BaseModel) and type(was) is type(value):
            out.update(changed(was, value, f"{key}."))
        elif to_jsonable_python(was) != to_jsonable_python(value):
            out[key] = (to_jsonable_python(was), to_jsonable_python(value))
    return out


def alters_training(key: str) -> bool:
    return not any(key == free or (free.endswith(".") and key.startswith(free)) for free in FREE_KEYS)


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _as_source(changes: dict[str, Any]) -> dict[str, Any]:
    """Changes (dotted key -> value now) as a partial config that sets each key to its value."""
    nested: dict[str, Any] = {}
    for key, now in changes.items():
        *path, last = key.split(".")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        node[last] = now
    return nested


def _replayed(origin: str, now: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A resume's changes (dotted key -> value now) as sources that set each key to its value: a
    free-form dict (`task.kwargs`) is recorded whole, and merges, so it is cleared first."""
    cleared = {key: {} for key in now if key.rsplit(".", 1)[-1] in FREE_FORM}
    return [(origin, _as_source(cleared))] * bool(cleared) + [(origin, _as_source(now))]


def run_sources(run_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    """The run's config as sources: its record, then each resume's recorded changes in order."""
    record = run_dir / RECORD
    started = {key: value for key, value in read_preset(record).items() if key not in PER_INVOCATION}
    sources = [(str(record), started)]
    changes = run_dir / CHANGES
    if changes.exists():
        for n, line in enumerate(changes.read_text().splitlines(), 1):
            try:
                sources += _replayed(f"{changes}:{n}", {k: c["now"] for k, c in json.loads(line)["changes"].items()})
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ConfigError(f"{changes}:{n}: not a config change record ({exc})") from None
    return sources


def run_config(run_dir: Path, sources: list[str] | None = None) -> RunConfig:
    """The config the run at `run_dir` trains with now (its record with the recorded changes
    replayed), `sources` on top: what a resume, `meshrl eval` and `meshrl export` read."""
    return load_config(sources, before=run_sources(run_dir))


def _refuse_adapter_switches(run_dir: Path, before: RunConfig, resumed: RunConfig) -> None:
    """A run without adapters has trained its full weights, but HF generators and outside rollout
    workers hold the base from model.path and get only the adapters: adapters over another base
    could not be served, so a resume cannot turn them on (turning them off merges them, and goes on).
    An island cannot turn them off either: the islands' DiLoCo outer state is the adapters alone,
    and the other islands go on averaging adapters with it."""
    if before.model.lora is None and resumed.model.lora is not None:
        raise ConfigError(
            f"--resume: model.lora cannot be turned on for {run_dir}, whose checkpoints hold full weights (generators "
            "and rollout workers hold the base from model.path and get only the adapters); export the run "
            f"(meshrl export {run_dir} DIR) and start a new run with --model.path DIR --model.lora ...; "
            "nothing was recorded"
        )
    island = resumed.trainer.diloco.replica_id
    if before.model.lora is not None and resumed.model.lora is None and island is not None:
        raise ConfigError(
            f"--resume: model.lora cannot be turned off for island {island!r} ({run_dir}): the islands' outer "
            "state is the adapters alone, and the other islands go on averaging adapters with it; resume it "
            "with its adapters, or export the run and start new islands from the export; nothing was recorded"
        )


def resume_config(config: RunConfig, sources: list[str], allow_change: bool) -> tuple[RunConfig, dict[str, Any]]:
    """The config a `--resume` of `config.output_dir` trains with: the run's config so far, then
    `sources` on top. Returns it with its changes against the run's config so far; refuses adapters
    over full weights, a change that alters training unless `allow_change`, and one that would not
    replay from the record to this very config. A directory without a record (no run yet) resumes
    nothing: `sources` alone."""
    run_dir = Path(config.output_dir)
    if not (run_dir / RECORD).exists():
        return load_config(sources), {}
    so_far = run_sources(run_dir)
    before, resumed = load_config(before=so_far), load_config(sources, before=so_far)
    _refuse_adapter_switches(run_dir, before, resumed)
    changes = changed(before, resumed)
    for section in FACTORIES:  # another factory drops the kwargs set before it: its own are recorded with it
        kwargs = getattr(getattr(resumed, section), "kwargs", None)
        if f"{section}.import_path" in changes and f"{section}.kwargs" not in changes and kwargs is not None:
            changes[f"{section}.kwargs"] = (kwargs, kwargs)
    refused = [key for key in changes if alters_training(key)]
    if refused and not allow_change:
        listed = "; ".join(f"{key} {_show(changes[key][1])} (the run's: {_show(changes[key][0])})" for key in refused)
        raise ConfigError(
            f"--resume: {run_dir / RECORD} records another value for {len(refused)} setting(s) that alter training: "
            f"{listed}. Drop them to continue the run as it was, or pass {ALLOW_CHANGE} to continue with them "
            f"(the change is recorded in {CHANGES})"
        )
    line = _replayed(f"{run_dir / CHANGES} (this resume's line)", {key: now for key, (_, now) in changes.items()})
    replayed = load_config(before=[*so_far, *line])
    if lost := changed(replayed, resumed):
        raise ConfigError(
            f"--resume: recorded in {CHANGES}, the change would replay to another config ({', '.join(lost)}); "
            "nothing was recorded"
        )
    return resumed, changes


def train_config(words: list[str]) -> tuple[RunConfig, dict[str, Any]]:
    """The config `meshrl train WORDS` runs with, and what a resume changes. A resume's sources apply
    over the run's config, so they are validated there only (`--loss.cap` alone tunes a tis run)."""
    sources = [word for word in words if word != ALLOW_CHANGE]
    target = load_config(sources, only=("output_dir", "resume"))
    if not target.resume:
        return load_config(sources), {}
    return resume_config(target, sources, ALLOW_CHANGE in words)


def record_changes(run_dir: Path, changes: dict[str, tuple[Any, Any]], resumed_from: str | None) -> None:
    """Append one dated line of the resume's changes to DIR/config_changes.jsonl (fsynced)."""
    if not changes:
        return
    line = {
        "at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "resumed_from": resumed_from,
        "changes": {key: {"was": was, "now": now} for key, (was, now) in changes.items()},
    }
    with open(run_dir / CHANGES, "a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_record_of(path: str | Path) -> Path | None:
    """The config record of the run that `path` (a run directory, one of its checkpoints, or its
    final/ model) belongs to; None for a model directory outside any run."""
    path = Path(path).resolve()
    for folder in (path, path.parent, path.parent.parent):
        record = folder / RECORD
        if record.exists() and ((folder / "checkpoints").is_dir() or (folder / "metrics.jsonl").exists()):
            return record
    return None
