"""Bubblewrap: each call in new user, PID, network, IPC, UTS and mount namespaces.

What the program sees: `/usr` (and the interpreter's prefix) read-only, a fresh `/proc` of its
own PID namespace, a minimal `/dev`, and size-limited tmpfs at `/work` (its working directory,
holding its program read-only) and `/tmp`. Nothing else of the host — no `/home`, `/root`,
`/etc`, run directory or key files — and no network interface but loopback. As root each pool
slot runs as its own unprivileged uid, so its process limit is its own; the namespace's
processes die with the call (`--die-with-parent`, and the PID namespace ends with its init).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from meshrl.configs.schema import SandboxConfig
from meshrl.sandbox.core import ENV, ProcessSandbox, SandboxUnavailable

_MERGED = ("bin", "lib", "lib64", "sbin")  # symlinks into /usr on merged-/usr systems


class BwrapSandbox(ProcessSandbox):
    def __init__(self, config: SandboxConfig) -> None:
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise SandboxUnavailable(
                "sandbox.backend 'bwrap': bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
            )
        if shutil.which("prlimit") is None:
            raise SandboxUnavailable("the sandbox needs prlimit (util-linux) to set its limits")
        python = Path(config.python)
        if not python.is_file():
            raise SandboxUnavailable(f"sandbox.python {config.python!r}: no such interpreter")
        self.python = python
        prefix = python.resolve().parent.parent
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
        argv += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/tmp", "--size", size,
                 "--tmpfs", "/work", "--ro-bind", str(program), "/work/main.py", "--chdir", "/work",
                 str(self.python), "-s", "main.py"]  # fmt: skip
        return argv
