"""A run's own config: what `--resume` and `meshrl eval` start from, and what a resume may change.

A run writes its resolved config to DIR/config.toml once, when it starts fresh. Every change a
resume makes is appended to DIR/config_changes.jsonl with its date, so config.toml stays the record
of how the run started and the two together say what it trains with now. A resume composes them
with whatever presets and overrides come beside `--resume`, so a forgotten preset changes nothing;
a changed setting that alters training is refused (naming the keys) unless the user passes
`--allow-config-change`.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

from meshrl.configs.loader import ConfigError, load_config, read_preset
from meshrl.configs.schema import FREE_FORM, RunConfig

RECORD = "config.toml"
CHANGES = "config_changes.jsonl"
ALLOW_CHANGE = "--allow-config-change"
# Keys a resume changes freely: how long the run goes, where and how it is watched and saved, and
# where its hosts are. Everything else alters what is trained.
FREE_KEYS = ("max_steps", "output_dir", "resume", "overwrite", "ckpt.", "metrics.", "eval.", "generator.weight_sync",
             "topology.mode", "topology.workers", "topology.controller_address", "topology.attach_timeout_s",
             "topology.tls.", "topology.slurm.")  # fmt: skip


def flat(config: RunConfig) -> dict[str, Any]:
    """Every setting under its dotted key (free-form dicts such as task.kwargs as one value)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and prefix.rpartition(".")[2] not in FREE_FORM:
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else key, sub)
        else:
            out[prefix] = value

    walk("", config.model_dump(mode="json"))
    return out


def changed(recorded: RunConfig, now: RunConfig) -> dict[str, tuple[Any, Any]]:
    """The keys whose values differ: key -> (recorded, now)."""
    before, after = flat(recorded), flat(now)
    keys = sorted(set(before) | set(after))
    return {key: (before.get(key), after.get(key)) for key in keys if before.get(key) != after.get(key)}


def alters_training(key: str) -> bool:
    return not any(key == free or (free.endswith(".") and key.startswith(free)) for free in FREE_KEYS)


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def run_sources(run_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    """The run's config as sources: its record, then each resume's recorded changes in order."""
    record = run_dir / RECORD
    sources = [(str(record), read_preset(record))]
    changes = run_dir / CHANGES
    if changes.exists():
        for n, line in enumerate(changes.read_text().splitlines(), 1):
            try:
                entry = json.loads(line)
                nested: dict[str, Any] = {}
                for key, change in entry["changes"].items():
                    *path, last = key.split(".")
                    node = nested
                    for part in path:
                        node = node.setdefault(part, {})
                    node[last] = change["now"]
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ConfigError(f"{changes}:{n}: not a config change record ({exc})") from None
            sources.append((f"{changes}:{n}", nested))
    return sources


def resume_config(config: RunConfig, sources: list[str], allow_change: bool) -> tuple[RunConfig, dict[str, Any]]:
    """The config a `--resume` of `config.output_dir` trains with: the run's record and the changes
    earlier resumes made, then `sources` on top. Returns it with its changes against the run's
    config so far; refuses a change that alters training unless `allow_change`. A directory without
    a record (no run yet) resumes nothing: `config` as is."""
    run_dir = Path(config.output_dir)
    if not (run_dir / RECORD).exists():
        return config, {}
    so_far = run_sources(run_dir)
    before, resumed = load_config(before=so_far), load_config(sources, before=so_far)
    changes = {key: pair for key, pair in changed(before, resumed).items() if key != "resume"}
    refused = [key for key in changes if alters_training(key)]
    if refused and not allow_change:
        listed = "; ".join(f"{key} {_show(changes[key][1])} (the run's: {_show(changes[key][0])})" for key in refused)
        raise ConfigError(
            f"--resume: {run_dir / RECORD} records another value for {len(refused)} setting(s) that alter training: "
            f"{listed}. Drop them to continue the run as it was, or pass {ALLOW_CHANGE} to continue with them "
            f"(the change is recorded in {CHANGES})"
        )
    return resumed, changes


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
