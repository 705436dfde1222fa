"""`meshrl train` end to end through real Monarch meshes: a short run, SIGKILL + resume, loss swaps.

Runs use a task from tests/fixtures (graded reward for any text, an oracle for the
teachers) and a very small model, so every step is a few seconds on two CPU cores.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshrl.configs import load_config

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from echo_task import EchoTask

REPO = Path(__file__).resolve().parents[1]
MESHRL = [sys.executable, "-m", "meshrl.cli.main"]
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


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_short_run_through_real_meshes(tmp_path):
    out = tmp_path / "run"
    evals = ["--eval.interval", "2", "--eval.n", "2", "--eval.k", "2"]
    result = train(out, "--max-steps", "3", "--topology.trainer.procs", "2", "--ckpt.interval", "2", *evals)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = records(out)
    assert [r["step"] for r in metrics] == [0, 1, 2]
    # Evaluation beside training (policy 2's starts after step 1; when it lands depends on timing):
    # the last step evaluates the final policy 3 and waits; `meshrl eval` of the final checkpoint agrees.
    assert metrics[-1]["eval/policy_version"] == 3 and "eval/pass@2" in metrics[-1]
    evaluated = subprocess.run([*MESHRL, "eval", "@", str(out / "config.toml"), "--checkpoint", str(out), "--n", "2",
                                "--k", "2", "--out", str(out / "eval.json")], capture_output=True, text=True,
                               timeout=240, cwd=REPO, env=ENV)  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    saved = json.loads((out / "eval.json").read_text())
    assert saved["checkpoint"] == str(out / "checkpoints" / "step_3" / "model")
    assert saved["eval/reward_greedy"] == pytest.approx(metrics[-1]["eval/reward_greedy"])
    assert "eval/pass@2" in evaluated.stdout
    for r in metrics:
        for key in ("reward/mean", "loss/total", "policy_version", "staleness", "rollout_tokens_per_s",
                    "train_tokens_per_s", "time/weight_sync"):  # fmt: skip
            assert key in r, key
    assert any(r.get("loss/rl", 0) != 0 for r in metrics)  # graded rewards give non-zero advantages
    assert any(r.get("loss/replay", 0) != 0 for r in metrics)  # the oracle teachers' pairs arrive a step later
    # max_async_level 1: step n trains on tokens of policy n-1 (or n, where its weights landed mid-episode)
    assert all(r["staleness/max"] <= 1 for r in metrics) and 0 < metrics[1]["staleness"] <= 1

    actors = json.loads((out / "topology.json").read_text())["actors"]
    roles = sorted((a["role"], a["rank"]) for a in actors)
    assert roles == [("generator", 0), ("teacher", 0), ("trainer", 0), ("trainer", 1)]
    assert len({a["pid"] for a in actors}) == 4
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_3"]
    assert (out / "checkpoints" / "step_2" / "COMPLETE").exists()
    assert (out / "checkpoints" / "step_2" / "model" / "model.safetensors").exists()
    assert {p.name for p in (out / "plots").iterdir()} == {"reward.png", "losses.png", "throughput.png", "timeline.png"}
    assert load_config(["@", str(out / "config.toml")]).max_steps == 3

    # max_async_level 1: step 2's prompts were drawn, not trained, when step 2 was saved; the
    # checkpoint keeps the prompt stream from before that draw, so a resume draws them again.
    stream = random.Random(0)
    for _ in range(2):
        EchoTask().sample_prompts(stream, 2)
    saved = json.loads((out / "checkpoints" / "step_2" / "controller.json").read_text())["data_rng"]
    assert saved == json.loads(json.dumps(stream.getstate()))

    again = train(out, "--max-steps", "3")  # a fresh run into this directory would mix with the old one
    assert again.returncode == 2
    assert (
        f"output_dir {out} holds an earlier run (checkpoints: step_2, step_3; metrics.jsonl: 3 steps)" in again.stderr
    )


SINKS = ["--metrics.tensorboard", "--metrics.wandb_project", "meshrl-test", "--metrics.wandb_mode", "offline"]


def test_sigkill_after_a_checkpoint_then_resume(tmp_path):
    """Also the metric sinks: TensorBoard and W&B (offline) continue the same run after the resume."""
    out = tmp_path / "run"
    args = [*MESHRL, "train", *SMALL, "--output-dir", str(out), "--max-steps", "6", "--ckpt.interval", "2", *SINKS]
    proc = subprocess.Popen(args, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    deadline = time.time() + 180
    while not (out / "checkpoints" / "step_2" / "COMPLETE").exists():
        assert proc.poll() is None and time.time() < deadline, "no checkpoint before the run ended"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    result = train(out, "--max-steps", "6", "--ckpt.interval", "2", "--resume", *SINKS)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = records(out)
    assert [r["step"] for r in metrics] == list(range(6))  # exactly one record per step

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    rewards = events.Scalars("reward/mean")  # the killed run's steps after the checkpoint were purged
    assert [e.step for e in rewards] == list(range(6))
    assert [e.value for e in rewards] == pytest.approx([r["reward/mean"] for r in metrics])
    assert "loss/total" in events.Tags()["scalars"] and "config/text_summary" in events.Tags()["tensors"]
    run_id = (out / "wandb_id").read_text()
    wandb_runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and all(p.name.endswith(run_id) for p in wandb_runs)  # resumed, same run
    assert all((p / f"run-{run_id}.wandb").stat().st_size > 0 for p in wandb_runs)


@pytest.mark.parametrize(
    "swap",
    [
        ["--loss.type", "ipo"],
        ["--loss.replay.weight", "0", "--loss.sdpo.weight", "0"],
        ["--loss.type", "custom", "--loss.import-path", "meshrl.loss_adapters.prime_rl.loss_fn",
         "--loss.kwargs", '{"kl_tau": 0.01}'],
    ],
    ids=["ipo", "rl-only", "custom"],
)  # fmt: skip
def test_loss_swap_needs_no_code_change(tmp_path, swap):
    out = tmp_path / "run"
    result = train(out, "--max-steps", "2", *swap)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = records(out)
    assert len(metrics) == 2
    config = load_config(["@", str(out / "config.toml")])
    if "--loss.replay.weight" in swap:
        assert config.loss.replay.weight == 0 and config.loss.sdpo.weight == 0
        assert all("loss/replay" not in r and "loss/sdpo" not in r for r in metrics)  # teachers' pairs go unused
    else:
        assert config.loss.type == swap[1]
