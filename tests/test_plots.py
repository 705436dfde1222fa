"""What the curves and the progress line show: a step without a value is a gap, never a 0."""

from __future__ import annotations

import math

from meshrl.run.plots import episode_panels, plot, series
from meshrl.run.progress import _summary
from meshrl.run.run_dir import RunDir


def test_a_step_without_a_value_is_a_gap(tmp_path):
    """A key absent, or NaN when written (null in metrics.jsonl: a channel with no rows), is NaN in
    the series the curve draws, so matplotlib leaves a gap there."""
    run = RunDir(tmp_path)
    for record in [
        {"step": 0, "reward/mean": 0.5, "loss/total": 0.2, "loss/replay": 0.7, "train_tokens_per_s": 10.0},
        {"step": 1, "reward/mean": 0.6, "loss/total": math.nan, "train_tokens_per_s": math.nan},
        {"step": 2, "reward/mean": 0.7, "loss/total": 0.0, "loss/replay": None, "train_tokens_per_s": 12.0},
    ]:
        run.append_metrics(record)
    records = run.read_metrics()
    assert records[1]["loss/total"] is None  # strict JSON: null
    for key, expected in [("loss/total", [0.2, None, 0.0]), ("loss/replay", [0.7, None, None]),
                          ("train_tokens_per_s", [10.0, None, 12.0]), ("loss/sdpo", [None] * 3)]:  # fmt: skip
        drawn = series(records, key)
        assert [None if math.isnan(v) else v for v in drawn] == expected, key
    assert {p.name for p in plot(tmp_path)} == {"reward.png", "losses.png", "throughput.png"}


def test_episodes_are_drawn_from_the_records_that_hold_them(tmp_path):
    """episodes.png: a panel per figure some step logged (success by horizon a line per horizon, a
    horizon or turn bin missing at a step a gap); a run without any of them has no such figure."""
    run = RunDir(tmp_path)
    for step in range(3):
        run.append_metrics({
            "step": step, "reward/mean": 0.5, "loss/total": 0.1, "rollout_tokens_per_s": 5.0,
            "episode/turns": 3.0 + step, "episode/tool_calls": 2.0 + step, "episode/tokens": 900.0, "episode/tokens_max": 1500, "episode/elided_tokens": 100.0 * step,
            "episode/version_spread": 0.5, "episode/version_spread_max": 2, "tool_errors/turn_1": 1,
            "tool_errors/turn_3-4": 2, **({"tool_errors/turn_17-32": 1} if step else {}),
            "success/horizon_4": 0.5, "rollouts/horizon_4": 8, **({"success/horizon_16": 0.25} if step != 1 else {}),
        })  # fmt: skip
    records = run.read_metrics()
    assert episode_panels(records) == {
        "success by horizon": {"success/horizon_4": "4", "success/horizon_16": "16"},
        "turns and tool calls per episode": {"episode/turns": "turns", "episode/tool_calls": "tool calls"},
        "tool errors by turn": {f"tool_errors/turn_{b}": f"turn_{b}" for b in ["1", "3-4", "17-32"]},
        "episode tokens": {"episode/tokens": "mean", "episode/tokens_max": "max", "episode/elided_tokens": "elided"},
        "version spread per episode": {"episode/version_spread": "mean", "episode/version_spread_max": "max"},
    }
    assert "episodes.png" in {p.name for p in plot(tmp_path)}
    # a run whose episodes made no tool calls and set no horizon: only the panels it has
    few = RunDir(tmp_path / "few")
    few.append_metrics({"step": 0, "reward/mean": 1.0, "loss/total": 0.1, "rollout_tokens_per_s": 5.0,
                        "episode/turns": 1.0, "episode/tool_calls": 0.0, "episode/tokens": 40.0})  # fmt: skip
    assert list(episode_panels(few.read_metrics())) == ["turns and tool calls per episode", "episode tokens"]
    assert "episodes.png" in {p.name for p in plot(few.root)}
    older = RunDir(tmp_path / "older")  # a run from before these keys: no figure, no error
    older.append_metrics({"step": 0, "reward/mean": 1.0, "loss/total": 0.1, "rollout_tokens_per_s": 5.0})
    assert episode_panels(older.read_metrics()) == {}
    assert "episodes.png" not in {p.name for p in plot(older.root)}


def test_the_progress_line_leaves_out_a_loss_without_rows():
    assert _summary({"reward/mean": 0.5, "loss/total": math.nan, "loss/rl": 0.25}) == "reward 0.5 | rl 0.25"
