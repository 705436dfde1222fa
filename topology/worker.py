"""`meshrl worker`: the Monarch worker loop a controller attaches to, one per host.

A worker runs whatever actors its controller spawns, so who may connect matters: `tls://`
workers accept only peers whose certificates the configured CA signed; plain `tcp://`
authenticates nobody and is refused on anything but a loopback address unless the operator
passes `allow_remote_tcp` (a private, trusted network).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

WORKER_ENV = "MESHRL_WORKER"  # the worker's address, inherited by the procs it spawns (topology.json)
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
TLS_FILES = {"cert": "HYPERACTOR_TLS_CERT", "key": "HYPERACTOR_TLS_KEY", "ca": "HYPERACTOR_TLS_CA"}


def process_info() -> dict[str, Any]:
    """Where the calling actor runs, for topology.json: host name, pid, and the address of
    the `meshrl worker` that spawned its process ('local' on the controller's host)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "worker": os.environ.get(WORKER_ENV, "local")}


def tls_env(cert: str | None, key: str | None, ca: str | None) -> dict[str, str]:
    """The environment Monarch's TLS transport reads its certificate, key and CA from
    (the given files only)."""
    files = {"cert": cert, "key": key, "ca": ca}
    return {TLS_FILES[name]: str(path) for name, path in files.items() if path}


def bind_host(address: str) -> str:
    """The host a worker address binds to (`dial@bind` form: the bind part)."""
    bind = address.rsplit("@", 1)[-1]
    return bind.partition("://")[2].rsplit(":", 1)[0]


def check_address(address: str, allow_remote_tcp: bool = False) -> None:
    scheme = address.partition("://")[0]
    if scheme not in ("tcp", "tls") or ":" not in address.partition("://")[2]:
        raise ValueError(f"worker address {address!r} must look like tcp://HOST:PORT or tls://HOST:PORT")
    if scheme == "tcp" and bind_host(address) not in LOOPBACK and not allow_remote_tcp:
        raise ValueError(
            f"{address}: plain tcp neither encrypts nor authenticates, and a worker runs any actor sent to it; "
            "bind it to 127.0.0.1, use tls:// with certificates, or pass --allow-remote-tcp on a trusted network"
        )


def serve(address: str, *, cert: str | None = None, key: str | None = None, ca: str | None = None,
          allow_remote_tcp: bool = False) -> None:  # fmt: skip
    """Run the worker loop until its host mesh is shut down."""
    check_address(address, allow_remote_tcp)
    files = {"cert": cert, "key": key, "ca": ca}
    if address.startswith("tls://"):
        missing = [f"--tls-{name}" for name, path in files.items() if not path]
        if missing:
            raise ValueError(f"{address}: a tls worker needs {', '.join(missing)}")
        for name, path in files.items():
            if not Path(path).is_file():
                raise ValueError(f"--tls-{name}: no such file: {path}")
        os.environ.update(tls_env(*(Path(path).resolve() for path in files.values())))
    os.environ[WORKER_ENV] = address
    # Monarch reads its TLS settings when it loads, so it is imported only now.
    from monarch.actor import run_worker_loop_forever

    run_worker_loop_forever(address=address, ca="trust_all_connections")
