"""What the curves and the progress line show: a step without a value is a gap, never a 0."""

from __future__ import annotations

import math

from meshrl.run.plots import plot, series
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


def test_the_progress_line_leaves_out_a_loss_without_rows():
    assert _summary({"reward/mean": 0.5, "loss/total": math.nan, "loss/rl": 0.25}) == "reward 0.5 | rl 0.25"
