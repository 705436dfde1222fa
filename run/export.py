"""A run's model as a standalone HF model directory: what `AutoModelForCausalLM`,
`AutoTokenizer` and `vllm serve` load.

Checkpoints keep the trainer's float32 master weights (exact resume); an export casts them to
the run's `model.dtype` and carries the tokenizer, its chat template and the generation config.
The tokenizer is the checkpoint's, whose chat template is the one the run rendered with (meshrl's
Hermes under `model.renderer = "hermes"`), so a server of the export speaks the trained format.
Written into a temporary sibling, fsynced, then renamed over OUT.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.configs.run_record import RECORD, run_config
from meshrl.run.run_dir import RunDir, fsync_dir, fsync_tree
from meshrl.trainer.core import DTYPES


def export_model(source: Path, out: Path, dtype: str) -> Path:
    """The HF model directory at `source` (a checkpoint's `model/`) written to `out` in `dtype`; a
    LoRA run's adapters (the checkpoint's `adapter/`, peft's format) go along as `out/adapter/`."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[dtype])
    tokenizer = AutoTokenizer.from_pretrained(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if (source.parent / "adapter").is_dir():
            shutil.copytree(source.parent / "adapter", tmp / "adapter")
        fsync_tree(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def export_run(run_dir: Path, out: Path, step: int | None = None) -> Path:
    """Export checkpoint `step` of the run at `run_dir` (its newest complete one when None)."""
    if not (run_dir / RECORD).is_file():
        raise ValueError(f"{run_dir}: not a run directory (no {RECORD})")
    config = run_config(run_dir)  # with the changes its resumes recorded (model.dtype among them)
    checkpoints = RunDir(run_dir).complete_checkpoints()
    if not checkpoints:
        raise ValueError(f"{run_dir / 'checkpoints'}: no complete checkpoint to export")
    if step is None:
        return export_model(checkpoints[-1] / "model", out, config.model.dtype)
    chosen = [c for c in checkpoints if c.name == f"step_{step}"]
    if not chosen:
        present = ", ".join(c.name.removeprefix("step_") for c in checkpoints)
        raise ValueError(f"{run_dir / 'checkpoints'}: no complete checkpoint for step {step} (present: {present})")
    return export_model(chosen[0] / "model", out, config.model.dtype)
