"""Bubblewrap: each call in new user, PID, network, IPC, UTS and mount namespaces.

What the program sees: `/usr` (and the interpreter's prefix) read-only, a fresh `/proc` of its
own PID namespace, a read-only minimal `/dev`, and size-limited tmpfs at `/work` (its working
directory, empty; the program is read-only at `/run/meshrl/main.py`), `/tmp` and `/dev/shm`.
Nothing else of the host — no `/home`, `/root`, `/etc`, run directory or key files — and no
network interface but loopback. As root each call runs as its own unprivileged uid, so its
process limit is its own; the namespace's processes die with the call (`--die-with-parent`, and
the PID namespace ends with its init).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from meshrl.configs.schema import SandboxConfig
from meshrl.sandbox.core import ENV, ProcessSandbox, SandboxUnavailable

_MERGED = ("bin", "lib", "lib64", "sbin")  # symlinks into /usr on merged-/usr systems
# The program lives outside the working directory, which starts empty and is the import path's
# first entry (what the program writes there, it can import), as for `python -c`.
PROGRAM = "/run/meshrl/main.py"
RUN_PROGRAM = f"import runpy, sys; sys.argv = ['main.py']; runpy.run_path({PROGRAM!r}, run_name='__main__')"


class BwrapSandbox(ProcessSandbox):
    def __init__(self, config: SandboxConfig) -> None:
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise SandboxUnavailable(
                "sandbox.backend 'bwrap': bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
            )
        if shutil.which("prlimit") is None:
            raise SandboxUnavailable("the sandbox needs prlimit (util-linux) to set its limits")
        self.python = Path(config.python)
        prefix = self.python.resolve().parent.parent
        self.binds = ["/usr"] + ([str(prefix)] if not prefix.is_relative_to("/usr") else [])
        super().__init__(config)

    def command(self, program: Path) -> list[str]:
        size = str(self.config.workdir_mb << 20)
        argv = [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                "--hostname", "sandbox", "--clearenv"]  # fmt: skip
        for key, value in ENV.items():
            argv += ["--setenv", key, value]
        for path in self.binds:
            argv += ["--ro-bind", path, path]
        for name in _MERGED:
            host = Path("/") / name
            if host.is_symlink():
                argv += ["--symlink", str(host.readlink()), str(host)]
            elif host.is_dir():
                argv += ["--ro-bind", str(host), str(host)]
        argv += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
                 "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/work",
                 "--ro-bind", str(program), PROGRAM, "--chdir", "/work",
                 str(self.python), "-s", "-c", RUN_PROGRAM]  # fmt: skip
        return argv
