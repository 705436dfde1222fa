"""Faults a long run meets, each through real processes: SIGKILLed generator and teacher
actors, teacher endpoints that hang or answer garbage, a lost worker host, a killed controller.
The two runs also carry loss swaps (tests/e2e.py): RL only, and the custom PRIME-RL loss.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from e2e import ENV, LOSS_SWAPS, MESHRL, REPO, SMALL, assert_loss_swap, free_address, lose_host, records, start_worker

pytestmark = [pytest.mark.mesh, pytest.mark.network]


class _BadEndpoint(BaseHTTPRequestHandler):
    """/hang/… never answers in time; /garbage/… answers 200 with text that is no chat completion."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path.startswith("/hang/"):
            time.sleep(3)
        body = b"<html>surprise</html>"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _wait_for(out: Path, proc: subprocess.Popen, what: str, seen, timeout: float = 240) -> list[dict]:
    """The run's records once `seen(records)` holds; fails if the run ends or time runs out first."""
    deadline = time.time() + timeout
    while True:
        metrics = out / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        found = [json.loads(line) for line in lines if line.endswith("}")]  # a line being written is skipped
        found = [r for r in found if "phase" not in r]  # RL steps (the warm start's records are a phase of their own)
        if seen(found):
            return found
        assert proc.poll() is None, f"the run ended before {what}: rc {proc.returncode}"
        assert time.time() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.2)


def _wait_for_step(out: Path, step: int, proc: subprocess.Popen) -> None:
    _wait_for(out, proc, f"step {step}", lambda found: len(found) > step)


def _pid(out: Path, role: str) -> int:
    (actor,) = [a for a in json.loads((out / "topology.json").read_text())["actors"] if a["role"] == role]
    return actor["pid"]


def _replacement(out: Path, role: str, dead: int, proc: subprocess.Popen, timeout: float = 240) -> int:
    """The pid topology.json gives `role` once it names the actor replacing `dead`."""
    deadline = time.time() + timeout
    while (pid := _pid(out, role)) == dead:
        assert proc.poll() is None, f"the run ended before the {role} was replaced: rc {proc.returncode}"
        assert time.time() < deadline, f"no {role} replacement within {timeout} s"
        time.sleep(0.2)
    return pid


def _ignores_sigint(pid: int) -> bool:
    """Whether the process has SIGINT ignored (its /proc status's SigIgn mask): a terminal's Ctrl-C,
    sent to the whole process group, then reaches only the controller."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    mask = next(line.split()[1] for line in status if line.startswith("SigIgn:"))
    return bool(int(mask, 16) & 1 << (signal.SIGINT - 1))


def test_killed_generator_and_teacher_and_bad_endpoints_do_not_stop_training(tmp_path):
    """Also a tool that floods every result (60 KB of hex: ~100k tokens unbounded) in episodes and
    in the warm start's demonstrations, and a generator whose task raises once: every step trains.
    Every mesh process ignores SIGINT, the replacements too (Ctrl-C stops only the controller)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BadEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    bad = {"backend": "openai", "model": "m", "timeout_s": 0.3, "max_retries": 0}
    members = [{"backend": "oracle", "name": "oracle_a"}, {"backend": "oracle", "name": "oracle_b"},
               {**bad, "name": "hangs", "base_url": f"{url}/hang/v1"},
               {**bad, "name": "garbage", "base_url": f"{url}/garbage/v1"}]  # fmt: skip
    out = tmp_path / "run"
    # Steps never wait for teachers; each waits 0.15 s for its prompts, so the 60 steps outlast
    # noticing both deaths, spawning the replacements and the replacement teacher's first round
    # (a round with the hanging endpoint takes 0.3 s). Unpaced steps of this model take ~50 ms: the
    # run could end before a replacement answered.
    fail = tmp_path / "fail_once"
    fail.touch()
    task = {"prompt_delay_s": 0.15, "flood_bytes": 60_000, "fail_file": str(fail)}
    args = [*MESHRL, "train", *SMALL, "--output-dir", str(out), "--max-steps", "60", "--ckpt.interval", "100",
            "--teachers.members", json.dumps(members), "--teachers.states_per_step", "2",
            "--trainer.warm_start_steps", "2", "--task.kwargs", json.dumps(task), *LOSS_SWAPS["rl-only"]]  # fmt: skip
    log = (tmp_path / "train.log").open("w")
    proc = subprocess.Popen(args, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_step(out, 1, proc)
        generator, teacher = _pid(out, "generator"), _pid(out, "teacher")
        # The generator may be a replacement already: the one whose task raised is.
        assert [r for r in ("generator", "teacher", "trainer") if not _ignores_sigint(_pid(out, r))] == []
        os.kill(generator, signal.SIGKILL)
        assert _ignores_sigint(_replacement(out, "generator", generator, proc))
        # The teacher dies once it has answered a round (its failures are then counted).
        _wait_for(out, proc, "a teacher round", lambda found: found and "teacher/failures" in found[-1])
        os.kill(teacher, signal.SIGKILL)
        assert _ignores_sigint(_replacement(out, "teacher", teacher, proc))
        assert proc.wait(timeout=240) == 0, (tmp_path / "train.log").read_text()[-3000:]
    finally:
        proc.kill()
        server.shutdown()

    metrics = records(out)
    assert [r["step"] for r in metrics] == list(range(60))  # none lost, none twice
    last = metrics[-1]
    assert not fail.exists() and last["generator/errors"] == 1  # the failed one replaced, its groups dealt again
    assert last["generator/respawns"] == 2
    cut = re.search(r"warm start: (\d+) demonstrations longer than trainer.micro_batch_tokens 128 were cut",
                    (tmp_path / "train.log").read_text())  # fmt: skip
    assert cut and int(cut.group(1)) > 0  # the flooded ones: trained cut, not whole
    # Killed while streaming (groups for the next steps are always in flight): its groups are
    # dropped whole and counted; a step left with none is asked again, one left with some trains
    # on those; none is recorded twice.
    assert last["lost_rollouts"] >= 2 and last["lost_rollouts"] % 2 == 0  # groups of samples_per_prompt 2
    assert all(r["rollouts"] in (2, 4) for r in metrics)
    assert sum(4 - r["rollouts"] for r in metrics) <= last["lost_rollouts"]
    assert last["teacher/actor_failures"] == 1
    assert last["teacher/failures"] >= 2  # the hanging and the garbage endpoint, counted
    assert _pid(out, "generator") != generator and _pid(out, "teacher") != teacher  # topology.json follows
    killed_teacher_at = next(r["step"] for r in metrics if r["teacher/actor_failures"])
    assert any(r["replay_pairs"] for r in metrics if r["step"] > killed_teacher_at)  # the replacement answers
    assert_loss_swap(out, "rl-only")  # the teachers answered and pairs were mined; none were trained on


def test_killed_controller_reattaches_and_a_lost_host_stops_then_resumes(tmp_path):
    addresses = [free_address() for _ in range(2)]
    workers = [start_worker(a) for a in addresses]
    out = tmp_path / "run"
    args = [
        *MESHRL,
        "train",
        *SMALL,
        "--output-dir",
        str(out),
        "--max-steps",
        "30",
        "--ckpt.interval",
        "2",
        "--topology.mode",
        "attach",
        "--topology.workers",
        json.dumps(addresses),
        "--topology.generator.hosts",
        "2",
        "--task.kwargs",
        '{"prompt_delay_s": 0.3}',
        "--teachers.members",
        "[]",
        *LOSS_SWAPS["custom"],
    ]  # fmt: skip  (generator rank 1 on the second host; paced steps: the run outlasts noticing the lost host)
    try:
        # The controller SIGKILLed after a checkpoint: the workers live on, and a new controller resumes on them.
        proc = subprocess.Popen(args, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_step(out, 2, proc)
        proc.kill()
        proc.wait()
        assert all(w.poll() is None for w in workers)
        proc = subprocess.Popen([*args, "--resume"], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        # Then the second host is lost mid-run: the run checkpoints, names the host and stops.
        _wait_for_step(out, 4, proc)
        lose_host(workers[1])
        _, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 3, stderr[-3000:]
        assert f"worker host {addresses[1]} is lost (generator rank 1" in stderr
        saved = int(stderr.split("Saved checkpoint step ")[1].split(";")[0])
        assert (out / "checkpoints" / f"step_{saved}" / "COMPLETE").exists()
        # The host back: --resume finishes the run, one record per step.
        workers[1] = start_worker(addresses[1])
        result = subprocess.run([*args, "--resume"], capture_output=True, text=True, timeout=240, cwd=REPO, env=ENV)
        assert result.returncode == 0, result.stderr[-3000:]
        assert [r["step"] for r in records(out)] == list(range(30))
        assert_loss_swap(out, "custom")
    finally:
        for w in workers:
            lose_host(w)
