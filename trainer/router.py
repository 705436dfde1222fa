"""Router statistics of a mixture-of-experts policy, per step: how evenly its experts are loaded.

A forward hook on each router (a module with `top_k` and `num_experts` whose forward returns
`(router_logits, scores, expert_indices)`, as transformers' Qwen3-MoE router does) counts the
tokens each expert is given over the step's forward passes, and the routers' entropy. transformers'
MoE layers dispatch every token to its top-k experts (no capacity limit), so none is dropped.
The same hooks keep a training forward's router logits (with their graph) for the load-balancing
auxiliary loss (`trainer.router_aux_loss_coef`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from meshrl.trainer.activations import recomputing


class RouterStats:
    """Counts kept from the routers' forwards since the last `take()`."""

    def __init__(self, routers: list[nn.Module]) -> None:
        self.experts, self.top_k = routers[0].num_experts, routers[0].top_k
        self.keep = False  # inside `keeping()`
        self.counts = torch.zeros(len(routers), self.experts, dtype=torch.float64)
        self.entropy, self.tokens = 0.0, 0
        self.logits: list[torch.Tensor] = []  # a forward's router logits that carry a graph, layer by layer
        for layer, router in enumerate(routers):
            router.register_forward_hook(self._hook(layer))

    @classmethod
    def attach(cls, model: nn.Module) -> RouterStats | None:
        """Hooks on `model`'s routers; None for a model without experts."""
        routers = [m for m in model.modules() if hasattr(m, "top_k") and hasattr(m, "num_experts")]
        return cls(routers) if routers else None

    @contextmanager
    def keeping(self) -> Iterator[None]:
        """Keep the router logits of the forwards run inside (those with a graph) for `balance_loss`."""
        self.keep, self.logits = True, []
        try:
            yield
        finally:
            self.keep = False

    def _hook(self, layer: int):
        def count(module: nn.Module, inputs: object, output: tuple[torch.Tensor, ...]) -> None:
            if recomputing():  # a checkpointed layer's replay in backward: its forward was counted
                return
            logits, _, chosen = output
            if self.keep and logits.requires_grad:
                self.logits.append(logits)
            with torch.no_grad():
                self.counts[layer] += torch.bincount(chosen.flatten().cpu(), minlength=self.experts).double()
                if layer == 0:
                    probs = logits.detach().float().softmax(-1)
                    self.entropy += float(-(probs * probs.clamp_min(1e-12).log()).sum())
                    self.tokens += logits.shape[0]

        return count

    def balance_loss(self) -> torch.Tensor | None:
        """The load-balancing loss over the router logits `keeping()` kept (transformers'
        `load_balancing_loss_func`: num_experts · Σ_e f_e · P_e, top-k when even), which then
        go: None when none were kept."""
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        logits, self.logits = self.logits, []
        return load_balancing_loss_func(tuple(logits), self.experts, self.top_k) if logits else None

    def take(self) -> list[tuple[str, float, float]]:
        """(metric, value, tokens) since the last call, and the counts start again. The load of an
        expert is its share of a layer's assignments × num_experts: 1 is even, num_experts all on it."""
        if not self.tokens:
            return []
        load = self.counts / self.counts.sum(-1, keepdim=True).clamp_min(1) * self.experts
        taken = [("moe/expert_load_max", float(load.max()), self.tokens),
                 ("moe/expert_load_min", float(load.min()), self.tokens),
                 ("moe/router_entropy", self.entropy / self.tokens, self.tokens)]  # fmt: skip
        self.counts.zero_()
        self.entropy, self.tokens = 0.0, 0
        return taken
