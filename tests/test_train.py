"""`meshrl train` end to end through real Monarch meshes: one run that is SIGKILLed after a
checkpoint and resumed serves the short run's checks (two trainer ranks, evaluation beside
training, checkpoints, plots, the saved prompt stream), the resume's (one record per step, the
metric sinks continued) and `meshrl eval` of its final checkpoint. The loss swaps ride along with
runs elsewhere (tests/e2e.py: LOSS_SWAPS).
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
from e2e import ENV, LOSS_SWAPS, MESHRL, REPO, SMALL, assert_loss_swap, records, train

from meshrl.cli.main import main
from meshrl.configs import load_config

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from echo_task import EchoTask

pytestmark = pytest.mark.mesh

STEPS = 6
# Two trainer ranks, checkpoints every 2 steps, evaluation every 2 (and of the final policy),
# TensorBoard and W&B (offline), the ref_kl preset (a loss swap: its reference is checkpointed and
# resumed too), dynamic sampling (the random tiny model often scores both samples of a prompt 0);
# steps paced at 0.2 s so the kill lands mid-run.
REFILL = 2
RUN = ["--max-steps", str(STEPS), "--topology.trainer.procs", "2", "--ckpt.interval", "2",
       "--eval.interval", "2", "--eval.n", "2", "--eval.k", "2", "--generator.refill_uninformative", str(REFILL),
       "--metrics.tensorboard", "--metrics.wandb_project", "meshrl-test", "--metrics.wandb_mode", "offline",
       "--task.kwargs", '{"prompt_delay_s": 0.2}', *LOSS_SWAPS["ref_kl"]]  # fmt: skip


def test_run_killed_after_a_checkpoint_resumes_evaluates_and_refuses_a_rerun(tmp_path, capsys):
    out = tmp_path / "run"
    proc = subprocess.Popen([*MESHRL, "train", *SMALL, "--output-dir", str(out), *RUN], cwd=REPO, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    deadline = time.time() + 180
    while not (out / "checkpoints" / "step_2" / "COMPLETE").exists():
        assert proc.poll() is None and time.time() < deadline, "no checkpoint before the run ended"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = time.time()
    resumes_at = max(
        int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*") if (p / "COMPLETE").exists()
    )
    # max_async_level 1: step 2's prompts were drawn, not trained, when step 2 was saved; the
    # checkpoint keeps the prompt stream from before that draw, so a resume draws them again.
    stream = random.Random(0)
    for _ in range(2):
        EchoTask().sample_prompts(stream, 2)
    saved = json.loads((out / "checkpoints" / "step_2" / "controller.json").read_text())
    assert saved["data_rng"] == json.loads(json.dumps(stream.getstate()))  # refills draw from their own stream
    assert "refill_rng" in saved

    result = train(out, *RUN, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = records(out)
    assert [r["step"] for r in metrics] == list(range(STEPS))  # exactly one record per step
    # The resume trained every step from its checkpoint on (the killed run's records of those steps were
    # dropped, not kept in place of them); the steps before were the killed run's.
    timeline = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    assert [t["step"] for t in timeline] == list(range(STEPS))
    trained_at = [min(s["start"] for s in t["spans"] if s["lane"] == "trainer") for t in timeline]
    assert all((at > killed_at) == (step >= resumes_at) for step, at in enumerate(trained_at)), (resumes_at, killed_at)
    for r in metrics:
        for key in ("reward/mean", "loss/total", "policy_version", "staleness", "rollout_tokens_per_s",
                    "train_tokens_per_s", "time/weight_sync"):  # fmt: skip
            assert key in r, key
    assert any(r.get("loss/rl", 0) != 0 for r in metrics)  # graded rewards give non-zero advantages
    assert any(r.get("loss/replay", 0) != 0 for r in metrics)  # the oracle teachers' pairs arrive a step later
    # max_async_level 1: step n trains on tokens of policy n-1 (or n, where its weights landed mid-episode)
    assert all(r["staleness/max"] <= 1 for r in metrics) and 0 < metrics[1]["staleness"] <= 1
    # Dynamic sampling: a step with all-equal groups asked for fresh ones (up to REFILL), and trained on
    # them in their place (as in DAPO: a replaced group leaves the batch and the loss normaliser).
    for r in metrics:
        assert r["groups/refilled"] <= REFILL and (r["groups/refilled"] > 0) == (r["groups/uninformative"] > 0)
        assert r["rollouts"] == 2 * 2  # 2 prompts a step, 2 samples each, whatever was replaced
        assert "reward/sampled" in r  # the policy's reward, replaced groups included
    assert any(r["groups/refilled"] for r in metrics)

    actors = json.loads((out / "topology.json").read_text())["actors"]
    roles = sorted((a["role"], a["rank"]) for a in actors)
    assert roles == [("generator", 0), ("teacher", 0), ("trainer", 0), ("trainer", 1)]
    assert len({a["pid"] for a in actors}) == 4
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_4", "step_6"]
    assert (out / "checkpoints" / "step_2" / "COMPLETE").exists()
    assert (out / "checkpoints" / "step_2" / "model" / "model.safetensors").exists()
    assert {p.name for p in (out / "plots").iterdir()} == {"reward.png", "losses.png", "throughput.png", "timeline.png",
                                                       "episodes.png"}  # fmt: skip
    assert load_config(["@", str(out / "config.toml")]).max_steps == STEPS

    # Evaluation beside training (when a policy's lands depends on timing): the last step evaluates
    # the final policy and waits; `meshrl eval` of the final checkpoint agrees.
    assert metrics[-1]["eval/policy_version"] == STEPS and "eval/pass@2" in metrics[-1]
    # The resumed run's rounds: every 2 steps and the final policy, none lost to the last step's record
    # (the step before it waits for a running round).
    versions = [r["eval/policy_version"] for r in metrics[resumes_at:] if "eval/policy_version" in r]
    assert versions == [v for v in (4, STEPS) if v > resumes_at], (versions, resumes_at)
    # (`meshrl eval` and the refused rerun below go through the CLI's main in this process: the same
    # command functions, exit codes and messages as in a shell, without another interpreter's start-up.)
    capsys.readouterr()
    evaluated = main(["eval", "@", str(out / "config.toml"), "--checkpoint", str(out), "--n", "2", "--k", "2",
                      "--out", str(out / "eval.json")])  # fmt: skip
    assert evaluated == 0, capsys.readouterr().err[-3000:]
    saved = json.loads((out / "eval.json").read_text())
    assert saved["checkpoint"] == str(out / "checkpoints" / f"step_{STEPS}" / "model")
    assert saved["eval/reward_greedy"] == pytest.approx(metrics[-1]["eval/reward_greedy"])
    assert "eval/pass@2" in capsys.readouterr().out
    # Without --checkpoint: the config's own model as a run starts from it (the tiny model built
    # from the seed in a temporary directory; no output_dir is made).
    base = main(["eval", "@", str(out / "config.toml"), "--output-dir", str(tmp_path / "unused"), "--n", "2",
                 "--k", "2", "--out", str(out / "base.json")])  # fmt: skip
    assert base == 0, capsys.readouterr().err[-3000:]
    assert json.loads((out / "base.json").read_text())["checkpoint"] == "tiny" and not (tmp_path / "unused").exists()

    # The metric sinks continue the same run after the resume.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    rewards = events.Scalars("reward/mean")  # the killed run's steps after the checkpoint were purged
    assert [e.step for e in rewards] == list(range(STEPS))
    assert [e.value for e in rewards] == pytest.approx([r["reward/mean"] for r in metrics])
    assert "loss/total" in events.Tags()["scalars"] and "config/text_summary" in events.Tags()["tensors"]
    run_id = (out / "wandb_id").read_text()
    wandb_runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and all(p.name.endswith(run_id) for p in wandb_runs)  # resumed, same run
    assert all((p / f"run-{run_id}.wandb").stat().st_size > 0 for p in wandb_runs)

    assert_loss_swap(out, "ref_kl")

    # A fresh run into this directory would mix with the old one: refused, naming what is there.
    assert main(["train", *SMALL, "--output-dir", str(out), "--max-steps", str(STEPS)]) == 2
    assert (
        f"output_dir {out} holds an earlier run (checkpoints: step_2, step_4, step_6; metrics.jsonl: {STEPS} steps)"
        in capsys.readouterr().err
    )
