"""Step progress: a rich live display on a terminal, plain log lines otherwise."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

SHOWN = ("reward/mean", "warm_start/loss", "loss/total", "loss/rl", "loss/replay", "loss/sdpo", "rollout_tokens_per_s")


def _summary(record: dict[str, Any]) -> str:
    """The shown keys the step has a value of (a loss that is NaN had no rows: left out, not 'nan')."""
    shown = [k for k in SHOWN if k in record and math.isfinite(record[k])]
    return " | ".join(f"{k.split('/')[-1] if k != 'reward/mean' else 'reward'} {record[k]:.3g}" for k in shown)


class Progress:
    def __init__(self, mode: str, start: int = 0, label: str = "step") -> None:
        self.label = label  # "warm start" for its SFT steps
        self.rich = mode == "rich" or (mode == "auto" and sys.stdout.isatty())
        self.start, self.began = start, time.perf_counter()
        self.bar: RichProgress | None = None
        self.task_id: Any = None

    def __enter__(self) -> Progress:
        if self.rich:
            self.bar = RichProgress(
                TextColumn(f"{self.label} {{task.completed}}/{{task.total}}"), BarColumn(), TimeRemainingColumn(),
                TextColumn("{task.description}"), console=Console(), transient=False,
            )  # fmt: skip
            self.bar.__enter__()
        return self

    def update(self, record: dict[str, Any], total: int) -> None:
        done = record["step"] + 1
        if self.bar is not None:
            if self.task_id is None:
                self.task_id = self.bar.add_task("", total=total, completed=self.start)
            self.bar.update(self.task_id, completed=done, description=_summary(record))
            return
        rate = (done - self.start) / max(time.perf_counter() - self.began, 1e-9)
        eta = (total - done) / rate if rate > 0 else float("inf")
        print(f"{self.label} {done}/{total} | {_summary(record)} | eta {eta:.0f}s", flush=True)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
