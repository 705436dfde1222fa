"""Decentralized rollouts through real processes on loopback: a training run with the mesh's
generator and two `meshrl rollout-worker`s, one of them SIGKILLed mid-lease, a worker whose key
is not listed, and a resume of the run that the surviving worker follows without a restart."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from e2e import ENV, LOSS_SWAPS, MESHRL, REPO, SMALL, assert_loss_swap, free_address, records

from meshrl.ingress.keys import generate_keys

pytestmark = [pytest.mark.mesh, pytest.mark.network]


def _worker(address: str, keys: Path, name: str, log: Path, score_delay_s: float = 0.0) -> subprocess.Popen:
    args = [*MESHRL, "rollout-worker", "--connect", address, "--server-key", str(keys / "server.key"),
            "--key", str(keys / f"{name}.key_secret"), "--timeout-s", "5"]  # fmt: skip
    env = {**ENV, "ECHO_SCORE_DELAY_S": str(score_delay_s)}
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait_for(
    log: Path,
    text: str,
    timeout: float = 300,
    after: str | None = None,
    context: Path | None = None,
    proc: subprocess.Popen | None = None,
) -> None:
    """Until `text` is in the log (after the first `after`, when given); a failure shows `context`'s
    tail too. `proc`, the process writing the log: its exit fails the wait at once, and at the
    timeout it is asked for every thread's stack (SIGUSR1), which the log then shows."""
    deadline = time.time() + timeout
    while text not in (log.read_text().partition(after)[2] if after else log.read_text()):
        ended = proc is not None and proc.poll() is not None
        if time.time() > deadline or ended:
            if proc is not None and not ended:
                proc.send_signal(signal.SIGUSR1)
                time.sleep(2)
            why = f"it ended with rc {proc.returncode}" if ended else f"not within {timeout} s"
            shown = f"\n--- {context}:\n{context.read_text()[-3000:]}" if context else ""
            raise AssertionError(f"no {text!r} in {log}: {why}:\n{log.read_text()[-6000:]}{shown}")
        time.sleep(0.2)


def test_run_with_outside_workers_a_killed_one_and_a_resume(tmp_path):
    keys = tmp_path / "keys"
    generate_keys(keys, "server")
    for name in ("a", "b", "stranger"):
        generate_keys(keys, name)
    (keys / "authorized").mkdir()
    for name in ("a", "b"):
        (keys / "authorized" / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    address = free_address()
    out = tmp_path / "run"
    ingress = [
        "--output-dir", str(out), "--task.prompts_per_step", "4", "--ckpt.interval", "3",
        "--ingress.bind", address, "--ingress.server_key", str(keys / "server.key_secret"),
        "--ingress.authorized_keys", str(keys / "authorized"), "--ingress.groups_per_step", "2",
        "--ingress.lease_timeout_s", "4", "--teachers.members", "[]", *LOSS_SWAPS["tis"],
    ]  # fmt: skip
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b", "stranger")}
    # All three wait for the controller (retrying); the stranger is refused at its first handshake.
    # b scores each episode 1 s long, so once it leases it holds the lease that long: killed then,
    # it dies holding leases whatever the timing (an unpaced b could submit before the kill).
    workers = {name: _worker(address, keys, name, logs[name], 1.0 if name == "b" else 0.0)
               for name in ("a", "b", "stranger")}  # fmt: skip
    hold = tmp_path / "hold"
    try:
        # The controller writes to a file: a pipe nobody reads while the test waits could fill and block it.
        # It publishes its weights, then holds before its first prompts until a and b run them: a
        # worker starts in seconds, and the whole run takes a few (its groups would all go to the mesh).
        hold.touch()
        train_log = tmp_path / "train.log"
        first = subprocess.Popen([*MESHRL, "train", *SMALL, *ingress, "--max-steps", "9", "--task.kwargs",
                                  json.dumps({"hold_file": str(hold)})], cwd=REPO, env=ENV,
                                 stdout=train_log.open("w"), stderr=subprocess.STDOUT)  # fmt: skip
        for name in ("a", "b"):
            _wait_for(logs[name], "policy version 0", context=train_log, proc=workers[name])
        hold.unlink()
        _wait_for(logs["b"], "'accepted'", context=train_log, proc=workers["b"])
        _wait_for(
            logs["b"], "leased", after="'accepted'", context=train_log, proc=workers["b"]
        )  # it leases again after it submits
        workers["b"].send_signal(signal.SIGKILL)  # killed holding leases
        assert workers["stranger"].wait(timeout=120) == 1
        assert "refused this worker's key" in logs["stranger"].read_text()
        assert first.wait(timeout=300) == 0, train_log.read_text()[-3000:]
        part1 = records(out)
        assert [r["step"] for r in part1] == list(range(9))
        assert part1[-1]["ingress/expired"] >= 1  # b's leases ran out and went to the mesh's generator
        assert part1[-1]["ingress/refused"] >= 1
        assert sum(r["rollouts/external"] for r in part1) > 0
        assert all(r["rollouts"] == 8 for r in part1)  # every group came back, from a worker or the mesh

        # The controller restarts (resume); worker a keeps running and follows it. The resumed run
        # offers steps 9 and 10, then holds before step 11's prompts until a has leased from it.
        hold.touch()
        task = json.dumps({"hold_file": str(hold), "hold_after": 2})
        resume_log = tmp_path / "resume.log"
        resumed = subprocess.Popen([*MESHRL, "train", *SMALL, *ingress, "--max-steps", "15", "--resume",
                                    "--allow-config-change", "--task.kwargs", task], cwd=REPO, env=ENV, stdout=resume_log.open("w"),
                                   stderr=subprocess.STDOUT)  # fmt: skip
        _wait_for(
            logs["a"], "leased", after="following the restarted controller", context=resume_log, proc=workers["a"]
        )
        hold.unlink()
        assert resumed.wait(timeout=300) == 0, resume_log.read_text()[-3000:]
        metrics = records(out)
        assert [r["step"] for r in metrics] == list(range(15))
        assert sum(r["rollouts/external"] for r in metrics[9:]) > 0
        assert metrics[-1]["ingress/accepted"] > part1[-1]["ingress/accepted"]  # counters carried over the resume
        assert_loss_swap(out, "tis")  # outside workers' rollouts trained with truncated importance sampling
        assert not [k for k in metrics[-1] if k.startswith("ingress/rejected/")]
        assert workers["a"].poll() is None
        workers["a"].send_signal(signal.SIGTERM)
        assert workers["a"].wait(timeout=30) == 0
        assert "rollout-worker stopped" in logs["a"].read_text()
    finally:
        for proc in workers.values():
            proc.kill()
