"""CURVE key pairs as pyzmq certificate files (`NAME.key` public, `NAME.key_secret` secret).

The controller's secret key stays on the controller; each worker's secret key stays on that
worker. What is shared: the controller's public key (every worker needs it to connect) and each
worker's public key (copied into `ingress.authorized_keys` on the controller to admit it).
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq.auth


def generate_keys(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write a new key pair NAME.key / NAME.key_secret into `directory`; refuses to overwrite
    one (a replaced server key locks every worker out, a replaced worker key is no longer admitted)."""
    directory = Path(directory)
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"key name {name!r}: a plain file name is needed")
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise ValueError(f"{path} exists; remove it first to replace the key pair")
    directory.mkdir(parents=True, exist_ok=True)
    made_public, made_secret = zmq.auth.create_certificates(directory, name)
    os.chmod(made_secret, 0o600)
    return Path(made_public), Path(made_secret)


def load_public(path: str | Path) -> bytes:
    """The public key (z85) of a certificate file, either half of the pair."""
    public, _ = _load(path)
    return public


def load_pair(path: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys of a NAME.key_secret file."""
    public, secret = _load(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key: pass the NAME.key_secret file")
    return public, secret


def _load(path: str | Path) -> tuple[bytes, bytes | None]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such key file (make one with `meshrl keys generate DIR --name NAME`)")
    try:
        return zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path}: not a CURVE certificate file ({exc})") from None
