"""A mixture of experts' routing: recorded where a token is sampled, carried with it, forced where it is trained.

When the trainer routes a token to other experts than the sampler did (its own weights, another
step's, other numerics), the token's logprob comes from another sub-network, and the importance
ratio, the DPPO masks and the KL measure routing noise (routing replay, "R3"). So the sampler
records each position's top-k experts per MoE layer and the trainer's forward uses them.

A record is a `(positions, layers, k)` array of expert indices, vLLM's `routed_experts` layout: one
row per position the sampler ran a forward over (a conversation's every token but its last, which
no forward has seen), in uint8 (int16 past 254 experts): 1 byte a token per layer and expert chosen.
A value of `num_experts` or more marks a position without a record (a tool turn not yet prefilled,
padding): that token routes freely.

A router is a module with `top_k` and `num_experts` whose forward returns `(router_logits, weights,
expert_indices)` over the flattened tokens, as transformers' Qwen3-MoE router does.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """`model`'s routers, layer by layer (empty for a dense model)."""
    return [m for m in model.modules() if hasattr(m, "top_k") and hasattr(m, "num_experts")]


def has_experts(model_path: str | Path) -> bool:
    """Whether the model at `model_path` is a mixture of experts (from its config alone)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path).get_text_config()
    return bool(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0))


def routing_dtype(num_experts: int) -> np.dtype:
    """The smallest integer type that holds every expert index and a mark for "no record"."""
    return np.dtype(np.uint8) if num_experts < np.iinfo(np.uint8).max else np.dtype(np.int16)


def unrecorded(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A record of `shape` (positions first, then layers and k) where the sampler routed nothing."""
    return np.full(shape, np.iinfo(dtype).max, dtype=dtype)


def as_record(routing: object, positions: int, layers: int, k: int, num_experts: int, where: str) -> np.ndarray:
    """`routing` from outside this process (vLLM's `routed_experts`, a worker's claim) as a record of
    `positions` positions, checked: its shape, and every index an expert's (refused, naming `where`)."""
    array = np.asarray(routing)
    if array.shape != (positions, layers, k) or array.dtype.kind not in "iu":
        raise ValueError(
            f"{where}: routed experts of shape {array.shape} ({array.dtype}), expected integers of shape "
            f"{(positions, layers, k)}"
        )
    if array.size and (array.min() < 0 or array.max() >= num_experts):
        raise ValueError(f"{where}: routed experts outside 0..{num_experts - 1}")
    return array.astype(routing_dtype(num_experts))


def encode_record(routing: np.ndarray | None) -> str | None:
    """A record as text for a JSON frame (its bytes, little-endian, in base64); None stays None."""
    return (
        None
        if routing is None
        else base64.b64encode(routing.astype(routing.dtype.newbyteorder("<")).tobytes()).decode()
    )


def decode_record(text: str, layers: int, k: int, num_experts: int, most: int, where: str) -> np.ndarray:
    """A record `encode_record` wrote for a model of `layers` MoE layers, top-`k` of `num_experts`, of at
    most `most` positions; malformed text, a ragged length or an index that is no expert is refused."""
    dtype = routing_dtype(num_experts).newbyteorder("<")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise ValueError(f"{where}: routed experts are not base64") from None
    per = layers * k * dtype.itemsize
    if len(raw) % per or len(raw) // per > most:
        raise ValueError(f"{where}: {len(raw)} bytes of routed experts, not whole positions ({per} bytes) up to {most}")
    array = np.frombuffer(raw, dtype).reshape(-1, layers, k)
    return as_record(array, len(array), layers, k, num_experts, where)


def extended(routing: np.ndarray | None, positions: int) -> np.ndarray | None:
    """`routing` cut or grown to `positions` rows, the new ones unrecorded (the tokens after it: a tool
    turn, the last sampled token)."""
    if routing is None or len(routing) >= positions:
        return None if routing is None else routing[:positions]
    return np.concatenate([routing, unrecorded((positions - len(routing), *routing.shape[1:]), routing.dtype)])


class RoutingRecorder:
    """Keeps each router's expert choice of the last forward, for an engine that samples with hooks in
    the model (the HF engine): `take` reads them back as one `(rows, columns, layers, k)` array."""

    def __init__(self, routers: list[nn.Module]) -> None:
        self.num_experts, self.k = routers[0].num_experts, routers[0].top_k
        self.chosen: list[Tensor | None] = [None] * len(routers)
        for layer, router in enumerate(routers):
            router.register_forward_hook(self._hook(layer))

    @classmethod
    def attach(cls, model: nn.Module) -> RoutingRecorder | None:
        routers = moe_routers(model)
        return cls(routers) if routers else None

    def _hook(self, layer: int):
        def keep(module: nn.Module, inputs: object, output: tuple[Tensor, ...]) -> None:
            self.chosen[layer] = output[2]

        return keep

    def take(self, rows: int, columns: int) -> np.ndarray:
        """The last forward's routing over its `rows` × `columns` tokens, read back in one transfer."""
        chosen = torch.stack(self.chosen, dim=1).view(rows, columns, len(self.chosen), self.k)
        self.chosen = [None] * len(self.chosen)
        return chosen.to(torch.int16).cpu().numpy().astype(routing_dtype(self.num_experts))


_state = threading.local()


@contextmanager
def routed(routing: Tensor | None) -> Iterator[None]:
    """The forwards inside run over tokens whose recorded routing is `routing` ((rows, columns, layers,
    k), the forward's input layout; None: no record): the routers of a model with `force_routing` take
    it, the router statistics compare it with their own choice (`trainer.router`)."""
    with routed_flat(None if routing is None else routing.flatten(0, 1)):
        yield


@contextmanager
def routed_flat(routing: Tensor | None) -> Iterator[None]:
    """`routed` with the record already flat (`current_routing`'s): a checkpointed layer's recompute
    in backward runs under the routing its forward ran under (`trainer.activations`)."""
    previous = current_routing()
    _state.routing = routing
    try:
        yield
    finally:
        _state.routing = previous


def current_routing() -> Tensor | None:
    """The flat `(tokens, layers, k)` record of the running forward, if it has one."""
    return getattr(_state, "routing", None)


def forced_output(
    router: nn.Module, layer: int, output: tuple[Tensor, Tensor, Tensor], recorded: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The router's output with each recorded token sent to its recorded experts, weighted by the router's
    own probabilities of those experts (renormalised over them where the router renormalises its top-k),
    so the router is still trained; unrecorded tokens keep the router's own choice."""
    logits, weights, chosen = output
    mine = recorded[:, layer].to(device=chosen.device, dtype=torch.long)
    known = (mine < router.num_experts).all(-1, keepdim=True)
    experts = torch.where(known, mine, chosen)
    if getattr(router, "norm_topk_prob", False):  # p_e / Σ p over the experts: a softmax over their logits,
        probs = logits.float().gather(-1, experts).softmax(-1)  # finite when the router gives them ~0
    else:
        probs = logits.float().softmax(-1).gather(-1, experts)
    return logits, torch.where(known, probs.to(weights.dtype), weights), experts


def force_routing(model: nn.Module) -> None:
    """Hooks on `model`'s routers that take the recorded routing inside a `routed` context. Put on the
    trainer's policy and its reference alike, before any hook that reads the routing (the router
    statistics count what the forward used). The hook runs eagerly under `torch.compile` (a graph break
    per router)."""
    routers = moe_routers(model)
    for layer, router in enumerate(routers):

        def force(module: nn.Module, inputs: object, output: tuple[Tensor, ...], layer: int = layer):
            recorded = current_routing()
            return None if recorded is None else forced_output(module, layer, output, recorded)

        router.register_forward_hook(torch.compiler.disable(force))
