"""Router statistics of a mixture-of-experts policy, per step: how evenly its experts are loaded.

A forward hook on each router (a module with `top_k` and `num_experts` whose forward returns
`(router_logits, scores, expert_indices)`, as transformers' Qwen3-MoE router does) counts the
tokens each expert is given over the step's forward passes, and the routers' entropy. transformers'
MoE layers dispatch every token to its top-k experts (no capacity limit), so none is dropped.
"""

from __future__ import annotations

import torch
from torch import nn


class RouterStats:
    """Counts kept from the routers' forwards since the last `take()`."""

    def __init__(self, routers: list[nn.Module]) -> None:
        self.experts = routers[0].num_experts
        self.counts = torch.zeros(len(routers), self.experts, dtype=torch.float64)
        self.entropy, self.tokens = 0.0, 0
        for layer, router in enumerate(routers):
            router.register_forward_hook(self._hook(layer))

    @classmethod
    def attach(cls, model: nn.Module) -> RouterStats | None:
        """Hooks on `model`'s routers; None for a model without experts."""
        routers = [m for m in model.modules() if hasattr(m, "top_k") and hasattr(m, "num_experts")]
        return cls(routers) if routers else None

    def _hook(self, layer: int):
        def count(module: nn.Module, inputs: object, output: tuple[torch.Tensor, ...]) -> None:
            logits, _, chosen = output
            with torch.no_grad():
                self.counts[layer] += torch.bincount(chosen.flatten().cpu(), minlength=self.experts).double()
                if layer == 0:
                    probs = logits.detach().float().softmax(-1)
                    self.entropy += float(-(probs * probs.clamp_min(1e-12).log()).sum())
                    self.tokens += logits.shape[0]

        return count

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
