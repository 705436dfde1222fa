"""Metric sinks besides `metrics.jsonl`: TensorBoard event files and Weights & Biases.

Every numeric value of each step's record goes to each sink configured, at that step (the warm
start's SFT steps too); the run's resolved config goes once (TensorBoard: a text summary; W&B: the
run config). On resume the sinks continue the same run: TensorBoard purges events at or after the
resumed step (the steps redone are not drawn twice), W&B resumes the run id kept in the run directory.
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any

from meshrl.configs.loader import to_toml
from meshrl.configs.schema import RunConfig
from meshrl.run.run_dir import WARM_START


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers (NaN marks a metric with nothing to average this step)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class MetricSinks:
    def __init__(self, config: RunConfig, root: Path, purge_from: int | None) -> None:
        """`purge_from`: the TensorBoard step a resumed run goes on from (events at or after it are
        the killed run's, redone now); None for a fresh run."""
        self.tensorboard = self.wandb = None
        self.warm_start_steps = config.trainer.warm_start_steps
        self.defined: set[str] = set()
        if config.metrics.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError(
                    "metrics.tensorboard needs the tensorboard package: pip install 'meshrl[tensorboard]'"
                ) from exc
            self.tensorboard = SummaryWriter(str(root / "tensorboard"), purge_step=purge_from)
            if purge_from is None:
                self.tensorboard.add_text("config", f"```toml\n{to_toml(config)}\n```", 0)
        if config.metrics.wandb_project is not None:
            try:
                import wandb
            except ImportError as exc:
                raise ImportError("metrics.wandb_project needs the wandb package: pip install 'meshrl[wandb]'") from exc
            id_file = root / "wandb_id"
            run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
            id_file.write_text(run_id)
            self.wandb = wandb.init(
                project=config.metrics.wandb_project,
                mode=config.metrics.wandb_mode,
                dir=str(root),
                id=run_id,
                resume="allow",
                name=root.name,
                config=config.model_dump(mode="json"),
            )

    def log(self, record: dict[str, Any]) -> None:
        """An RL step's record at its step; a warm-start record (its keys `warm_start/*`) at its SFT
        step, which TensorBoard draws before RL's step 0 (SFT step - warm_start_steps) and W&B
        against its own axis, `warm_start/step`."""
        step, values = record["step"], _scalars(record)
        warm = record.get("phase") == WARM_START
        if self.tensorboard is not None:
            for key, value in values.items():
                self.tensorboard.add_scalar(key, value, step - self.warm_start_steps if warm else step)
            self.tensorboard.flush()
        if self.wandb is not None:
            axis = "warm_start/step" if warm else "step"
            for key in set(values) - self.defined:
                self.wandb.define_metric(key, step_metric=axis)
            self.defined |= set(values)
            self.wandb.log({**values, axis: step})

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
