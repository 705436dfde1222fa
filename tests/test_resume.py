"""Stopping and resuming a run as a user does: Ctrl-C in the warm start and in RL, SIGKILL,
`--resume` with nothing but the run directory; the resumed records (the warm start's SFT steps and
the RL steps) equal an uninterrupted run's under configs/deterministic.toml, with the teachers and
replay on (a teacher round in flight at the checkpoint is sent again).

State-driven, never timed: each signal reaches a run that EchoTask's hold file has paused at a
prompt draw (the test waits for `<hold>.held` to name that draw), so the run cannot pass the state
the test stops or kills it in, however fast or slow the machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from e2e import ENV, MESHRL, REPO, SMALL, records, train

STEPS = 8  # the SIGKILL needs a prompt draw after step_4's checkpoint is complete: step 7's, once step_6's is taken
pytestmark = pytest.mark.mesh  # whole `meshrl` runs

DETERMINISTIC = ["@", str(REPO / "configs" / "deterministic.toml"), "--max-steps", str(STEPS), "--ckpt.interval", "2",
                 "--trainer.warm-start-steps", "6", "--trainer.warm-start-batch-size", "4"]  # fmt: skip
TIMING = ("time/", "_per_s", "/seconds")  # what differs between two runs of the same computation


def _same_computation(row: dict) -> dict:
    return {key: value for key, value in row.items() if not any(mark in key for mark in TIMING)}


def _start(out: Path, *args: str) -> subprocess.Popen:
    """A run in its own process group, as a terminal runs it (Ctrl-C reaches the whole group)."""
    return subprocess.Popen([*MESHRL, "train", *args, "--output-dir", str(out)], cwd=REPO, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def _until(proc: subprocess.Popen, prefix: str, timeout_s: float = 300) -> list[str]:
    """The run's output up to the first line starting with `prefix`."""
    deadline, lines = time.time() + timeout_s, []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
        assert time.time() < deadline, "".join(lines[-40:])
    raise AssertionError(f"the run ended (rc {proc.wait()}) before {prefix!r}:\n{''.join(lines[-40:])}")


def _paused(proc: subprocess.Popen, hold: Path, draw: int, timeout_s: float = 300) -> None:
    """Wait until the run is paused at its `draw`-th prompt draw by the hold file (it cannot go on
    before the file lets it)."""
    held, deadline = Path(f"{hold}.held"), time.time() + timeout_s
    while True:
        try:
            if held.read_text() == str(draw):
                return
        except FileNotFoundError:
            pass
        ended = proc.poll() is not None
        assert not ended, f"the run ended (rc {proc.returncode}) before draw {draw}:\n{proc.stdout.read()[-3000:]}"
        assert time.time() < deadline, f"the run was not paused at draw {draw} within {timeout_s} s"
        time.sleep(0.05)


def _resume(out: Path, *extra: str) -> subprocess.CompletedProcess:
    """`--resume` with no preset: the run's own config.toml is what it continues with."""
    return subprocess.run([*MESHRL, "train", "--output-dir", str(out), "--resume", *extra], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=ENV)  # fmt: skip


def test_ctrl_c_and_a_kill_then_resume_continue_the_run_exactly(tmp_path):
    hold = tmp_path / "hold"  # in the run's task kwargs, so in its config.toml: every resume reads it
    task = ["--task.kwargs", json.dumps({"hold_file": str(hold)})]
    reference = tmp_path / "reference"
    done = train(reference, *DETERMINISTIC, *task)  # the same task; no hold file yet: nothing holds it
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "run"
    # Ctrl-C in the warm start: its SFT steps are shown, recorded and checkpointed like RL steps. The
    # warm start draws its demonstrations from the task at once (draw 1): the run waits there.
    hold.write_text("0")
    run = _start(out, *SMALL, *DETERMINISTIC, *task)
    _paused(run, hold, 1)
    os.killpg(run.pid, signal.SIGINT)
    _until(run, "meshrl: SIGINT: stopping after the step in flight")
    hold.unlink()  # SFT step 1 runs, then the run stops
    tail = run.stdout.read()
    assert run.wait(timeout=120) == 130, tail[-3000:]
    warm_stop = len(records(out, "warm_start"))
    assert warm_stop == 1 and records(out) == []
    assert f"stopped in the warm start, after SFT step {warm_stop} of 6" in tail
    assert (out / "checkpoints" / f"warm_start_{warm_stop}" / "COMPLETE").exists()
    # Resumed there, then Ctrl-C in RL: the step in flight finishes, a checkpoint of it, plots, and
    # how to resume; exit 130. The resumed run draws the demonstrations (1), steps 0 and 1's prompts
    # as step 0 starts (2, 3), step 2's as step 1 starts (4): it waits at step 3's, as step 2 starts.
    hold.write_text("4")
    run = _start(out, "--resume")
    assert f"warm start from {out / 'checkpoints' / f'warm_start_{warm_stop}'}" in "".join(_until(run, "resuming"))
    _paused(run, hold, 5)
    os.killpg(run.pid, signal.SIGINT)
    _until(run, "meshrl: SIGINT: stopping after the step in flight")
    hold.unlink()  # step 2 runs, then the run stops
    tail = run.stdout.read()
    assert run.wait(timeout=120) == 130, tail[-3000:]
    assert not list((out / "checkpoints").glob("warm_start_*"))  # the first RL checkpoint retired them
    assert f"Continue with: meshrl train --output-dir {out} --resume" in tail
    stopped_at = len(records(out))
    assert stopped_at == 3 and (out / "checkpoints" / f"step_{stopped_at}" / "COMPLETE").exists()
    assert (out / "plots" / "reward.png").exists()
    assert not (out / "final").exists() and "Traceback" not in tail
    record = (out / "config.toml").read_text()
    # A setting that alters training is refused on resume, naming it; nothing is started or written.
    refused = _resume(out, "--trainer.lr", "0.5")
    assert refused.returncode == 2 and "trainer.lr" in refused.stderr and "--allow-config-change" in refused.stderr
    # Resumed with nothing but the directory (and a setting free to change), then SIGKILLed once its
    # next checkpoint (step 4) is complete: it draws steps 3 and 4's prompts as step 3 starts, then
    # one step's as each of steps 4, 5 and 6 starts; it waits at step 7's (draw 5), step 6 in flight,
    # after taking step_6's checkpoint (which commits step_4's) and before committing it.
    hold.write_text("4")
    run = _start(out, "--resume", "--ckpt.keep-last", "5")
    lines = _until(run, "resuming")
    assert f"from {out / 'checkpoints' / f'step_{stopped_at}'} (step {stopped_at})" in lines[-1]
    _paused(run, hold, 5)
    assert (out / "checkpoints" / "step_4" / "COMPLETE").exists()
    assert not (out / "checkpoints" / "step_6" / "COMPLETE").exists()
    assert run.poll() is None  # killed mid-run
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    hold.unlink()  # the last resume runs freely
    resumed = _resume(out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(step 4)" in resumed.stdout
    assert (out / "config.toml").read_text() == record  # the record of how the run started stands
    changes = [json.loads(line)["changes"] for line in (out / "config_changes.jsonl").read_text().splitlines()]
    assert changes == [{"ckpt.keep_last": {"was": 3, "now": 5}}]  # dated, once: the last resume changed nothing
    for phase in ("warm_start", "rl"):
        for want, have in zip(records(reference, phase), records(out, phase), strict=True):
            assert _same_computation(have) == _same_computation(want), (phase, want["step"])
    got = records(out)
    assert [r["step"] for r in got] == list(range(STEPS)) and len(records(out, "warm_start")) == 6
    assert any(r["replay_pairs"] > 0 for r in got[stopped_at:]) and any("loss/replay" in r for r in got[stopped_at:])


def test_a_stop_during_the_last_step_leaves_a_complete_exported_run(tmp_path):
    """SIGTERM while the last step waits for its prompts: the step trains, and the run, complete,
    exports final/ and exits 0 rather than asking to resume a run with nothing left to do."""
    hold = tmp_path / "hold"
    hold.touch()
    out = tmp_path / "run"
    run = _start(out, *SMALL, "--teachers.members", "[]", "--max-steps", "1",
                 "--task.kwargs", json.dumps({"hold_file": str(hold)}))  # fmt: skip
    _until(run, "meshrl: meshes up")  # the stop signals are the run's from before the meshes start
    run.send_signal(signal.SIGTERM)
    _until(run, "meshrl: SIGTERM: stopping after the step in flight")
    hold.unlink()  # step 0 of 1 gets its prompts
    tail = run.stdout.read()
    assert run.wait(timeout=120) == 0, tail[-3000:]
    assert [r["step"] for r in records(out)] == [0] and (out / "checkpoints" / "step_1" / "COMPLETE").exists()
    assert (out / "final" / "config.json").exists() and f"run finished: {out}" in tail
