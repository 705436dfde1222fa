"""Running code a policy wrote: a fresh, limited, network-less process per call (`Sandbox`).

Backends: bubblewrap (`bwrap`, Linux namespaces and a seccomp filter; the default), a container
per call through the Docker SDK, or none (plain limited processes on the host: only when the
config says so, loudly).
"""

from __future__ import annotations

from meshrl.configs.schema import SandboxConfig
from meshrl.sandbox.core import Run, Sandbox, SandboxUnavailable, Workspace

__all__ = ["Run", "Sandbox", "SandboxUnavailable", "Workspace", "make_sandbox"]


def make_sandbox(config: SandboxConfig) -> Sandbox:
    """The configured backend, checked on a probe program: SandboxUnavailable names what is missing."""
    if config.backend == "bwrap":
        from meshrl.sandbox.bwrap import BwrapSandbox

        return BwrapSandbox(config)
    if config.backend == "docker":
        from meshrl.sandbox.container import ContainerSandbox

        return ContainerSandbox(config)
    from meshrl.sandbox.host import HostSandbox

    return HostSandbox(config)
