"""Trainer checkpoints written off the critical path.

Saving has two halves. The snapshot is a CPU copy of everything a checkpoint holds, taken
between two steps (under FSDP2 it is a collective, so every rank joins). The write — safetensors,
`trainer.pt`, the tokenizer, an fsync of each file — runs on a background thread while
training goes on; the controller commits the checkpoint (COMPLETE marker, one rename) only
once the trainer reports the write done, so a checkpoint is still all or nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoTokenizer

from meshrl.run.run_dir import fsync_tree


@dataclass
class TrainerState:
    """What a trainer checkpoint holds, copied off the live model and optimizer."""

    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    skipped_steps: int
    rng: dict[str, Any]
    reference: dict[str, torch.Tensor] | None
    islands: dict[str, Any] | None = None  # DiLoCo's outer state (`Islands.state`) when training in islands
    adapters: dict[str, torch.Tensor] | None = None  # LoRA: the adapters' tensors, what a resume loads
    adapter_config: Any = None  # LoRA: peft's config of them, saved beside them in peft's format
    reference_adapters: dict[str, torch.Tensor] | None = None  # LoRA: the frozen adapters the reference uses


def own_copy(state: Any, clone_tensors: bool) -> Any:
    """`state`'s dicts and lists rebuilt (the optimizer's param groups are live dicts the
    scheduler updates), its tensors cloned when `clone_tensors`: gathered to CPU from a GPU they
    are copies already, but on CPU they alias the parameters and AdamW moments the next step
    overwrites while the write runs."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone() if clone_tensors else state
    if isinstance(state, dict):
        return {key: own_copy(value, clone_tensors) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(own_copy(value, clone_tensors) for value in state)
    return state


def write_checkpoint(
    state: TrainerState,
    directory: Path,
    model: nn.Module,
    reference: nn.Module | None,
    tokenizer_path: str,
    chat_template: str | None = None,
) -> None:
    """Write a snapshot into `directory` (model/ loads as an HF model dir) and fsync it. The tokenizer
    goes along with `chat_template` as its template when the run rendered with one in place of its
    own (`model.renderer = "hermes"`): exports copy it, so the trained model speaks its format."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory / "model", state_dict=state.weights)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory / "model")
    torch.save(
        {
            "optimizer": state.optimizer,
            "scheduler": state.scheduler,
            "skipped_steps": state.skipped_steps,
            "rng": state.rng,
            "islands": state.islands,
            "reference_adapters": state.reference_adapters,
        },
        directory / "trainer.pt",
    )
    if reference is not None and state.reference is not None:  # save_pretrained stores tied weights once
        reference.save_pretrained(directory / "reference", state_dict=state.reference)
    if state.adapters is not None:  # peft's format: PeftModel.from_pretrained(base, adapter/) loads it
        state.adapter_config.save_pretrained(directory / "adapter")
        save_file(state.adapters, directory / "adapter" / "adapter_model.safetensors")
    fsync_tree(directory)


class CheckpointWriter:
    """One background write at a time; a new one waits for the last. A failed write raises
    from the next `submit` or `written` call, naming the directory."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: tuple[Path, Future[None]] | None = None

    def submit(self, directory: Path, write: Callable[[], None]) -> None:
        self.written(wait=True)
        self._pending = (directory, self._pool.submit(write))

    def written(self, wait: bool) -> bool:
        """True once no write is in flight (`wait`: block until then)."""
        if self._pending is None:
            return True
        directory, future = self._pending
        if not wait and not future.done():
            return False
        self._pending = None
        try:
            future.result()
        except Exception as exc:
            raise RuntimeError(f"writing checkpoint {directory} failed: {type(exc).__name__}: {exc}") from exc
        return True
