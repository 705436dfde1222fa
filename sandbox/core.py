"""A `Sandbox` runs one Python program per call in a fresh process tree and reports how it ended.

Every call gets an empty working directory, a scrubbed environment (`ENV`: no keys, no paths of
the host, a fixed hash seed so the same code gives the same result), and the limits of
`SandboxConfig`: wall time (the call is killed), CPU seconds, address space, processes, open
files, file size (kernel rlimits set by `prlimit`), and output bytes (killed once more arrives).
A broken limit is a `Run` naming it, never an exception: the task turns it into a tool error.
Calls run at once up to `pool_size`; `close()` kills those still running.

A `Workspace` is a working directory that outlasts its calls: one episode's copy of a repository.
Each of its calls is still a fresh process tree with the same limits, run one at a time with the
workspace as its working directory; its files persist until `close()`, and no other call sees them.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import random
import selectors
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from meshrl.configs.schema import SandboxConfig

ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/work",
    "LANG": "C.UTF-8",
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",  # what a killed program printed is still reported
}
# As root each call runs as its own uid/gid, UID_BASE + a rotating number below UIDS: its process
# limit counts only its own processes, and a uid comes back only long after the host's init reaped
# the zombies a torn-down namespace leaves (on some hosts that takes seconds). A call holds an flock
# on its uid's file under LEASES until its processes are gone: two sandboxes of one host (two
# workers, two test processes) never share a uid, so one call's clean-up never kills another's.
UID_BASE, UIDS = 200_000, 4096
LEASES = Path("/run/meshrl-sandbox-uids")
# The kernel sends SIGXCPU at cpu_time_s and SIGKILL at cpu_time_s + 1 (a program that ignores
# SIGXCPU); the sandbox's own kills are named before an exit status is read.
_SIGNALLED = {signal.SIGXCPU: "cpu_time", signal.SIGKILL: "cpu_time", signal.SIGXFSZ: "file_size"}
_STDERR_LIMITS = {  # how Python reports a refused allocation, fork or open
    "MemoryError": "memory",
    "Resource temporarily unavailable": "processes",
    "can't start new thread": "processes",
    "Too many open files": "open_files",
    "File too large": "file_size",
    "No space left on device": "workdir",
}


class SandboxUnavailable(RuntimeError):
    """The configured backend cannot run here; the message says what is missing."""


@dataclass(frozen=True)
class Run:
    """How one call ended. `limit` names the limit that stopped it (None: it ended by itself)."""

    stdout: str
    stderr: str
    exit_code: int | None  # None: killed by the sandbox (wall time, output)
    limit: str | None
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.limit is None

    def marked(self, marker: str) -> list[str]:
        """The text after `marker` of each stdout line that starts with it: a program's report line
        (its caller holds it to exactly one, as untrusted data)."""
        return [line[len(marker) :] for line in self.stdout.split("\n") if line.startswith(marker)]

    def report(self) -> str:
        """The call as a tool result's text."""
        status = f"exit status {self.exit_code}" if self.exit_code is not None else "killed"
        if self.limit is not None:
            status += f"; sandbox limit reached: {self.limit}"
        return f"[{status}]\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"

    @staticmethod
    def reported_ok(report: str) -> bool:
        """Whether a `report()` text is of an `ok` run: it opens with its status, which the program's
        own output cannot come before."""
        return report.startswith("[exit status 0]\n")


class Sandbox:
    """The pool every backend shares: at most `pool_size` calls at once, each killed by `close()`."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self._slots: list[int] = list(range(config.pool_size))
        self._free = threading.Condition()
        self._live: dict[int, Callable[[], None]] = {}  # slot -> how to kill its call
        self._closed = False
        run = self.run_python("print(6 * 7)")
        if run.stdout.strip() != "42":
            raise SandboxUnavailable(f"sandbox.backend {config.backend!r}: a probe program failed: {run.report()}")

    def run_python(self, code: str, workspace: Workspace | None = None, hidden: Sequence[Path] = ()) -> Run:
        """Run `code` as a program (in `workspace`, when given); blocks while `pool_size` calls run.
        `hidden` (a workspace's call: the workspace's): host files the call cannot read, such as a
        task's answer key in the interpreter's library (bwrap; `none` isolates nothing)."""
        hidden = tuple(workspace.hidden if workspace is not None else hidden)
        with self._free:
            while not self._slots and not self._closed:
                self._free.wait()
            if self._closed:
                raise SandboxUnavailable("the sandbox is closed")
            slot = self._slots.pop()
        try:
            if workspace is None:
                return self._run(slot, code, None, hidden)
            with workspace.lock:  # one call at a time: a call's end kills whatever else runs as its uid
                if workspace.closed:
                    raise SandboxUnavailable("the workspace is closed")
                return self._run(slot, code, workspace, hidden)
        finally:
            with self._free:
                self._live.pop(slot, None)
                self._slots.append(slot)
                self._free.notify()

    def close(self) -> None:
        """Kill every call still running; later calls are refused."""
        with self._free:
            self._closed = True
            kills = list(self._live.values())
            self._free.notify_all()
        for kill in kills:
            kill()

    def _started(self, slot: int, kill: Callable[[], None]) -> None:
        """Register a started call's kill; a sandbox closed meanwhile kills it at once."""
        with self._free:
            self._live[slot] = kill
            closed = self._closed
        if closed:
            kill()

    def workspace(self, files: dict[str, str], hidden: Sequence[Path] = ()) -> Workspace:
        """A new workspace holding `files` (relative path -> text); its calls cannot read `hidden`."""
        raise SandboxUnavailable(f"sandbox.backend {self.config.backend!r} has no workspaces (use 'bwrap')")

    def _run(self, slot: int, code: str, workspace: Workspace | None, hidden: tuple[Path, ...]) -> Run:
        raise NotImplementedError


class Workspace:
    """A working directory that outlasts its calls (`Sandbox.workspace`). As root it holds one uid for
    its whole life, so its files keep one owner and its calls' processes are its own; `close()` (which
    waits for a running call) kills what still runs as that uid, removes the files and frees the uid."""

    def __init__(
        self, directory: Path, uid: int | None, release: Callable[[], None], hidden: Sequence[Path] = ()
    ) -> None:
        self.directory, self.uid, self._release, self.hidden = directory, uid, release, tuple(hidden)
        self.lock = threading.Lock()
        self.closed = False

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            try:
                if self.uid is not None:
                    _kill_all(self.uid)
            finally:
                self._release()


class ProcessSandbox(Sandbox):
    """A backend whose call is one host process tree: `command` says how to start it; the kernel's
    rlimits (`prlimit`) and this process's reading enforce the limits."""

    def __init__(self, config: SandboxConfig) -> None:
        if not Path(config.python).is_file():
            raise SandboxUnavailable(f"sandbox.python {config.python!r}: no such interpreter")
        self._uids = itertools.count(random.randrange(UIDS))  # processes of one host start apart
        if os.geteuid() == 0:
            try:
                LEASES.mkdir(mode=0o700, exist_ok=True)
            except OSError as error:
                raise SandboxUnavailable(
                    f"as root a call holds its uid through a file under {LEASES}: {error}"
                ) from error
        super().__init__(config)

    def command(self, program: Path) -> list[str]:
        raise NotImplementedError

    @contextlib.contextmanager
    def launch(
        self, program: Path, uid: int | None, workspace: Workspace | None, hidden: tuple[Path, ...]
    ) -> Iterator[tuple[list[str], tuple[int, ...]]]:
        """The call's argv and the descriptors it inherits; the block lasts until its processes are gone.
        A plain process hides nothing (`sandbox.backend = "none"` isolates nothing, loudly)."""
        yield self.command(program), ()

    def workspace(self, files: dict[str, str], hidden: Sequence[Path] = ()) -> Workspace:
        """As root: a uid leased for the workspace's life and a directory (`_workspace_files`) it owns."""
        stack = contextlib.ExitStack()
        try:
            uid = stack.enter_context(self._uid())
            directory = stack.enter_context(self._workspace_files(uid))
            write_files(directory, files, uid)
        except BaseException:
            stack.close()
            raise
        return Workspace(directory, uid, stack.close, hidden)

    @contextlib.contextmanager
    def _workspace_files(self, uid: int | None) -> Iterator[Path]:
        """A host directory for a workspace's files, removed when the block ends."""
        import tempfile

        directory = Path(tempfile.mkdtemp(prefix="meshrl-workspace-"))
        try:
            if uid is not None:
                os.chown(directory, uid, uid)
            yield directory
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def _limit(self, uid: int | None, status: int | None, stderr: str, workspace: Workspace | None) -> str | None:
        """The limit a program that exited with `status` ran into, read while its `launch` block lasts."""
        return limit_of(status, stderr)

    def _limits(self, uid: int | None) -> list[str]:
        c = self.config
        processes = c.processes + 4  # prlimit's exec, bwrap and its namespace init
        if uid is None:  # not root: RLIMIT_NPROC counts this user's threads elsewhere too
            processes += _threads_of(os.getuid())
        mb = 1 << 20
        return ["prlimit", f"--cpu={c.cpu_time_s}:{c.cpu_time_s + 1}", f"--as={c.memory_mb * mb}",
                f"--nproc={processes}", f"--nofile={c.open_files}", f"--fsize={c.file_size_mb * mb}",
                "--"]  # fmt: skip

    @contextlib.contextmanager
    def _uid(self) -> Iterator[int | None]:
        """As root, a uid of the range that no other call of this host holds and no process runs
        as, held until the block ends; else None (the run's own user)."""
        if os.geteuid() != 0:
            yield None
            return
        for _ in range(UIDS):
            uid = UID_BASE + next(self._uids) % UIDS
            lease = os.open(LEASES / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(lease, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(lease)
                continue
            try:  # the kernel drops the lock when its holder dies; a dead holder's processes may not be gone
                if not processes_of(uid):
                    yield uid
                    return
            finally:
                os.close(lease)
        raise SandboxUnavailable(f"every sandbox uid {UID_BASE}..{UID_BASE + UIDS - 1} is in use")

    def _run(self, slot: int, code: str, workspace: Workspace | None, hidden: tuple[Path, ...]) -> Run:
        lease = self._uid() if workspace is None else contextlib.nullcontext(workspace.uid)
        launch = self.launch
        with (
            lease as uid,
            ProgramFile(code, uid) as program,
            launch(program.path, uid, workspace, hidden) as (argv, fds),
        ):
            start = time.monotonic()
            process = subprocess.Popen(
                self._limits(uid) + argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, env=ENV, process_group=0, close_fds=True, pass_fds=fds,
                cwd=workspace.directory if workspace else program.directory,
                **({"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}),
            )  # fmt: skip
            self._started(slot, lambda: _kill(process))
            try:
                out, err, killed_for = _read(process, start + self.config.wall_time_s, self.config.output_bytes)
            finally:
                _kill(process)
                if uid is not None:
                    _kill_all(uid)
            stdout, stderr = (b.decode("utf-8", "replace") for b in (out, err))
            status = None if killed_for else exit_status(process.returncode)
            limit = killed_for or self._limit(uid, status, stderr, workspace)
        return Run(stdout, stderr, status, limit, time.monotonic() - start)


def write_files(directory: Path, files: dict[str, str], uid: int | None) -> None:
    """Write `files` (relative paths, no `..`) under `directory`, owned by `uid` when given."""
    for name, text in files.items():
        relative = Path(name)
        if relative.is_absolute() or ".." in relative.parts:
            raise ValueError(f"workspace file {name!r}: not a relative path inside the workspace")
        path = directory / relative
        for parent in reversed([p for p in path.parents if p.is_relative_to(directory) and p != directory]):
            if not parent.exists():
                parent.mkdir()
                if uid is not None:
                    os.chown(parent, uid, uid)
        path.write_text(text)
        if uid is not None:
            os.chown(path, uid, uid)


class ProgramFile:
    """The program in its own host directory, which the call (as `uid`, when given) owns."""

    def __init__(self, code: str, uid: int | None) -> None:
        self.code, self.uid = code, uid

    def __enter__(self) -> ProgramFile:
        import tempfile

        self.directory = tempfile.mkdtemp(prefix="meshrl-sandbox-")
        self.path = Path(self.directory) / "main.py"
        try:
            self.path.write_text(self.code)
            os.chmod(self.directory, 0o755)  # readable by the call's user (policy code is no secret)
            if self.uid is not None:  # and writable: the host backend runs in this directory
                os.chown(self.directory, self.uid, self.uid)
                os.chown(self.path, self.uid, self.uid)
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _read(process: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, str | None]:
    """stdout and stderr until both close; stops at the deadline ("wall_time") or past `cap`
    bytes in all ("output")."""
    buffers = {process.stdout: bytearray(), process.stderr: bytearray()}
    selector = selectors.DefaultSelector()
    for stream in buffers:
        selector.register(stream, selectors.EVENT_READ)
    try:
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(buffers[process.stdout]), bytes(buffers[process.stderr]), "wall_time"
            for key, _ in selector.select(min(left, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffers[key.fileobj] += chunk
                if sum(len(b) for b in buffers.values()) > cap:
                    out, err = (bytes(b[:cap]) for b in buffers.values())
                    return out, err, "output"
        while process.poll() is None:  # outputs closed; the program may still run (it closed them)
            if time.monotonic() > deadline:
                return bytes(buffers[process.stdout]), bytes(buffers[process.stderr]), "wall_time"
            time.sleep(0.01)
        return bytes(buffers[process.stdout]), bytes(buffers[process.stderr]), None
    finally:
        selector.close()
        for stream in buffers:
            stream.close()


def _kill(process: subprocess.Popen) -> None:
    """Kill the call's whole process group (bwrap's namespace dies with it) and reap it."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def exit_status(returncode: int) -> int:
    """The program's exit status: a signal shows as 128 + its number, as a shell and bwrap give it."""
    return 128 - returncode if returncode < 0 else returncode


def limit_of(status: int | None, stderr: str) -> str | None:
    """The limit a program that exited with `status` ran into, where the status or Python's error says."""
    if status is None or status == 0:
        return None
    if status > 128 and (status - 128) in _SIGNALLED:
        return _SIGNALLED[signal.Signals(status - 128)]
    tail = stderr[-2000:]
    return next((limit for text, limit in _STDERR_LIMITS.items() if text in tail), None)


def _kill_all(uid: int, timeout_s: float = 10.0) -> None:
    """Kill what still runs as the call's user (a process that left the process group; with
    bwrap, a namespace being torn down) and wait until none does: a call is over with its processes."""
    deadline = time.monotonic() + timeout_s
    while (left := processes_of(uid)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _threads_of(uid: int) -> int:
    """Threads of the user's processes: what RLIMIT_NPROC counts."""
    count = 0
    for pid in processes_of(uid):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            count += len(os.listdir(f"/proc/{pid}/task"))
    return count


def processes_of(uid: int) -> list[int]:
    """Live (not zombie: a zombie runs nothing and the host's init reaps it) processes of `uid`."""
    found = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                if Path(f"/proc/{entry.name}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
                    found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found
