"""A rank's replay, SDPO or warm-start batch cut into micro-batches that `trainer.micro_batch_tokens` bounds.

The collator builds one batch per rank and channel. A step of long agentic episodes has tens of
error sites (a student row and a teacher row each) or pairs (a chosen and a rejected row) that are
thousands of tokens wide, and one forward pass over all of them held every layer's activations at
once: a repository step of SmolLM2 went past 20 GB. Cut into micro-batches of whole units (a site,
a pair), each trimmed of the columns that are padding in all of its rows and weighted by its share of
the step's count, the summed gradients are the one-batch mean's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from meshrl.loss_adapters.compose import sdpo_targets


@dataclass(frozen=True)
class Columns:
    """Keys of a channel that share one width (`prefix`), the attention masks telling their padding
    and the side it is on (SDPO's student and teacher rows are left-padded together, aligned at
    their recovery tokens; each DPO side is right-padded on its own)."""

    prefix: str
    masks: tuple[str, ...]
    left: bool


SFT = ""  # the warm start's batch: its keys have no channel prefix; a unit is a row
COLUMNS = {
    SFT: (Columns(SFT, ("attention_mask",), left=False),),
    "dpo_": (
        Columns("dpo_chosen_", ("dpo_chosen_attention_mask",), left=False),
        Columns("dpo_rejected_", ("dpo_rejected_attention_mask",), left=False),
    ),
    "sdpo_": (Columns("sdpo_", ("sdpo_student_attention_mask", "sdpo_teacher_attention_mask"), left=True),),
}


@dataclass
class AuxMicroBatch:
    """Some whole units of a channel's batch and what its loss is a mean over (pairs or recovery tokens)."""

    batch: dict[str, Tensor]
    count: int


def unit_counts(channel: str, batch: dict[str, Tensor]) -> Tensor:
    """What each unit adds to its channel's count: 1 a DPO pair, its recovery tokens an SDPO site,
    its assistant tokens a warm-start row."""
    if channel == SFT:
        return batch["loss_mask"].sum(1).long().cpu()
    if channel == "dpo_":
        return torch.ones(len(batch["dpo_chosen_input_ids"]), dtype=torch.long)
    return sdpo_targets(batch).sum(1).long().cpu()


def _extents(batch: dict[str, Tensor], columns: Columns) -> Tensor:
    """Each row's width without the padding on its padded side (the full width without masks)."""
    key = next(k for k, v in batch.items() if k.startswith(columns.prefix) and v.dim() >= 2)
    rows, width = batch[key].shape[:2]
    if not all(m in batch for m in columns.masks):
        return torch.full((rows,), width, dtype=torch.long)
    occupied = torch.stack([batch[m].cpu() != 0 for m in columns.masks]).any(0)
    first = (occupied.flip(1) if not columns.left else occupied).int().argmax(1)
    return torch.where(occupied.any(1), width - first, 0)


def aux_micro_batches(channel: str, batch: dict[str, Tensor], budget: int) -> list[AuxMicroBatch]:
    """`batch`'s units (those with a count) in micro-batches of at most `budget` tokens (their rows
    times the trimmed widths; a unit wider than the budget alone), widest first."""
    counts = unit_counts(channel, batch)
    groups = COLUMNS[channel]
    extents = torch.stack([_extents(batch, g) for g in groups], 1)  # (units, sides)
    rows = torch.tensor([len(g.masks) for g in groups])  # rows a unit has on each side: SDPO's student and teacher
    units = sorted((i for i in range(len(counts)) if counts[i] > 0), key=lambda i: -int((extents[i] * rows).sum()))
    chunks: list[list[int]] = []
    for i in units:
        if chunks:
            widths = torch.maximum(extents[chunks[-1]].amax(0), extents[i])
            if (len(chunks[-1]) + 1) * int((widths * rows).sum()) <= budget:
                chunks[-1].append(i)
                continue
        chunks.append([i])
    return [_take(batch, chunk, extents[chunk].amax(0), groups, int(counts[chunk].sum())) for chunk in chunks]


def _take(
    batch: dict[str, Tensor], rows: list[int], widths: Tensor, groups: tuple[Columns, ...], count: int
) -> AuxMicroBatch:
    """Rows `rows` of `batch`, each side's columns cut to its width from its padded side."""
    out, index = {}, torch.tensor(rows)
    for key, value in batch.items():
        value = value[index.to(value.device)]
        side = next((j for j, g in enumerate(groups) if key.startswith(g.prefix)), None)
        if side is not None and value.dim() >= 2:
            width = int(widths[side])
            value = value[:, value.shape[1] - width :] if groups[side].left else value[:, :width]
        out[key] = value
    return AuxMicroBatch(out, count)
