"""Router statistics of a mixture-of-experts policy, per step: how evenly its experts are loaded.

A forward hook on each router (a module with `top_k` and `num_experts` whose forward returns
`(router_logits, scores, expert_indices)`, as transformers' Qwen3-MoE router does) counts the
tokens each expert is given and the routers' entropy, over the policy's own training tokens
alone: only inside `training()` (an RL pass that trains, not a reference's, a teacher's or
FSDP2's zero-weight spare pass) and only at the pass's real tokens (not padding). transformers'
MoE layers dispatch every token to its top-k experts (no capacity limit), so none is dropped.
The figures come from the counts summed over every rank: a ratio of sums, not a mean of the
ranks' ratios (two ranks on disjoint experts are each all on half of them, together even).
The same hooks keep a training forward's router logits (with their graph) for the load-balancing
auxiliary loss (`trainer.router_aux_loss_coef`), which is over the real tokens too, and, where the
batch carries the sampler's routing (`models.routing`), count the tokens whose own top-k differs from
the recorded experts: the routing drift that replay removes, per layer, before replay.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshrl.models.routing import current_routing, moe_routers
from meshrl.trainer.activations import recomputing


def real_tokens(batch: dict[str, Any]) -> torch.Tensor:
    """(rows, columns) bool: a batch's own tokens, its padding out. Padded rows carry an
    `attention_mask`; packed rows a `sample_index`, −1 on padding (rollouts/packing.py)."""
    if "attention_mask" in batch:
        return batch["attention_mask"].bool()
    if "sample_index" in batch:
        return batch["sample_index"] >= 0
    return torch.ones_like(batch["input_ids"], dtype=torch.bool)


def router_figures(counts: torch.Tensor, entropy: float, tokens: float, drift: torch.Tensor) -> dict[str, float]:
    """The step's figures from its (layers, experts) assignment counts, its first layer's summed
    per-token entropy over `tokens`, and its (layers, 2) drifted and recorded token counts: an
    expert's load is its count over its layer's mean count (1: even, num_experts: every assignment
    on it), the max and min over every layer's experts; the drift is per layer and over all of them,
    with the share of tokens that had a record. Empty when no token was counted."""
    if not tokens:
        return {}
    load = counts / counts.mean(-1, keepdim=True)
    figures = {
        "moe/expert_load_max": float(load.max()),
        "moe/expert_load_min": float(load.min()),
        "moe/router_entropy": entropy / tokens,
    }
    drifted, recorded = drift[:, 0], drift[:, 1]
    if recorded.sum():
        figures["moe/recorded_tokens"] = float(recorded[0]) / tokens
        figures["moe/routing_drift"] = float(drifted.sum() / recorded.sum())
        figures.update({f"moe/routing_drift/layer_{i}": float(d / r) for i, (d, r) in enumerate(drift.tolist()) if r})
    return figures


class RouterStats:
    """Counts kept from the routers' training forwards since the last `take()`."""

    def __init__(self, routers: list[nn.Module]) -> None:
        self.experts, self.top_k = routers[0].num_experts, routers[0].top_k
        self.real: torch.Tensor | None = None  # inside `training()`: the pass's real tokens, flat
        self.count = self.keep = False  # inside `training()`
        self.counts = torch.zeros(len(routers), self.experts, dtype=torch.float64)
        self.drift = torch.zeros(len(routers), 2, dtype=torch.float64)  # tokens drifted, tokens recorded
        self.entropy, self.tokens = 0.0, 0
        self.logits: list[torch.Tensor] = []  # a forward's router logits that carry a graph, layer by layer
        for layer, router in enumerate(routers):
            router.register_forward_hook(self._hook(layer))

    @classmethod
    def attach(cls, model: nn.Module) -> RouterStats | None:
        """Hooks on `model`'s routers; None for a model without experts."""
        routers = moe_routers(model)
        return cls(routers) if routers else None

    @contextmanager
    def training(self, real: torch.Tensor, count: bool, keep: bool) -> Iterator[None]:
        """The forwards inside are a pass over a batch whose real tokens are `real` (its (rows,
        columns) mask): with `count` their routing counts toward the step's figures, with `keep`
        their router logits (those with a graph) are kept for `balance_loss`."""
        self.real, self.count, self.keep, self.logits = real.flatten(), count, keep, []
        try:
            yield
        finally:
            self.count = self.keep = False

    def _hook(self, layer: int):
        def watch(module: nn.Module, inputs: object, output: tuple[torch.Tensor, ...]) -> None:
            if recomputing():  # a checkpointed layer's replay in backward: its forward was seen
                return
            logits, _, chosen = output
            if self.keep and logits.requires_grad:
                self.logits.append(logits)
            if self.count:
                with torch.no_grad():
                    real = self.real.to(chosen.device)
                    self.counts[layer] += torch.bincount(chosen[real].flatten().cpu(), minlength=self.experts).double()
                    if layer == 0:
                        probs = logits[real].detach().float().softmax(-1)
                        self.entropy += float(-(probs * probs.clamp_min(1e-12).log()).sum())
                        self.tokens += int(real.sum())
                    if (recorded := current_routing()) is not None:
                        self.drift[layer] += self._drift(logits, recorded[:, layer].to(chosen.device), real)

        return watch

    def _drift(self, logits: torch.Tensor, recorded: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """(tokens whose own top-k is not their recorded experts, tokens with a record) at the real
        tokens: the router's own choice from its logits, whatever the forward was made to use."""
        known = real & (recorded < self.experts).all(-1)
        own = logits.topk(self.top_k, dim=-1).indices.sort(-1).values
        differs = (own != recorded.long().sort(-1).values).any(-1) & known
        return torch.tensor([float(differs.sum()), float(known.sum())], dtype=torch.float64)

    def balance_loss(self) -> torch.Tensor | None:
        """The load-balancing loss over the router logits `training()` kept, at its real tokens
        (transformers' `load_balancing_loss_func` with the padding masked: num_experts · Σ_e f_e ·
        P_e, top-k when even), which then go: None when none were kept."""
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        logits, self.logits = self.logits, []
        if not logits:
            return None
        return load_balancing_loss_func(tuple(logits), self.experts, self.top_k, self.real.to(logits[0].device))

    def take(self, device: torch.device) -> dict[str, float]:
        """The figures of the counts since the last call summed over every rank (a collective
        under torch.distributed: every rank calls it once a step; `device` is where the backend
        reduces), and the counts start again."""
        scalars = torch.tensor([self.entropy, self.tokens], dtype=torch.float64)
        totals = torch.cat([self.counts.flatten(), self.drift.flatten(), scalars]).to(device)
        if dist.is_initialized():
            dist.all_reduce(totals)
        counts, drift, (entropy, tokens) = totals.cpu().split([self.counts.numel(), self.drift.numel(), 2])
        self.counts.zero_()
        self.drift.zero_()
        self.entropy, self.tokens = 0.0, 0
        return router_figures(counts.view_as(self.counts), float(entropy), float(tokens), drift.view_as(self.drift))
