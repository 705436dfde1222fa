"""Start-up checks that need no mesh, no torch and no run directory: each refusal is one line that
names the config key and its value, within a second of `meshrl train` (and the import of the task's
module, whose factory's signature the task kwargs are checked against), before anything is written.

The checks that need the model's files (its tokenizer, its chat template, the task's tools) run in
`Controller.__init__`, still before any mesh is spawned.
"""

from __future__ import annotations

import errno
import os
import re
import socket
from pathlib import Path

from meshrl.configs.loader import ConfigError
from meshrl.configs.schema import HfTeacher, OpenAITeacher, RunConfig
from meshrl.models.gguf import gguf_file, is_gguf
from meshrl.sandbox.bwrap import bwrap_program
from meshrl.sandbox.core import SandboxUnavailable
from meshrl.tasks.base import task_kwargs

# A hub id as huggingface_hub accepts it: `name` or `org/name`.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def preflight(config: RunConfig) -> None:
    """Refuse a run that would fail after its meshes start (raises ConfigError)."""
    check_model_path("model.path", config.model.path, special=("tiny",))
    for i, member in enumerate(config.teachers.members):
        if isinstance(member, HfTeacher):
            check_model_path(f"teachers.members[{i}].path", member.path)
        if isinstance(member, OpenAITeacher) and member.api_key_env and member.api_key_env not in os.environ:
            raise ConfigError(
                f"teachers.members[{i}].api_key_env: the env var {member.api_key_env} (teacher "
                f"{member.name!r}'s API key) is not set"
            )
    check_output_dir(config.output_dir)
    if config.ingress.bind is not None:
        check_port_free("ingress.bind", config.ingress.bind)
    try:  # the factory gets them typed (`make_task`); the record keeps them as given, as a resume gives them
        task_kwargs(config.task)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    sandbox = config.task.kwargs.get("sandbox")
    if isinstance(sandbox, dict) and sandbox.get("backend", "bwrap") == "bwrap":
        try:
            bwrap_program()
        except SandboxUnavailable as exc:
            raise ConfigError(f"task.kwargs.{exc}") from None


def check_model_path(key: str, path: str, special: tuple[str, ...] = ()) -> None:
    """A model directory with config.json, a .gguf file (`gguf:PACKAGE/FILE.gguf` in an installed
    package, for `model.path`), or a hub id; anything else is refused."""
    if path in special:
        return
    if special and is_gguf(path):
        try:
            gguf_file(path)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return
    local = Path(path).expanduser()
    if local.is_file():
        if local.suffix != ".gguf":
            raise ConfigError(f"{key}: {path!r} is a file but not a .gguf model")
        return
    if local.is_dir():
        if not (local / "config.json").exists():
            raise ConfigError(f"{key}: {path!r} is a directory without config.json (not an HF model directory)")
        return
    missing = (
        f"{key}: {path!r}: no such file or directory (expected an HF model directory, a .gguf file"
        + (", 'tiny'" if special else "")
        + " or a hub id such as 'Qwen/Qwen3-0.6B')"
    )
    if path.startswith(("/", ".", "~")) or path.endswith(".gguf") or not HUB_ID.match(path):
        raise ConfigError(missing)
    hub_model(key, path, missing)


def hub_model(key: str, repo_id: str, missing: str) -> None:
    """A hub id is in the local cache, or the hub answers for it within seconds (no retries)."""
    import httpx
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise ConfigError(f"{missing}; as a hub id it is not in the local cache (HF_HUB_OFFLINE is set)")
    try:
        HfApi().model_info(repo_id, timeout=5)
    except GatedRepoError:  # it exists; whether this token may read it, loading tells
        return
    except RepositoryNotFoundError:
        raise ConfigError(f"{missing}; nor is it a model on the hub") from None
    except (OSError, httpx.HTTPError, HfHubHTTPError) as exc:  # no network, a proxy: it could not be loaded either
        raise ConfigError(
            f"{missing}; as a hub id it is not in the local cache and the hub could not be asked "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
        ) from None


def check_output_dir(output_dir: str) -> None:
    """The run directory can be made (or is one) and written."""
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output_dir: {output_dir!r} exists and is not a directory")
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir: {output_dir!r}: {existing} is not writable")


def check_port_free(key: str, address: str) -> None:
    """`tcp://HOST:PORT` (or `HOST:PORT`, `[::]:PORT`) can be bound now; port 0 always can."""
    hostport = address.partition("://")[2] or address
    host, _, port = hostport.rpartition(":")
    host = host.strip("[]")
    if not port.isdigit():
        raise ConfigError(f"{key}: {address!r}: expected tcp://HOST:PORT")
    if int(port) == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    host = {"*": "", "0.0.0.0": ""}.get(host, host) if family == socket.AF_INET else ("" if host == "::" else host)
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, int(port)))
        except OSError as exc:
            why = "in use by another process" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise ConfigError(f"{key}: {address!r}: cannot listen there ({why})") from None
