"""What the end-to-end tests share: `meshrl` in a subprocess with a very small run, the records a
run leaves, `meshrl worker` hosts on loopback, and the loss swaps that several runs carry.

Every `meshrl train` costs seconds of process start-up and mesh spawning before its first step,
so scenarios whose assertions do not conflict share one run: a loss swap rides along with a run
that tests something else (a swap is a config change, and any run shows that it trains).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from meshrl.configs import load_config
from meshrl.configs.run_record import run_sources
from meshrl.run.metric_names import meaning
from meshrl.topology.faults import worker_reachable

REPO = Path(__file__).resolve().parents[1]
MESHRL = [sys.executable, "-m", "meshrl.cli.main"]
# A task from tests/fixtures (graded reward for any text, an oracle for the teachers) and a very
# small model, so every step is a fraction of a second on two CPU cores.
SMALL = [
    "--task.import_path", "echo_task:EchoTask",
    "--task.prompts_per_step", "2",
    "--generator.samples_per_prompt", "2",
    "--generator.max_new_tokens", "10",
    "--model.tiny.hidden_size", "32",
    "--model.tiny.num_layers", "1",
    "--model.tiny.num_heads", "2",
    "--trainer.micro_batch_tokens", "128",
    "--loss.replay.weight", "0.1",
    "--loss.sdpo.weight", "0.05",
    "--teachers.members", '[{"backend": "oracle", "name": "oracle_a"}, {"backend": "oracle", "name": "oracle_b"}]',
    "--metrics.progress", "plain",
]  # fmt: skip
ENV = {**os.environ, "PYTHONPATH": str(REPO / "tests" / "fixtures")}


def train(out: Path, *extra: str, timeout: int = 240) -> subprocess.CompletedProcess:
    args = [*MESHRL, "train", *SMALL, "--output-dir", str(out), *extra]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=ENV)


def records(out: Path, phase: str = "rl") -> list[dict]:
    """The run's metric records of one phase (RL steps, or the warm start's); every key any record
    holds has a line in the metrics glossary (the manual's metrics reference is generated from it)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    unexplained = sorted({key for row in rows for key in row if meaning(key) is None})
    assert not unexplained, f"logged keys missing from meshrl.run.metric_names.METRICS: {unexplained}"
    return [row for row in rows if row.get("phase", "rl") == phase]


# A loss swap needs no code change: each of these config changes trains. The runs that carry one
# check it with `assert_loss_swap`.
LOSS_SWAPS = {
    "ipo": ["--loss.type", "ipo"],
    "rl-only": ["--loss.replay.weight", "0", "--loss.sdpo.weight", "0"],
    "custom": ["--loss.type", "custom", "--loss.import-path", "meshrl.loss_adapters.prime_rl.loss_fn",
               "--loss.kwargs", '{"kl_tau": 0.01}'],
    "ref_kl": ["@", str(REPO / "configs" / "ref_kl.toml")],  # the shipped preset
    "tis": ["--loss.type", "tis", "--loss.level", "sequence", "--loss.cap", "1.5"],
    "mis": ["--loss.type", "mis", "--loss.low", "0.5", "--loss.high", "2"],
}  # fmt: skip


def assert_loss_swap(out: Path, swap: str) -> None:
    """The run in `out` trained every step with the swapped loss, as its config says (config.toml and
    the changes its resumes recorded)."""
    config = load_config(before=run_sources(out))
    metrics = records(out)
    assert [r["step"] for r in metrics] == list(range(config.max_steps))
    assert all("loss/total" in r for r in metrics)
    if swap == "rl-only":
        assert config.loss.replay.weight == 0 and config.loss.sdpo.weight == 0
        assert config.teachers.members  # the teachers still answer; their pairs go unused
        assert all("loss/replay" not in r and "loss/sdpo" not in r for r in metrics)
    else:
        assert config.loss.type == swap
        if swap == "ref_kl":  # the trainer's frozen reference scored every step's rows
            assert all("ref_kl" in r and "ref_kl/is_masked" in r for r in metrics)
        if swap in ("tis", "mis"):  # the correction's metrics on every step that trained RL rows
            trained = [r for r in metrics if "loss/rl" in r]  # a step whose groups all tied trains no RL row
            assert trained and all(f"{swap}/ratio_mean" in r and "mismatch_kl" in r for r in trained)
        if swap == "custom":
            assert config.loss.import_path == "meshrl.loss_adapters.prime_rl.loss_fn"
            assert config.loss.kwargs == {"kl_tau": 0.01}


def free_address(scheme: str = "tcp") -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"{scheme}://127.0.0.1:{s.getsockname()[1]}"


def start_worker(address: str, *tls_args: str, timeout_s: float = 60) -> subprocess.Popen:
    """A `meshrl worker` in its own process group (killing the group is losing the host),
    returned once its port accepts connections."""
    worker = subprocess.Popen([*MESHRL, "worker", "--address", address, *tls_args], cwd=REPO, env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    deadline = time.time() + timeout_s
    while not worker_reachable(address, timeout_s=1.0):
        assert worker.poll() is None, f"meshrl worker {address} exited with rc {worker.returncode}"
        assert time.time() < deadline, f"meshrl worker {address} did not listen within {timeout_s} s"
        time.sleep(0.1)
    return worker


def lose_host(worker: subprocess.Popen) -> None:
    """SIGKILL the worker and every proc it spawned."""
    try:
        os.killpg(worker.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    worker.wait()
