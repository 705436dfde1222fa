"""DiLoCo across trainer islands, through torchft.

Each island is an ordinary `meshrl train` (its own generators, rollouts and trainer mesh). Every
trainer step is one inner step; every `sync_every` of them (per fragment, in turn, for Streaming
DiLoCo) an island averages its pseudo-gradient — global weights minus local ones — with the
other islands' and takes an outer SGD step from the global weights (by default lr 1 without
momentum: the islands' weights averaged). torchft does all of the outer loop's communication:
membership through its lighthouse (`meshrl lighthouse`), quorums per outer step, gloo/nccl all-reduces, and healing: an island that joins late or comes
back from `--resume` behind the others receives the current global weights and outer optimizer
state from a live island over HTTP. An island that dies drops out of the next quorum.

Within an island, rank r of every island syncs with rank r of the others; DDP ranks hold the
same parameters, so each sends the whole model (FSDP2 shards are refused by the config). Only
trained parameters are synced: with LoRA (`model.lora`) the adapters alone, as the frozen base
weights never move and their pseudo-gradients would be zeros.
"""

from __future__ import annotations

import socket
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshrl.configs.schema import DilocoConfig
from meshrl.trainer.checkpoint import own_copy

try:
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
    from torchft._torchft import LighthouseServer
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.local_sgd import DiLoCo
except ImportError as exc:  # the optional extra
    raise ImportError(f"trainer.diloco needs the islands extra: pip install 'meshrl[islands]' ({exc})") from None


def model_fragments(model: nn.Module, n: int) -> list[nn.Module]:
    """The model in `n` fragments of consecutive decoder layers (Streaming DiLoCo syncs one at a
    time). The modules owning parameters outside the layers (embeddings, final norm, LM head) go
    with the first fragment, so a tied head is one parameter of one fragment."""
    layers = list(model.model.layers)
    if n > len(layers):
        raise ValueError(f"trainer.diloco.fragments {n} > the model's {len(layers)} decoder layers")
    per, extra = divmod(len(layers), n)
    bounds = [i * per + min(i, extra) for i in range(n + 1)]
    layered = {id(p) for layer in layers for p in layer.parameters()}
    outside = [
        m for m in model.modules() if m is not model and any(id(p) not in layered for p in m.parameters(recurse=False))
    ]
    return [nn.ModuleList([*layers[bounds[i] : bounds[i + 1]], *(outside if i == 0 else [])]) for i in range(n)]


def trained_only(fragment: nn.Module) -> nn.Module:
    """The fragment itself when all its parameters train, else a list of the ones that do (the
    same Parameter objects): torchft syncs every parameter a fragment holds."""
    params = list(fragment.parameters())
    trained = [p for p in params if p.requires_grad]
    return fragment if len(trained) == len(params) else nn.ParameterList(trained)


@dataclass
class OuterStats:
    """What the last outer step did, for the step's metrics."""

    pseudo_grad_norm: float = 0.0
    payload_bytes: int = 0  # pseudo-gradient bytes handed to the all-reduce, all outer steps so far


class Islands:
    """This trainer rank's membership in the islands and its DiLoCo outer loop (entered at once:
    every later `inner.step()` counts as an inner step)."""

    def __init__(
        self, config: DilocoConfig, model: nn.Module, inner: torch.optim.Optimizer, rank: int, world: int
    ) -> None:
        self.config, self.model, self.inner = config, model, inner
        self.stats = OuterStats()
        self._crc = (-1, 0)  # (outer step, checksum of the global weights then)
        host = config.host or socket.gethostname()
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if rank == 0 else None
        port = [self._store.port if self._store is not None else 0]
        if world > 1:
            dist.broadcast_object_list(port, src=0)
        timeout = timedelta(seconds=config.timeout_s)
        device = next(model.parameters()).device
        self.manager = Manager(
            pg=ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._load_local,
            state_dict=self._local_state,
            min_replica_size=config.min_islands,
            use_async_quorum=False,
            replica_id=f"meshrl_{config.replica_id}",
            lighthouse_addr=config.lighthouse,
            store_addr=host,
            store_port=port[0],
            rank=rank,
            world_size=world,
            hostname=host,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=config.quorum_timeout_s),
            connect_timeout=timeout,
            checkpoint_transport=HTTPTransport(timeout=timeout, num_chunks=0),
        )
        self.fragments = [trained_only(f) for f in model_fragments(model, config.fragments)]
        self.outer = [
            torch.optim.SGD(
                f.parameters(), lr=config.outer_lr, momentum=config.outer_momentum, nesterov=config.outer_nesterov
            )
            for f in self.fragments
        ]
        for optimizer in self.outer:
            optimizer.register_step_pre_hook(self._record)
        self.diloco = DiLoCo(
            self.manager,
            self.fragments,
            inner,
            self.outer,
            sync_every=config.sync_every,
            fragment_sync_delay=config.fragment_sync_delay,
        ).__enter__()

    def _local_state(self) -> dict[str, Any]:
        """What a healing island receives besides the global weights: this island's local model
        and inner optimizer (copies: the transport serves them while training goes on); nothing
        at torchft's init sync, where the receiver keeps its own (`_load_local`)."""
        step = self.manager.current_step()
        if step == 0:
            return {"step": step}
        state = {"model": self.model.state_dict(), "inner": self.inner.state_dict(), "step": step}
        return own_copy(state, clone_tensors=True)

    def _load_local(self, state: dict[str, Any]) -> None:
        """An island behind the others takes a live island's local model and inner optimizer. At
        the first outer step (torchft's init sync: every island at step 0) an island keeps its
        own: it adopts the global weights only, so its first H steps still count (taking the
        other's local model would have averaged one island's work with itself)."""
        if state["step"] == 0:
            return
        self.model.load_state_dict(state["model"])
        self.inner.load_state_dict(state["inner"])

    def _record(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        """Before an outer step the parameters' grads hold the islands' averaged pseudo-gradient."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.stats.pseudo_grad_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        self.stats.payload_bytes += sum(g.numel() * g.element_size() for g in grads)

    def global_crc(self) -> int:
        """A checksum of the global weights (every island's is the same after a committed outer
        step), computed once per outer step."""
        step = self.manager.current_step()
        if self._crc[0] != step:
            crc = 0
            for fragment in self.diloco._fragments:
                for name in sorted(fragment.original_parameters):
                    crc = zlib.crc32(fragment.original_parameters[name].float().numpy().tobytes(), crc)
            self._crc = (step, crc)
        return self._crc[1]

    def metrics(self) -> dict[str, float]:
        return {
            "diloco/outer_steps": float(self.manager.current_step()),
            "diloco/islands": float(self.manager.num_participants()),
            "diloco/pseudo_grad_norm": self.stats.pseudo_grad_norm,
            "diloco/payload_bytes": float(self.stats.payload_bytes),
            "diloco/global_crc": float(self.global_crc()),
        }

    # -- checkpoints: the outer loop's whole state, so a resume continues it exactly

    def state(self) -> dict[str, Any]:
        """A copy (the checkpoint is written in the background while the outer loop goes on)."""
        state = {
            "manager": self.manager.state_dict(),
            "local_step": self.diloco._local_step,
            "global": [f.original_parameters for f in self.diloco._fragments],
            "outer": [optimizer.state_dict() for optimizer in self.outer],
            "payload_bytes": self.stats.payload_bytes,
        }
        return own_copy(state, clone_tensors=True)

    def load(self, state: dict[str, Any]) -> None:
        self.manager.load_state_dict(state["manager"])
        self.diloco._local_step = state["local_step"]
        for fragment, saved in zip(self.diloco._fragments, state["global"], strict=True):
            for name, value in saved.items():
                fragment.original_parameters[name].copy_(value)
        for optimizer, saved in zip(self.outer, state["outer"], strict=True):
            optimizer.load_state_dict(saved)
        self.stats.payload_bytes = state["payload_bytes"]
        self._crc = (-1, 0)

    def close(self) -> None:
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)


def serve_lighthouse(bind: str, min_islands: int, join_timeout_ms: int, heartbeat_timeout_ms: int) -> LighthouseServer:
    """torchft's lighthouse: the islands' membership and quorums (`meshrl lighthouse`)."""
    return LighthouseServer(
        bind=bind, min_replicas=min_islands, join_timeout_ms=join_timeout_ms, heartbeat_timeout_ms=heartbeat_timeout_ms
    )
