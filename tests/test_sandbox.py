"""Code a policy wrote, run through the real bubblewrap sandbox: each hostile program is contained,
answered with a bounded result naming the limit it broke, and leaves the host as it was."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import socket
import sys
import threading
from pathlib import Path

import pyseccomp
import pytest

from meshrl.configs.loader import ConfigError, load_config
from meshrl.configs.schema import SandboxConfig
from meshrl.run.preflight import preflight
from meshrl.sandbox import Run, Sandbox, SandboxUnavailable, bwrap, make_sandbox
from meshrl.sandbox import core as sandbox_core
from meshrl.sandbox.core import processes_of

LIMITS = {"wall_time_s": 3.0, "cpu_time_s": 1, "memory_mb": 256, "processes": 16, "file_size_mb": 1,
          "workdir_mb": 4, "files": 256, "output_bytes": 4096, "pool_size": 2}  # fmt: skip
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="only as root does each call get a tmpfs of the host's")


@pytest.fixture(scope="module")
def sandbox():
    box = make_sandbox(SandboxConfig(**LIMITS))
    yield box
    box.close()


def run_as(sandbox, program: str) -> tuple[Run, int]:
    """Run `program` after a line printing the uid it runs as (as root every call has its own:
    other test processes may be running calls of their own meanwhile)."""
    run = sandbox.run_python("import os as _os\nprint(_os.getuid(), flush=True)\n" + program)
    return run, int(run.stdout.split("\n", 1)[0][:12])


def test_a_program_runs_in_an_empty_directory_with_nothing_of_the_host(sandbox):
    run = sandbox.run_python("import os, sys\nprint(os.getcwd(), sorted(os.listdir('/')), os.listdir('.'))")
    assert run.ok, run.report()
    assert run.stdout.split(" ", 1)[0] == "/work"
    assert "'home'" not in run.stdout and "'root'" not in run.stdout and "'etc'" not in run.stdout
    assert run.stdout.rstrip().endswith("[]")  # the program itself lives outside it


def test_dev_is_read_only_and_shared_memory_is_bounded(sandbox):
    run = sandbox.run_python("open('/dev/evil', 'w')")
    assert "Read-only file system" in run.stderr
    run = sandbox.run_python(
        "f = open('/dev/shm/x', 'w')\nfor _ in range(8):\n    f.write('x' * (1 << 20))\n    f.flush()"
    )
    assert run.limit in ("workdir", "file_size"), run.report()


def unreclaimable_kib() -> int:
    """The host's kernel memory that no pressure reclaims (inodes and dentries of a tmpfs are in it)."""
    return next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("SUnreclaim:"))


@AS_ROOT
def test_a_program_that_makes_files_without_end_stops_at_the_file_limit(sandbox):
    program = """
import time
made = 0
try:
    while made < 30_000:  # 25 MB of kernel memory without the limit
        open(f"/work/{made}" if made % 2 else f"/tmp/{made}", "w").close()
        made += 1
except OSError:
    print(made, flush=True)
    time.sleep(0.3)  # while the host reads its kernel memory
    raise"""
    before, grew, done = unreclaimable_kib(), [0], threading.Event()

    def watch() -> None:
        while not done.wait(0.01):
            grew[0] = max(grew[0], unreclaimable_kib() - before)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        run = sandbox.run_python(program)
    finally:
        done.set()
        watcher.join()
    assert run.limit == "files" and 0 < int(run.stdout) < LIMITS["files"], run.report()
    assert grew[0] < 8 << 10, f"the host's unreclaimable kernel memory grew by {grew[0]} KiB"


@AS_ROOT
def test_files_in_work_and_tmp_together_stay_within_the_workdir_bound(sandbox):
    program = """
written = 0
def fill(directory):
    global written
    for n in range(64):
        with open(f"{directory}/{n}", "wb") as file:
            file.write(b"x" * (256 << 10))
        written += 256 << 10
try:
    fill("/work")
except OSError:
    pass
try:
    fill("/tmp")
finally:
    print(written)"""
    run = sandbox.run_python(program)
    bound = LIMITS["workdir_mb"] << 20
    assert run.limit == "workdir" and bound // 2 <= int(run.stdout) <= bound, run.report()


@AS_ROOT
def test_a_workspace_keeps_its_files_across_calls_within_one_bound_and_close_removes_everything(sandbox):
    """An episode's files: kept across its calls (one uid owns them), bounded across all of them by
    `workdir_mb` as one call's are, and gone from the host with their processes on close()."""
    workspace = sandbox.workspace({"repo/a.py": "x = 1\n"})
    fill = "import os\nfor n in range(3):\n    open(f'part{n}', 'wb').write(b'x' * (900 << 10))\nprint(sorted(os.listdir('.')))"
    first = sandbox.run_python(fill, workspace)
    assert first.ok and first.stdout.split() == ["['part0',", "'part1',", "'part2',", "'repo']"], first.report()
    again = sandbox.run_python(fill.replace("part", "more"), workspace)  # 5.3 MB in all: past the 4 MB bound
    assert again.limit == "workdir", again.report()
    seen = sandbox.run_python("import os, subprocess\nsubprocess.Popen(['sleep', '60'])\nprint(os.getuid())", workspace)
    assert int(seen.stdout) == workspace.uid and open(workspace.directory / "repo" / "a.py").read() == "x = 1\n"
    assert sandbox.run_python("import os\nprint(os.listdir('.'))").stdout.strip() == "[]"  # another call sees none
    directory, uid = workspace.directory, workspace.uid
    workspace.close()
    assert not directory.exists() and not processes_of(uid)
    with pytest.raises(SandboxUnavailable, match="closed"):
        sandbox.run_python("pass", workspace)


@AS_ROOT
def test_a_calls_tmpfs_is_mounted_on_the_host_for_the_call_only():
    """Its /work and /dev/shm are two directories of one tmpfs with the inode limit, which is gone
    from the host when the call is, killed at the wall time or by close()."""
    box = make_sandbox(SandboxConfig(**{**LIMITS, "wall_time_s": 2.0}))  # room to print on a loaded machine
    uids, launch = [], box.launch
    box.launch = lambda program, uid, workspace, hidden: uids.append(uid) or launch(program, uid, workspace, hidden)
    shown = "[line for line in open('/proc/self/mountinfo') if line.split()[4] in ('/work', '/dev/shm')]"
    run = box.run_python(f"import time\nprint(''.join({shown}), flush=True)\ntime.sleep(60)")
    assert run.limit == "wall_time", run.report()
    mounts = {line.split()[4]: line.split() for line in run.stdout.splitlines() if line}
    work, shm, options = mounts["/work"], mounts["/dev/shm"], mounts["/work"][-1].split(",")
    assert work[2] == shm[2] and (work[3], shm[3]) == ("/work", "/shm"), run.report()
    assert f"nr_inodes={LIMITS['files']}" in options and f"uid={uids[0]}" in options and "mode=700" in options
    thread = threading.Thread(target=box.run_python, args=("while True:\n    pass",))
    thread.start()
    while len(uids) < 2:
        threading.Event().wait(0.01)
    box.close()
    thread.join()
    for uid in uids:
        assert f" {bwrap.MOUNTS / str(uid)} " not in Path("/proc/self/mountinfo").read_text()
        assert not (bwrap.MOUNTS / str(uid)).exists()


def test_the_root_is_read_only(sandbox):
    run = sandbox.run_python("import os\nprint(bool(os.statvfs('/').f_flag & os.ST_RDONLY))\nos.mkdir('/pinned')")
    assert run.stdout == "True\n" and "Read-only file system" in run.stderr, run.report()


LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"


@pytest.mark.parametrize(
    "program",
    [
        "libc.shmat.restype = ctypes.c_void_p\nshm = libc.shmget(0, 8 << 20, 0o1600)\nif shm < 0:\n"
        "    print('refused', ctypes.get_errno())\nelse:\n    address = libc.shmat(shm, None, 0)\n"
        "    ctypes.memset(address, 1, 8 << 20)\n    libc.shmdt(ctypes.c_void_p(address))\n    print('pinned')",
        "try:\n    os.write(os.memfd_create('x'), b'x' * (1 << 19))\n    print('pinned')\n"
        "except OSError as error:\n    print('refused', error.errno)",
        "uid, gid = os.getuid(), os.getgid()\nif libc.unshare(0x10000000 | 0x20000):  # CLONE_NEWUSER | CLONE_NEWNS\n"
        "    print('refused', ctypes.get_errno())\nelse:\n    open('/proc/self/setgroups', 'w').write('deny')\n"
        "    open('/proc/self/uid_map', 'w').write(f'0 {uid} 1')\n    open('/proc/self/gid_map', 'w').write(f'0 {gid} 1')\n"
        "    if libc.mount(b'none', b'/work', b'tmpfs', 0, None):\n        print('refused', ctypes.get_errno())\n"
        "    else:\n        open('/work/x', 'wb').write(b'x' * (1 << 19))\n        print('pinned')",
    ],
    ids=["detached-sysv-shm", "memfd", "tmpfs-in-a-nested-user-namespace"],
)  # fmt: skip
def test_memory_outside_the_calls_bound_cannot_be_pinned(sandbox, program):
    run = sandbox.run_python(LIBC + program)
    assert run.ok and run.stdout.startswith("refused"), run.report()


def test_kernel_interfaces_a_program_has_no_use_for_are_refused_not_fatal(sandbox):
    numbers = {name: pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name)
               for name in ("bpf", "perf_event_open", "userfaultfd", "io_uring_setup")}  # fmt: skip
    calls = f"for name, number in {numbers}.items():\n    print(name, libc.syscall(number, 0, 0, 0, 0, 0), ctypes.get_errno())"
    run = sandbox.run_python(LIBC + calls)
    assert run.ok and run.stdout.splitlines() == [f"{name} -1 1" for name in numbers], run.report()


def test_the_callers_keyring_is_out_of_reach_and_no_key_outlives_a_call(sandbox):
    add_key, keyctl = (pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, n) for n in ("add_key", "keyctl"))
    session, search, read, unlink = -3, 10, 11, 9  # KEY_SPEC_SESSION_KEYRING, KEYCTL_SEARCH, _READ, _UNLINK
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    host_key = libc.syscall(add_key, b"user", b"meshrl-test-host", b"host-secret", 11, session)
    assert host_key > 0, os.strerror(ctypes.get_errno())
    calls = f"""
buffer = ctypes.create_string_buffer(64)
print('host key:', libc.syscall({keyctl}, {search}, {session}, b'user', b'meshrl-test-host', 0),
      libc.syscall({keyctl}, {read}, {host_key}, buffer, 64), buffer.value)
print('planted:', libc.syscall({keyctl}, {search}, {session}, b'user', b'meshrl-test-planted', 0),
      libc.syscall({add_key}, b'user', b'meshrl-test-planted', b'x', 1, {session}))
print(open('/proc/keys').read())"""
    try:
        for run in (sandbox.run_python(LIBC + calls), sandbox.run_python(LIBC + calls)):
            assert run.ok and run.stdout.startswith("host key: -1 -1 b''\nplanted: -1 -1\n"), run.report()
            assert "meshrl-test" not in run.stdout or os.geteuid() != 0  # not root: /proc/keys names the user's keys
        assert libc.syscall(keyctl, search, session, b"user", b"meshrl-test-planted", 0) == -1
    finally:
        libc.syscall(keyctl, unlink, host_key, session)


def test_a_program_may_use_threads_subprocesses_and_multiprocessing(sandbox):
    program = """
import multiprocessing, subprocess, sys, tempfile, threading
thread = threading.Thread(target=print, args=("thread",))
thread.start()
thread.join()
print(subprocess.run([sys.executable, "-c", "print('child')"], capture_output=True, text=True).stdout, end="")
with multiprocessing.Pool(2) as pool:
    print(pool.map(abs, [-1, -2]))
print(tempfile.mkstemp()[1].startswith("/tmp/"))"""
    run = sandbox.run_python(program)
    assert run.ok and run.stdout == "thread\nchild\n[1, 2]\nTrue\n", run.report()


def test_writes_outside_the_working_directory_do_not_reach_the_host(sandbox, tmp_path):
    victim = tmp_path / "victim.txt"
    program = f"""
import os
for path in ["/usr/evil", {str(victim)!r}, "/root/.ssh/authorized_keys", "/etc/cron.d/evil"]:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").write("owned")
        print("wrote", path)
    except OSError as error:
        print("refused", path, error.errno)
"""
    run = sandbox.run_python(program)
    assert run.exit_code == 0, run.report()
    assert "refused /usr/evil" in run.stdout  # read-only
    assert not victim.exists() and not os.path.exists("/usr/evil") and not os.path.exists("/etc/cron.d/evil")


def test_key_files_and_the_environment_of_the_run_are_not_readable(sandbox, tmp_path, monkeypatch):
    secret = tmp_path / "server.key_secret"
    secret.write_text("curve-secret-" + "x" * 8)
    monkeypatch.setenv("MESHRL_TEST_TOKEN", "token-" + "y" * 8)
    program = f"""
import os
print(sorted(os.environ))
for path in [{str(secret)!r}, "/root/.bash_history", "/proc/1/environ", "/etc/shadow"]:
    try:
        print(open(path, errors="replace").read()[:200])
    except OSError as error:
        print("refused", path, error.errno)
"""
    run = sandbox.run_python(program)
    shown = run.stdout + run.stderr
    assert "curve-secret" not in shown and "token-yyyy" not in shown and "MESHRL_TEST_TOKEN" not in shown
    assert f"refused {secret}" in run.stdout


def test_no_socket_reaches_the_host_or_the_network(sandbox):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    program = f"""
import socket
for address in [("127.0.0.1", {port}), ("1.1.1.1", 53)]:
    try:
        socket.create_connection(address, timeout=1).close()
        print("connected", address)
    except OSError as error:
        print("refused", address, error.errno)
"""
    try:
        run = sandbox.run_python(program)
        assert "connected" not in run.stdout, run.report()
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing came in
    finally:
        listener.close()


@pytest.mark.parametrize(
    ("program", "limits"),
    [
        ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", {"processes", "wall_time"}),
        ("x = bytearray(8 << 30)", {"memory"}),
        ("while True:\n    pass", {"cpu_time"}),
        ("import time\ntime.sleep(3600)", {"wall_time"}),
        ("import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * (1 << 20))", {"output"}),
        ("open('big', 'w').write('x' * (2 << 20))", {"file_size"}),
        ("import threading, time\n[threading.Thread(target=time.sleep, args=(60,)).start() for _ in range(64)]",
         {"processes", "wall_time"}),  # the threads it started sleep on past the deadline
    ],
    ids=["fork-bomb", "8GB", "busy-loop", "sleep", "1GB-of-output", "big-file", "threads"],
)  # fmt: skip
def test_a_program_that_breaks_a_limit_is_stopped_and_named(sandbox, program, limits):
    run, uid = run_as(sandbox, program)
    assert run.limit in limits, run.report()
    assert not run.ok and f"sandbox limit reached: {run.limit}" in run.report()
    assert len(run.stdout.encode()) + len(run.stderr.encode()) <= 2 * LIMITS["output_bytes"]
    assert sandbox.run_python("print('next')").stdout == "next\n"  # the sandbox goes on
    if os.geteuid() == 0:
        assert processes_of(uid) == []  # nothing of the call is left


def test_background_processes_die_with_the_call(sandbox):
    program = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)\nprint('parent done')"
    run, uid = run_as(sandbox, program)
    assert run.ok and run.stdout.endswith("\nparent done\n"), (
        run.report()
    )  # ended with its program, not at the deadline
    if os.geteuid() == 0:
        assert processes_of(uid) == []


def test_the_same_code_gives_the_same_result(sandbox):
    program = "print(hash('abc'), list({'b', 'a', 'c', 'd'}))"
    first, second = sandbox.run_python(program), sandbox.run_python(program)
    assert first.ok and (first.stdout, first.stderr) == (second.stdout, second.stderr)


def test_calls_run_at_once_up_to_the_pool_size_and_close_kills_the_rest():
    box = make_sandbox(SandboxConfig(**{**LIMITS, "wall_time_s": 60.0, "cpu_time_s": 60}))
    running, most, lock = [0], [0], threading.Lock()
    inner = box._run

    def counted(slot: int, code: str, workspace, hidden):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            return inner(slot, code, workspace, hidden)
        finally:
            with lock:
                running[0] -= 1

    box._run = counted
    results = []
    threads = [threading.Thread(target=lambda: results.append(box.run_python("import time\ntime.sleep(0.3)")))
               for _ in range(5)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] <= LIMITS["pool_size"] and all(r.ok for r in results) and len(results) == 5
    hung: list = []
    thread = threading.Thread(target=lambda: hung.append(box.run_python("while True:\n    pass")))
    thread.start()
    while running[0] == 0:
        threading.Event().wait(0.05)
    box.close()  # as the generator does when the run ends
    thread.join(timeout=30)
    assert hung and hung[0].exit_code != 0 and not thread.is_alive()
    with pytest.raises(SandboxUnavailable, match="closed"):
        box.run_python("print(1)")


@pytest.mark.skipif(os.geteuid() != 0, reason="calls get uids of their own only as root")
def test_two_sandboxes_of_one_host_never_share_a_uid(monkeypatch):
    """Two sandboxes whose uid counters start together (two workers of one host, by chance) run
    calls at once: neither call's clean-up kills the other's program."""
    monkeypatch.setattr(sandbox_core.random, "randrange", lambda n: 0)
    boxes = [make_sandbox(SandboxConfig(**{**LIMITS, "pool_size": 1})) for _ in range(2)]
    runs: list[Run] = []

    def calls(box: Sandbox) -> None:
        runs.extend(box.run_python("import time\ntime.sleep(0.02)\nprint('ok')") for _ in range(15))

    threads = [threading.Thread(target=calls, args=(box,)) for box in boxes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for box in boxes:
        box.close()
    assert [run for run in runs if not run.ok] == []


def test_a_missing_sandbox_is_refused_naming_what_to_install(monkeypatch):
    with pytest.raises(SandboxUnavailable, match="no such interpreter"):
        make_sandbox(SandboxConfig(python="/no/python3"))
    with monkeypatch.context() as patched:  # no libseccomp: pyseccomp cannot load
        patched.delitem(sys.modules, "pyseccomp")
        patched.setattr(ctypes.util, "find_library", lambda name: None)
        with pytest.raises(SandboxUnavailable, match="apt-get install libseccomp2"):
            make_sandbox(SandboxConfig())
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        make_sandbox(SandboxConfig())
    if os.geteuid() == 0:
        monkeypatch.undo()
        monkeypatch.setattr(sandbox_core, "LEASES", Path("/proc/meshrl-sandbox-uids"))
        with pytest.raises(SandboxUnavailable, match="/proc/meshrl-sandbox-uids"):
            make_sandbox(SandboxConfig())


def test_start_up_refuses_a_sandboxed_task_without_bubblewrap_naming_the_key(monkeypatch, tmp_path):
    config = load_config(["--output-dir", str(tmp_path / "run"), "--task.import-path",
                          "meshrl.tasks.exercises:ExercisesTask", "--task.kwargs", '{"sandbox": {"pool_size": 1}}'])  # fmt: skip
    preflight(config)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ConfigError, match=r"^task\.kwargs\.sandbox\.backend 'bwrap'.*apt-get install bubblewrap"):
        preflight(config)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root mounts the calls' tmpfs")
def test_a_root_that_cannot_mount_runs_calls_on_bwrap_s_tmpfs_and_says_so(monkeypatch, caplog):
    """Root without CAP_SYS_ADMIN (a container's): the sandbox still runs, its file count unbounded, loudly."""
    from meshrl.sandbox import bwrap

    def refused(self):
        raise SandboxUnavailable("mount: Operation not permitted")

    monkeypatch.setattr(bwrap.CallFiles, "__enter__", refused)
    with caplog.at_level(logging.WARNING):
        box = make_sandbox(SandboxConfig(**LIMITS))
    assert not box.host_tmpfs and "the number of files a call makes is unbounded" in caplog.text
    run = box.run_python("open('/tmp/a', 'w').write('x'); open('b', 'w').write('y'); print(6 * 7)")
    assert run.ok and run.stdout.strip() == "42"
    box.close()


def test_no_sandbox_only_when_asked_and_loudly(caplog):
    with caplog.at_level(logging.WARNING):
        box: Sandbox = make_sandbox(SandboxConfig(**{**LIMITS, "backend": "none"}))
    assert "UNSANDBOXED" in caplog.text
    run = box.run_python("print(6 * 7)")
    assert run.ok and run.stdout == "42\n"
    assert box.run_python("while True:\n    pass").limit == "cpu_time"  # the limits still hold
