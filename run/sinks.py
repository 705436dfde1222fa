"""Metric sinks besides `metrics.jsonl`: TensorBoard event files and Weights & Biases.

Every numeric value of each step's record goes to each sink configured, at that step; the run's
resolved config goes once (TensorBoard: a text summary; W&B: the run config). On resume the
sinks continue the same run: TensorBoard purges events at or after the resumed step (the steps
redone are not drawn twice), W&B resumes the run id kept in the run directory.
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any

from meshrl.configs.loader import to_toml
from meshrl.configs.schema import RunConfig


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers (NaN marks a metric with nothing to average this step)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class MetricSinks:
    def __init__(self, config: RunConfig, root: Path, start_step: int) -> None:
        self.tensorboard = self.wandb = None
        if config.metrics.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError(
                    "metrics.tensorboard needs the tensorboard package: pip install 'meshrl[tensorboard]'"
                ) from exc
            self.tensorboard = SummaryWriter(str(root / "tensorboard"), purge_step=start_step or None)
            if start_step == 0:
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
        step, values = record["step"], _scalars(record)
        if self.tensorboard is not None:
            for key, value in values.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
