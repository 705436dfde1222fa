"""Each loss channel's part of a step's gradient (`metrics.channel_grad_norms`).

A channel's metrics (its loss, pairs, sites) say what it trained on, not how far it moved the
policy: at a small weight a channel can train on every step and still add almost nothing to the
update. Every channel runs its own backward passes (RL, then replay, then SDPO), so its part of the
gradient is what those passes accumulate; with the gradients accumulated before it set aside, that
part is measured alone, then the parts are summed back (the step is unchanged, at the cost of one
more copy of the gradients while a channel runs).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

CHANNELS = {"rl": "rl", "dpo_": "replay", "sdpo_": "sdpo"}  # a channel's key prefix -> its metric name


class ChannelGrads:
    """`grad_norm/<channel>`: the L2 norm of the channel's weighted part of the step's gradient,
    before clipping and over the ranks' mean gradient (as `grad_norm` is), so the channels' norms
    compare with each other and with the step's. Every rank must enter each channel (the norm is a
    collective), as the trainer's passes do."""

    def __init__(self, params: list[nn.Parameter], world: int, sharded: bool) -> None:
        self.params, self.world, self.sharded = params, world, sharded

    @contextmanager
    def channel(self, prefix: str, ran: bool, into: dict[str, float]) -> Iterator[None]:
        """Measure the gradient the block's backward passes add; `ran` (the same on every rank):
        whether the channel had units on any rank this step (no key otherwise)."""
        aside = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        yield
        if ran:
            into[f"grad_norm/{CHANNELS[prefix]}"] = self._norm()
        for p, grad in zip(self.params, aside, strict=True):
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad.add_(grad)

    def _norm(self) -> float:
        """The L2 norm of the gradients the parameters now hold, over the ranks' mean, computed as
        the step's `grad_norm` is (FSDP2's shards are reduced already). DDP's are each rank's own until
        the step's all-reduce, so a flat copy of them is averaged here first."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.world > 1 and not self.sharded:  # every rank sends every gradient (zeros where it had none)
            flat = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).float().flatten() for p in self.params]
            )
            dist.all_reduce(flat)
            grads = [flat.div_(self.world)]
        norm = torch.nn.utils.get_total_norm(grads)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
