"""A container per call through the Docker SDK, for hosts with a Docker daemon.

Written against docker-py's API (`containers.run(detach=True)`, `wait`, `logs`, `kill`,
`remove`); not exercised on the machines meshrl is tested on (no daemon there). The container has
no network, a read-only root, tmpfs `/work` and `/tmp`, no capabilities, `no-new-privileges`, the
nobody user, and the config's limits as Docker's (`mem_limit`, `pids_limit`, `ulimits`).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from meshrl.configs.schema import SandboxConfig
from meshrl.sandbox.core import ENV, ProgramFile, Run, Sandbox, SandboxUnavailable, limit_of


class ContainerSandbox(Sandbox):
    def __init__(self, config: SandboxConfig) -> None:
        try:
            import docker
        except ImportError:
            raise SandboxUnavailable("sandbox.backend 'docker' needs the Docker SDK: pip install docker") from None
        try:
            self.client = docker.from_env()
            self.client.ping()
        except docker.errors.DockerException as error:
            raise SandboxUnavailable(f"sandbox.backend 'docker': no Docker daemon answers: {error}") from None
        self.docker = docker
        super().__init__(config)

    def _run(self, slot: int, code: str, workspace: object, hidden: tuple[Path, ...]) -> Run:  # no workspaces
        if hidden:  # the image has files of its own: the host's are not what the call could read
            raise SandboxUnavailable("sandbox.backend 'docker' cannot hide files from a call (use 'bwrap')")
        c, mb = self.config, 1 << 20
        ulimit = self.docker.types.Ulimit
        with ProgramFile(code, None) as program:
            start = time.monotonic()
            container = self.client.containers.run(
                c.image, ["python", "-I", "main.py"], detach=True, network_disabled=True, read_only=True,
                working_dir="/work", user="65534:65534", environment=ENV, cap_drop=["ALL"],
                security_opt=["no-new-privileges"], mem_limit=c.memory_mb * mb, memswap_limit=c.memory_mb * mb,
                pids_limit=c.processes, nano_cpus=1_000_000_000,
                log_config={"type": "json-file", "config": {"max-size": str(2 * c.output_bytes)}},
                tmpfs={"/work": f"size={c.workdir_mb}m,uid=65534", "/tmp": f"size={c.workdir_mb}m"},
                volumes={str(program.path): {"bind": "/work/main.py", "mode": "ro"}},
                ulimits=[ulimit(name="cpu", soft=c.cpu_time_s, hard=c.cpu_time_s + 1),
                         ulimit(name="nofile", soft=c.open_files, hard=c.open_files),
                         ulimit(name="fsize", soft=c.file_size_mb * mb, hard=c.file_size_mb * mb)],
            )  # fmt: skip
            self._started(slot, lambda: _quietly(container.kill, self.docker.errors.APIError))
            try:
                return self._finish(container, start)
            finally:
                container.remove(force=True)

    def _finish(self, container: Any, start: float) -> Run:
        c = self.config
        try:
            status: int | None = container.wait(timeout=c.wall_time_s)["StatusCode"]
            limit = None
        except Exception:  # noqa: BLE001 - the SDK raises the HTTP client's timeout: the deadline passed
            with contextlib.suppress(self.docker.errors.APIError):  # it may have just exited
                container.kill()
            status, limit = None, "wall_time"
        out, err = (container.logs(stdout=s, stderr=not s) for s in (True, False))
        if len(out) + len(err) > c.output_bytes:
            out, err, limit = out[: c.output_bytes], err[: c.output_bytes], limit or "output"
        stdout, stderr = (b.decode("utf-8", "replace") for b in (out, err))
        return Run(stdout, stderr, status, limit or limit_of(status, stderr), time.monotonic() - start)


def _quietly(action: Any, errors: type[Exception]) -> None:
    """`close()` kills every live call: one whose container is already gone is no error."""
    with contextlib.suppress(errors):
        action()
