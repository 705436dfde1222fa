"""The horizon preset end to end: warm start, RL with the curriculum, evaluation, the episode figures."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.e2e import MESHRL, REPO, records

pytestmark = pytest.mark.mesh


def test_the_horizon_preset_trains_with_its_curriculum_and_episode_figures(tmp_path):
    out = tmp_path / "horizon"
    kwargs = {"hops": 6, "demo_hops": 3, "eval_hops": 3, "start_hops": 3, "window": 4}
    args = [*MESHRL, "train", "@", str(REPO / "configs" / "horizon.toml"), "--output-dir", str(out),
            "--max-steps", "2", "--trainer.warm-start-steps", "3", "--task.prompts-per-step", "2",
            "--eval.interval", "2", "--eval.n", "2", "--task.kwargs", json.dumps(kwargs), "--metrics.progress", "plain"]  # fmt: skip
    run = subprocess.run(args, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    steps = records(out)  # every key explained in the metrics glossary
    assert [r["curriculum/horizon"] for r in steps] == [3.0, 3.0]  # a step's own results come 3 steps later
    assert all(r["rollouts/horizon_3"] == 8 and 0 <= r["success/horizon_3"] <= 1 for r in steps)
    assert all(r["episode/turns"] >= 1 and r["episode/tokens"] > 0 for r in steps)
    assert "eval/pass_greedy" in steps[-1]
    assert (out / "plots" / "episodes.png").stat().st_size > 0
    state = json.loads((out / "checkpoints" / "step_2" / "controller.json").read_text())
    assert [list(s) for s in state["curriculum"]] == [["3"], ["3"]]  # the summaries a resume draws from
