"""Bubblewrap: each call in new user, PID, network, IPC, UTS and mount namespaces, under a seccomp filter.

What the program sees: a read-only root holding the interpreter, its standard library, the programs
and the shared objects they load (`view`: not the rest of `/usr`), a
fresh `/proc` of its own PID namespace, a read-only minimal `/dev`, and two writable directories:
`/work` (its working directory, empty; the program is read-only at `/run/meshrl/main.py`) and
`/dev/shm`, which `/tmp` links to. Files of the root a call is made to hide (`hidden`: a
repository task's original module and tests) cannot be read (/dev/null is bound over each, on a nodev mount). Nothing else of the host — no `/home`, `/root`, `/etc`, run
directory or key files — and no network interface but loopback. As root each call runs as its own
unprivileged uid, so its process limit is its own; the namespace's processes die with the call
(`--die-with-parent`, and the PID namespace ends with its init).

As root the two directories are two of one tmpfs that the host mounts for the call (`CallFiles`)
with `workdir_mb` of bytes and `files` inodes: bwrap 0.8 cannot limit the inodes of its own tmpfs,
and each costs about 1 KiB of kernel memory that no limit of the call's processes counts. Without
root they are bwrap's tmpfs of `workdir_mb` each, and the number of files is unbounded. A workspace's
calls (as root) see its own tmpfs at both, so its `/tmp` is bounded with its files.

Memory a call could pin beyond its processes' rlimits and its tmpfs has no way in: the root is
read-only, user namespaces are disabled (no tmpfs mounted in a nested one), and `seccomp_filter`
refuses SysV and POSIX IPC, memory-only files, the kernel keyring, mounts and namespaces, socket
families but AF_UNIX and larger socket buffers.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from meshrl.configs.schema import SandboxConfig
from meshrl.sandbox.core import ENV, ProcessSandbox, SandboxUnavailable, Workspace, limit_of
from meshrl.sandbox.view import interpreter_view

log = logging.getLogger(__name__)
_MERGED = ("bin", "lib", "lib64", "sbin")  # symlinks into /usr on merged-/usr systems
# The program lives outside the working directory, which starts empty and is the import path's
# first entry (what the program writes there, it can import), as for `python -c`.
PROGRAM = "/run/meshrl/main.py"
RUN_PROGRAM = f"import runpy, sys; sys.argv = ['main.py']; runpy.run_path({PROGRAM!r}, run_name='__main__')"
# Refused with EPERM: what would hold memory that no process's address space counts (SysV and
# POSIX IPC objects live as long as the IPC namespace; memfd files count against no tmpfs), the
# kernel keyring (the caller's session keyring would be shared with every call), mounts and
# namespaces, and kernel interfaces a program has no use for that exploits favour.
REFUSED = (
    "shmget", "msgget", "semget", "mq_open", "memfd_create", "memfd_secret",
    "add_key", "keyctl", "request_key",
    "unshare", "setns", "mount", "umount2", "pivot_root",
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
)  # fmt: skip
# As root, where a call's tmpfs is mounted: MOUNTS/<its uid>, which its uid's lease makes the call's
# alone (a host that died mid-call left its mount there; the uid's next call unmounts it).
MOUNTS = Path("/run/meshrl-sandbox-files")
_LIBC = ctypes.CDLL(None, use_errno=True)
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 0x2, 0x4, 0x2
_NAMESPACES = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)  # CLONE_NEW*
_SO_BUFFERS = (socket.SO_SNDBUF, socket.SO_RCVBUF)


def seccomp_filter() -> bytes:
    """The BPF program bwrap loads before the call's program runs, built by libseccomp.

    clone3 answers ENOSYS (its flags are out of a filter's reach; glibc then uses clone, whose
    namespace flags are refused); other ABIs (32-bit `int 0x80`, x32) answer ENOSYS to every call.
    """
    try:
        import pyseccomp as sc
    except (ImportError, OSError, RuntimeError) as error:  # pyseccomp raises RuntimeError without libseccomp
        raise SandboxUnavailable(
            f"the bwrap sandbox's syscall filter needs libseccomp (Debian/Ubuntu: apt-get install libseccomp2): {error}"
        ) from error
    refuse, low32 = sc.ERRNO(errno.EPERM), 0xFFFFFFFF  # the kernel reads socket levels and options as ints
    rules: list[tuple] = [(refuse, name) for name in REFUSED]
    rules += [
        (sc.ERRNO(errno.ENOSYS), "clone3"),
        (sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.NE, socket.AF_UNIX)),
    ]
    rules += [(refuse, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag)) for flag in _NAMESPACES]
    rules += [(refuse, "setsockopt", sc.Arg(1, sc.MASKED_EQ, low32, socket.SOL_SOCKET), sc.Arg(2, sc.MASKED_EQ, low32, option))
              for option in _SO_BUFFERS]  # fmt: skip
    bpf = sc.SyscallFilter(sc.ALLOW)
    bpf.set_attr(sc.Attr.ACT_BADARCH, sc.ERRNO(errno.ENOSYS))
    for action, name, *args in rules:
        try:
            bpf.add_rule(action, name, *args)
        except OSError as error:  # a libseccomp older than the system call
            raise SandboxUnavailable(f"libseccomp cannot filter {name} (upgrade libseccomp2): {error}") from error
    with tempfile.TemporaryFile() as out:
        bpf.export_bpf(out)
        out.seek(0)
        return out.read()


class CallFiles:
    """One tmpfs per call, mounted by the host (as root) with an inode limit bwrap 0.8 cannot set,
    owned by the call's uid; `work` and `shm` of it become the call's `/work` and `/dev/shm`."""

    def __init__(self, uid: int, size_mb: int, files: int, name: str | None = None) -> None:
        self.uid, self.root = uid, MOUNTS / (name or str(uid))
        self.options = f"size={size_mb << 20},nr_inodes={files},mode=0700,uid={uid},gid={uid}"

    def __enter__(self) -> CallFiles:
        self.root.mkdir(mode=0o700, exist_ok=True)
        _unmount(self.root)  # what a host that died mid-call left
        if _LIBC.mount(b"meshrl-sandbox", bytes(self.root), b"tmpfs", _MS_NOSUID | _MS_NODEV, self.options.encode()):
            error = ctypes.get_errno()
            raise SandboxUnavailable(f"as root each call mounts a tmpfs at {self.root}: {os.strerror(error)}")
        try:
            for name in ("work", "shm"):
                (self.root / name).mkdir(mode=0o700)
                os.chown(self.root / name, self.uid, self.uid)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        """Lazily: the call's mount namespace, still being torn down, may hold the tmpfs a moment longer."""
        _unmount(self.root)
        self.root.rmdir()


def _can_mount() -> bool:
    """Whether this root may mount the calls' tmpfs (root in a container without CAP_SYS_ADMIN may
    not): if not, calls get bwrap's own tmpfs, whose number of files no limit bounds, and a warning."""
    try:
        MOUNTS.mkdir(exist_ok=True)
        MOUNTS.chmod(0o711)  # whatever the umask: each call's uid passes through to its own tmpfs
        with CallFiles(0, 1, 16, name=f"probe-{os.getpid()}"):
            return True
    except (OSError, SandboxUnavailable) as error:
        log.warning("the sandbox cannot mount its calls' tmpfs under %s (%s): the number of files a call "
                    "makes is unbounded (each holds ~1 KiB of kernel memory)", MOUNTS, error)  # fmt: skip
        return False


def _unmount(path: Path) -> None:
    """Lazily unmount what is mounted at `path`; nothing mounted there (EINVAL) is no error."""
    _LIBC.umount2(bytes(path), _MNT_DETACH)


def bwrap_program() -> str:
    """bubblewrap's path; refused, with how to install it, where it is missing (also at start-up)."""
    found = shutil.which("bwrap")
    if found is None:
        raise SandboxUnavailable(
            "sandbox.backend 'bwrap': bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
        )
    return found


class BwrapSandbox(ProcessSandbox):
    def __init__(self, config: SandboxConfig) -> None:
        self.bwrap = bwrap_program()
        if shutil.which("prlimit") is None:
            raise SandboxUnavailable("the sandbox needs prlimit (util-linux) to set its limits")
        self.filter = seccomp_filter()
        self.python = Path(config.python)
        self.view = interpreter_view(config.python)
        self.host_tmpfs = os.geteuid() == 0 and _can_mount()
        super().__init__(config)

    @contextlib.contextmanager
    def launch(
        self, program: Path, uid: int | None, workspace: Workspace | None, hidden: tuple[Path, ...]
    ) -> Iterator[tuple[list[str], tuple[int, ...]]]:
        """bwrap reads the filter from a pipe of its own (a shared descriptor's offset would race); as
        root the call's tmpfs (`CallFiles`) is mounted while the block lasts. A workspace's directory is
        the call's `/work`, with a `/dev/shm` of its own."""
        with contextlib.ExitStack() as cleanup:
            tmpfs = ["--size", str(self.config.workdir_mb << 20), "--tmpfs"]
            shm = workspace.directory.parent / "shm" if workspace is not None else None
            if workspace is not None and self.host_tmpfs and workspace.uid is not None and shm.is_dir():
                # the workspace's own tmpfs (bytes and inodes bounded) holds its /dev/shm (/tmp) too
                writable = ["--bind", str(shm), "/dev/shm", "--bind", str(workspace.directory), "/work"]
            elif workspace is not None:
                writable = [*tmpfs, "/dev/shm", "--bind", str(workspace.directory), "/work"]
            elif uid is None or not self.host_tmpfs:
                writable = [*tmpfs, "/dev/shm", *tmpfs, "/work"]
            else:
                root = cleanup.enter_context(CallFiles(uid, self.config.workdir_mb, self.config.files)).root
                writable = ["--bind", str(root / "shm"), "/dev/shm", "--bind", str(root / "work"), "/work"]
            read, write = os.pipe()
            cleanup.callback(os.close, read)
            with open(write, "wb") as pipe:  # far below a pipe's 64 KiB buffer: never blocks
                pipe.write(self.filter)
            yield self._argv(program, read, writable, hidden), (read,)

    @contextlib.contextmanager
    def _workspace_files(self, uid: int | None) -> Iterator[Path]:
        """As root, a tmpfs of the workspace's own (`workdir_mb` bytes, `files` inodes), mounted for its
        life: the episode's files are bounded as one call's are."""
        if uid is None or not self.host_tmpfs:
            with super()._workspace_files(uid) as directory:
                yield directory
            return
        with CallFiles(uid, self.config.workdir_mb, self.config.files, name=f"workspace-{uid}") as files:
            yield files.root / "work"

    def _limit(self, uid: int | None, status: int | None, stderr: str, workspace: Workspace | None) -> str | None:
        """A full tmpfs whose inodes ran out ran out of files, not of bytes: Python says the same of both."""
        limit = limit_of(status, stderr)
        if limit == "workdir" and uid is not None and self.host_tmpfs:
            mount = workspace.directory.parent if workspace is not None else MOUNTS / str(uid)
            if os.statvfs(mount).f_ffree == 0:
                return "files"
        return limit

    def _argv(self, program: Path, seccomp_fd: int, writable: list[str], hidden: tuple[Path, ...]) -> list[str]:
        argv = [self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox", "--clearenv"]  # fmt: skip
        for key, value in ENV.items():
            argv += ["--setenv", key, value]
        for path in self.view.binds:
            argv += ["--ro-bind", str(path), str(path)]
        for path in self.view.empty:
            argv += ["--tmpfs", str(path), "--remount-ro", str(path)]
        for path in hidden:  # an answer key the call must not read (a task's original module)
            argv += ["--ro-bind", "/dev/null", str(path)]
        for name in _MERGED:
            host = Path("/") / name
            if host.is_symlink():
                argv += ["--symlink", str(host.readlink()), str(host)]
            elif host.is_dir():
                argv += ["--ro-bind", str(host), str(host)]
        argv += ["--proc", "/proc", "--dev", "/dev", *writable, "--remount-ro", "/dev", "--symlink", "/dev/shm", "/tmp",
                 "--ro-bind", str(program), PROGRAM, "--remount-ro", "/", "--chdir", "/work",
                 "--seccomp", str(seccomp_fd), str(self.python), "-s", "-c", RUN_PROGRAM]  # fmt: skip
        return argv
