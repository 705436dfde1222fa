"""No isolation: the program runs as a plain process on the host, with the limits only.

For hosts where neither bubblewrap nor a container daemon exists and the user has said so
(`sandbox.backend = "none"`): the program can read what the run's user can read and reach the
network. Logged as a warning whenever one is made.
"""

from __future__ import annotations

import logging
from pathlib import Path

from meshrl.configs.schema import SandboxConfig
from meshrl.sandbox.core import ProcessSandbox

log = logging.getLogger(__name__)


class HostSandbox(ProcessSandbox):
    def __init__(self, config: SandboxConfig) -> None:
        log.warning(
            "sandbox.backend = 'none': code the policy writes runs UNSANDBOXED on this host "
            "(it can read the run's files and reach the network); only the resource limits apply"
        )
        super().__init__(config)

    def command(self, program: Path) -> list[str]:
        return [self.config.python, "-s", str(program)]  # run in its own directory or a workspace
