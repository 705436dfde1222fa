"""The trainer core: one data-parallel rank's model, optimizer and step.

`TrainerCore` holds the logic (testable in one process, or across processes with
torch.distributed); `meshrl.actors.trainer.TrainerActor` puts one core on each proc of the
trainer mesh (gloo on CPU, nccl on GPU). `trainer.parallelism` picks how ranks share the work:

- `ddp`: every rank holds the whole model; the gradients are all-reduced in buckets of at most
  `trainer.grad_bucket_mb` after the micro-batches' backward passes (a DDP wrapper's hooks would
  not see the composer's direct reads of the trunk and LM head).
- `fsdp2`: `fully_shard` on each decoder layer and on a `ModelCall` root around the model,
  so parameters, gradients and optimizer state are sharded across the ranks.

Precision: weights and AdamW state are float32 master copies; `model.dtype` is the compute
dtype (autocast on one rank or DDP, FSDP2's `MixedPrecisionPolicy` with float32 gradient
reduction). The frozen DPO reference is float32 like the master weights, computes under the
same autocast, is sharded like the policy, and is checkpointed and reloaded in float32 (a resume
leaves it exactly as it was).
"""

from __future__ import annotations

import copy
import math
import random
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoModelForCausalLM

from meshrl.configs.schema import RefKlLoss, RunConfig
from meshrl.loss_adapters.compose import (
    PEAK,
    REPLAY_KEYS,
    compose_loss,
    reference_logprobs,
    reference_sums,
    rl_loss_fn,
)
from meshrl.loss_adapters.logprobs import sequence_token_logprobs
from meshrl.models.chat_templates import renderer_template
from meshrl.models.routing import force_routing, moe_routers
from meshrl.trainer.activations import enable_checkpointing
from meshrl.trainer.attention import attention_kernel, use_document_attention
from meshrl.trainer.aux_batches import SFT, aux_micro_batches
from meshrl.trainer.channel_grads import ChannelGrads
from meshrl.trainer.checkpoint import CheckpointWriter, TrainerState, own_copy, write_checkpoint
from meshrl.trainer.router import RouterStats, real_tokens

if TYPE_CHECKING:
    from meshrl.trainer.islands import Islands

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def lr_lambda(config: RunConfig):
    """Linear warm-up, then constant, cosine or linear decay to 0 at max_steps."""
    warmup, total, kind = config.trainer.warmup_steps, config.max_steps, config.trainer.lr_schedule

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress

    return factor


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class ModelCall(nn.Module):
    """Runs `fn(model, *args)` as its forward.

    The loss functions read the trunk and the LM head weight directly rather than calling
    the model. Under FSDP2 this module is the root unit: its forward hooks gather the
    parameters no decoder layer owns (embeddings, final norm, head) around those reads and
    reduce-scatter their gradients after backward. `fn` returns a tuple so those hooks
    find the output tensors.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn: Any, *args: Any) -> Any:
        return fn(self.model, *args)


@dataclass
class FrozenAdapters:
    """The LoRA reference: the policy's own call with its adapters' values swapped for a frozen copy
    of the adapters RL started from (the base model, B = 0, until a warm start trained them), so it
    shares the model and, under FSDP2, the root unit that gathers its parameters. The swap is made
    and undone around the reference's forward, which runs before the policy's (nothing autograd
    saved sees it). The forward runs in eval mode (adapter dropout off: a reference scores the same
    rows the same way every time), and under FSDP2 the root is resharded after it: a root unit stays
    gathered after a forward, and the policy's forward that follows would reuse its gathered
    parameters, which hold the frozen adapters of root-level modules (an adapted embedding or head)."""

    call: ModelCall
    names: list[str]
    live: list[nn.Parameter]
    frozen: list[torch.Tensor]

    @classmethod
    def of(cls, call: ModelCall) -> FrozenAdapters:
        named = [(name, p) for name, p in call.model.named_parameters() if ".lora_" in name]
        return cls(call, [n for n, _ in named], [p for _, p in named], [p.detach().clone() for _, p in named])

    def __call__(self, fn: Any, *args: Any) -> Any:
        training = self.call.training
        reshard(self.call)  # gathered values would not see the swap
        with torch.no_grad():
            kept = [p.detach().clone() for p in self.live]
            for p, frozen in zip(self.live, self.frozen, strict=True):
                p.copy_(frozen)
        torch.clear_autocast_cache()  # autocast keeps one cast per weight for the region: not the live values'
        self.call.train(False)
        try:
            return self.call(fn, *args)
        finally:
            self.call.train(training)
            reshard(self.call)
            with torch.no_grad():
                for p, value in zip(self.live, kept, strict=True):
                    p.copy_(value)
            torch.clear_autocast_cache()  # nor the frozen values' for the policy's forward

    def take(self) -> None:
        """The adapters as they are now become the reference (RL starts here)."""
        with torch.no_grad():
            for p, frozen in zip(self.live, self.frozen, strict=True):
                frozen.copy_(p)

    def state(self) -> dict[str, torch.Tensor]:
        """The frozen adapters, whole and on CPU (every rank calls: under FSDP2 each is gathered)."""
        return {name: _whole(t) for name, t in zip(self.names, self.frozen, strict=True)}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """A checkpoint's frozen adapters, each rank keeping its own shard."""
        with torch.no_grad():
            for name, frozen in zip(self.names, self.frozen, strict=True):
                whole = state[name].to(frozen.device, frozen.dtype)
                frozen.copy_(distribute_tensor(whole, frozen.device_mesh, frozen.placements)
                             if isinstance(frozen, DTensor) else whole)  # fmt: skip


def reshard(call: nn.Module) -> None:
    """Free an FSDP2 unit's gathered parameters (a root unit keeps them after a forward, for the
    backward it expects), so its next forward gathers the shards as they are then."""
    if isinstance(call, FSDPModule):
        call.reshard()


def _whole(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()


def shard_fsdp2(call: ModelCall, compute_dtype: torch.dtype) -> None:
    """`fully_shard` every decoder layer, then the root (over the device's default mesh).

    Parameters are gathered in `compute_dtype`, gradients reduced in float32. Forward inputs
    are not cast: the batch carries float32 logprobs and advantages that must stay float32.
    """
    layers = getattr(call.model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError("trainer.parallelism = 'fsdp2' needs a model whose decoder has `.layers`")
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(call, mp_policy=policy)


def grad_buckets(grads: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive gradients grouped so one bucket holds at most `cap_bytes` (a larger single
    gradient is a bucket of its own): the all-reduce copies one bucket at a time."""
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if buckets[-1] and size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += nbytes
    return [b for b in buckets if b]


@dataclass(frozen=True)
class UnitPass:
    """One forward/backward pass of a channel's units: its micro-batch, the units it counts (0 on
    FSDP2's spare passes) and what its loss is scaled by before backward."""

    batch: dict[str, Any]
    count: int
    scale: float


class Weighted:
    """A step's metrics, each a mean over some items (tokens, pairs, ranks) and their count,
    reduced over every rank: a token fraction is over all the step's tokens, not a mean of
    per-sample or per-rank means. A name ending in `PEAK` is a largest value: the largest of all."""

    def __init__(self) -> None:
        self.parts: dict[str, list[float]] = {}  # name -> [Σ mean × weight (PEAK: the largest), Σ weight]

    def add(self, name: str, mean: float, weight: float) -> None:
        """A mean over `weight` items; over none (a NaN mean, say, of the masked tokens where none
        was) it adds the name alone."""
        self._merge(name, mean if name.endswith(PEAK) else mean * weight if weight else 0.0, weight)

    def _merge(self, name: str, value: float, weight: float) -> None:
        part = self.parts.setdefault(name, [-math.inf if name.endswith(PEAK) else 0.0, 0.0])
        part[0] = max(part[0], value) if name.endswith(PEAK) else part[0] + value
        part[1] += weight

    def reduced(self, world: int) -> dict[str, float]:
        """Σ mean × weight / Σ weight over the ranks, NaN where no rank had an item (a collective:
        every rank calls it once a step)."""
        gathered = [self.parts]
        if world > 1:
            gathered = [{} for _ in range(world)]
            dist.all_gather_object(gathered, self.parts)
        total = Weighted()
        for parts in gathered:
            for name, (value, weight) in parts.items():
                total._merge(name, value, weight)
        return {
            name: value if name.endswith(PEAK) else value / weight if weight else math.nan
            for name, (value, weight) in total.parts.items()
        }


SFT_KEYS = ("input_ids", "attention_mask", "position_ids", "loss_mask")  # what a warm-start step trains on


class TrainerCore:
    """One rank's model, frozen DPO reference, AdamW, LR schedule and NaN/Inf-guarded step."""

    def __init__(self, config: RunConfig, model_path: str, device: str = "cpu") -> None:
        self.config, self.model_path = config, model_path
        self.chat_template = renderer_template(config.model.renderer)  # what checkpoints save with the tokenizer
        self.device = torch.device(device)
        torch.manual_seed(config.seed)
        self.compute_dtype = DTYPES[config.model.dtype]
        # float32 master weights whatever the checkpoint's dtype: bf16 weights would round away
        # most updates at RL learning rates (1e-6 moves almost no bf16 weight).
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        self.model.train()
        # A mixture of experts trains on the experts its sampler chose (models/routing.py); the hooks go
        # first, so the router statistics count what the forward used, and the reference copies them.
        self.routing_replay = self._replays_routing(self.model)
        # Packed rows: O(tokens) memory, through the kernel trainer.attention names (trainer/attention.py).
        self.attention = attention_kernel(config.trainer.attention, self.device)
        use_document_attention(self.model, self.attention)
        # Before LoRA and FSDP2 wrap the layers: the flag lives on each decoder layer (trainer/activations.py).
        self.checkpointed_layers = enable_checkpointing(self.model, config.trainer, self.device)
        # LoRA (`model.lora`): adapters injected into `self.model` in place; only they train, and the
        # reference is the same model with a frozen copy of the adapters (no second copy of the model).
        self.adapters = None
        if config.model.lora is not None:
            from meshrl.trainer.lora import adapted_weights, add_lora  # peft: the [lora] extra

            self.adapters = add_lora(self.model, config.model.lora)
            self.lora_plan = adapted_weights(self.model)  # how the merged weights are built
        if config.trainer.compile:  # each layer its own graph, inside its checkpointing (its flag wraps __call__)
            for layer in self.model.get_decoder().layers:
                layer.compile()
        loss = config.loss
        # One frozen reference: the DPO channel's, and ref_kl's (its `reference_path`, else the policy RL
        # starts from). It keeps float32 and computes as the policy does (autocast on one rank or DDP,
        # FSDP2's compute-dtype gather), so at the start its logprobs are the policy's exactly: a bf16
        # copy rounds the norms' weights and runs them in bf16 (the DPO margin was not 0).
        self.ref_kl = isinstance(loss, RefKlLoss)
        self.fixed_ref = self.ref_kl and loss.reference_path is not None
        needs_ref = (loss.replay.weight > 0 and loss.replay.variant == "dpo") or self.ref_kl
        if self.fixed_ref:
            self.ref_model = AutoModelForCausalLM.from_pretrained(loss.reference_path, dtype=torch.float32)
            if self.routing_replay:
                force_routing(self.ref_model)
            use_document_attention(self.ref_model, self.attention)
            self.ref_model.to(self.device).eval().requires_grad_(False)
        elif needs_ref and self.adapters is None:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        else:
            self.ref_model = None
        self.rl_fn = rl_loss_fn(loss)
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.fsdp = config.trainer.parallelism == "fsdp2" and self.world > 1
        self.call = ModelCall(self.model)
        self.ref_call: ModelCall | FrozenAdapters | None = (
            ModelCall(self.ref_model) if self.ref_model is not None else None
        )
        if self.fsdp:
            shard_fsdp2(self.call, self.compute_dtype)
            if isinstance(self.ref_call, ModelCall):
                shard_fsdp2(self.ref_call, self.compute_dtype)
        if needs_ref and not self.fixed_ref and self.adapters is not None:  # after sharding: copies of the shards
            self.ref_call = FrozenAdapters.of(self.call)
        # After sharding: FSDP2 replaces the parameters with sharded ones, which the optimizer must hold.
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.channel_grads = (
            ChannelGrads(self.trainable, self.world, self.fsdp) if config.metrics.channel_grad_norms else None
        )
        self.router = RouterStats.attach(self.model)  # a mixture of experts: its expert load per step
        if config.trainer.router_aux_loss_coef and self.router is None:
            raise ValueError("trainer.router_aux_loss_coef is set, but the model has no experts (no MoE routers)")
        t = config.trainer
        self.optimizer = torch.optim.AdamW(self.trainable, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config))
        self.skipped_steps = 0
        self.writer = CheckpointWriter()
        # DiLoCo, joined at the first RL step (warm-start steps are not inner steps)
        self.islands: Islands | None = None
        self._islands_state: dict[str, Any] | None = None  # a resumed checkpoint's, until it is applied

    def _replays_routing(self, model: nn.Module) -> bool:
        """Whether the trainer replays the sampler's routing (`trainer.routing_replay`), its hooks on `model`."""
        replay, moe = self.config.trainer.routing_replay, bool(moe_routers(model))
        if replay and not moe:
            raise ValueError("trainer.routing_replay = true, but the model has no experts (no MoE routers)")
        if not moe or replay is False:
            return False
        force_routing(model)
        return True

    # ------------------------------------------------------------------ steps

    def _autocast(self) -> AbstractContextManager:
        """bf16/fp16 compute over the float32 master weights on one rank or DDP (FSDP2 gathers
        the parameters in the compute dtype itself)."""
        if self.compute_dtype == torch.float32 or self.fsdp:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _all_reduce_grads(self) -> None:
        if self.world == 1 or self.fsdp:  # FSDP2 reduce-scatters in its post-backward hooks
            return
        for p in self.trainable:
            if p.grad is None:  # a rank with no data this step still joins the all-reduce
                p.grad = torch.zeros_like(p)
        cap = int(self.config.trainer.grad_bucket_mb * 2**20)
        for bucket in grad_buckets([p.grad for p in self.trainable], cap):
            flat = torch.cat([g.flatten() for g in bucket])
            dist.all_reduce(flat)
            flat /= self.world
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def _apply(self, schedule: bool = True) -> dict[str, float]:
        """Average grads across ranks, clip, and step — unless any grad is NaN/Inf (then skip, count).

        Logs the learning rate this step used (the warm start's in `sft_step`), read before the
        scheduler moves on to the next step's."""
        lr = self.optimizer.param_groups[0]["lr"]
        self._all_reduce_grads()
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.config.trainer.max_grad_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        finite = bool(torch.isfinite(norm))
        if finite:
            self.optimizer.step()
        else:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        if schedule:
            self.scheduler.step()
        return {
            "grad_norm": float(norm),
            "skipped_steps": float(self.skipped_steps),
            "lr": lr,
        }

    def _with_reference(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch with what the reference scores, through its own `ModelCall` (so a sharded
        reference gathers its weights as the policy does): the summed logprobs of its DPO pairs, and
        for ref_kl the per-token `ref_logprobs` of its RL rows (under the sampler's temperature, as
        the policy's are scored)."""
        if self.ref_call is None:
            return batch
        chunk_size = self.config.model.logprob_chunk_size
        if self.ref_kl and "input_ids" in batch and "ref_logprobs" not in batch:
            temperature = self.config.generator.temperature
            (ref,) = self.ref_call(
                lambda model, batch: (reference_logprobs(model, batch, chunk_size, temperature),), batch
            )
            batch = {**batch, **ref}
        if all(k in batch for k in REPLAY_KEYS) and "dpo_ref_chosen_logprob" not in batch:
            (sums,) = self.ref_call(lambda model, batch: (reference_sums(model, batch, chunk_size),), batch)
            batch = {**batch, **sums}
        if isinstance(self.ref_call, ModelCall):
            reshard(self.ref_call)  # a separate reference's root would hold its embedding and head whole
        return batch

    def _loss(
        self, batch: dict[str, Any], rl_token_count: float | None = None, counted: bool = False
    ) -> tuple[torch.Tensor, dict[str, Any], dict[str, torch.Tensor]]:
        """The composed loss of one batch, through `ModelCall` (so FSDP2's root hooks run), its
        metrics and the token count of each RL metric. `counted`: an RL pass that trains, whose
        routing (a mixture of experts) the step's router figures count."""

        def fn(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any], dict[str, Any]]:
            out = compose_loss(
                model, batch, self.config.loss, rl_fn=self.rl_fn, rl_token_count=rl_token_count,
                chunk_size=self.config.model.logprob_chunk_size, temperature=self.config.generator.temperature,
            )  # fmt: skip
            return out.loss, out.metrics, out.counts

        balanced = bool(self.router is not None and self.config.trainer.router_aux_loss_coef > 0 and rl_token_count)
        watched = self.router is not None and (counted or balanced)
        with self._autocast():
            batch = self._with_reference(_to(batch, self.device))  # the reference's routing is not the policy's
            with self.router.training(real_tokens(batch), counted, balanced) if watched else nullcontext():
                loss, metrics, counts = self.call(fn, batch)
        balance = self.router.balance_loss() if balanced else None
        if balance is not None:  # an RL pass of a mixture of experts: weighted by its share of the tokens
            share = float(batch["loss_mask"].sum()) / rl_token_count
            loss = loss + self.config.trainer.router_aux_loss_coef * balance * share
            metrics["moe/aux_loss"] = float(balance.detach())
        return loss, metrics, counts

    def _passes(self, shards: list[list[dict[str, Any]]], rank: int) -> list[tuple[dict[str, Any], float]]:
        """Rank `rank`'s batches at weight 1. Under FSDP2 every rank must run as many
        forward/backward passes as the others (the layers' all-gathers are collectives), so a
        rank short of batches runs another rank's at weight 0."""
        passes = [(batch, 1.0) for batch in shards[rank]]
        if self.fsdp:
            spare = next((batch for shard in shards for batch in shard), None)
            passes += [(spare, 0.0)] * (max(len(shard) for shard in shards) - len(passes))
        return passes

    def _unit_passes(self, channel: str, parts: list[dict[str, Any]], rank: int) -> tuple[list[UnitPass], int]:
        """Rank `rank`'s passes over a channel's units (replay pairs, SDPO sites, warm-start rows),
        given every rank's batch of that channel in `parts`: micro-batches of whole units within
        `trainer.micro_batch_tokens`, and the units' count over all ranks. A pass's loss is the mean
        over its own units; scaled by its share of that count, the ranks' averaged gradients are the
        mean over all of them, as one rank holding every unit in one batch would compute."""
        budget = self.config.trainer.micro_batch_tokens
        chunks = [aux_micro_batches(channel, part, budget) if part else [] for part in parts]
        total = sum(chunk.count for rank_chunks in chunks for chunk in rank_chunks)
        counts = [chunk.count for chunk in chunks[rank]]
        passes = self._passes([[chunk.batch for chunk in rank_chunks] for rank_chunks in chunks], rank)
        units = []
        for i, (batch, weight) in enumerate(passes):
            count = counts[i] if weight else 0  # FSDP2's spare passes run at weight 0
            units.append(UnitPass(batch, count, self.world * count / max(1, total)))
        return units, total

    def train_step(
        self,
        rl_shards: list[list[dict[str, Any]]],
        aux_shards: list[dict[str, Any] | None],
        rl_tokens: int,
        rank: int = 0,
    ) -> dict[str, float]:
        """One optimizer step over rank `rank`'s RL micro-batches and its replay/SDPO batch.

        Every rank gets the whole step's shards (one list of micro-batches, one auxiliary
        batch or None per rank); each channel of an auxiliary batch runs in micro-batches of
        whole pairs or sites within `trainer.micro_batch_tokens` (`aux_micro_batches`).
        `rl_tokens` is the step's loss normaliser over all ranks (its loss-mask token count;
        `trainer.zero_advantage_tokens = "count"` adds the tied rollouts'): each RL micro-batch
        is normalised by rl_tokens / world so the cross-rank mean of gradients is
        Σ sample losses / rl_tokens, PRIME-RL's normalisation.
        """
        if self.config.trainer.diloco.replica_id is not None and self.islands is None:
            self._join_islands()
        weighted, rank_loss, sdpo_tokens, channel_norms = Weighted(), 0.0, 0.0, {}
        with self._channel("rl", any(rl_shards), channel_norms):
            for batch, weight in self._passes(rl_shards, rank):
                loss, out, counts = self._loss(batch, max(1, rl_tokens) / self.world, counted=bool(weight))
                (loss * weight).backward()
                if weight:
                    rank_loss += float(out.pop("loss/rl"))  # the rank's loss: its micro-batches' parts summed
                    tokens = float(batch["loss_mask"].sum())  # the RL metrics are token means: weigh by their tokens
                    for name, value in out.items():
                        if name != "loss/total":
                            weighted.add(name, float(value), float(counts.get(name, tokens)))
        if any(rl_shards):
            weighted.add("loss/rl", rank_loss, 1.0)  # the step's loss: the ranks' mean (DDP averages their gradients)
        for channel in self._aux_channels():
            parts = [{k: v for k, v in (a or {}).items() if k.startswith(channel)} for a in aux_shards]
            passes, total = self._unit_passes(channel, parts, rank)
            with self._channel(channel, total > 0, channel_norms):
                for unit_pass in passes:
                    loss, out, _ = self._loss(unit_pass.batch)
                    (loss * unit_pass.scale).backward()
                    for name, value in out.items() if unit_pass.count else ():
                        if name not in ("loss/total", "sdpo/tokens"):
                            weighted.add(name, float(value), unit_pass.count)
            if channel == "sdpo_" and total:
                sdpo_tokens = float(total)  # every rank knows every rank's count
        metrics = weighted.reduced(self.world) | channel_norms
        if self.router is not None:
            metrics.update(self.router.take(self.device))  # from the counts of every rank
        if sdpo_tokens:
            metrics["sdpo/tokens"] = sdpo_tokens
        metrics["loss/total"] = self._total(metrics)
        metrics.update(self._apply())  # every DiLoCo-th step, the outer step runs in its hooks
        if self.islands is not None:
            metrics.update(self.islands.metrics())
        return metrics

    def _channel(self, prefix: str, ran: bool, into: dict[str, float]) -> AbstractContextManager:
        """With `metrics.channel_grad_norms`: the channel's part of the gradient, measured into `into`."""
        return self.channel_grads.channel(prefix, ran, into) if self.channel_grads else nullcontext()

    def _total(self, metrics: dict[str, float]) -> float:
        """The step's loss, each channel that had rows with its weight; NaN when none had any (no
        informative rollout, no pair, no recovery token), not a loss of 0."""
        weights = {
            "loss/rl": 1.0,
            "moe/aux_loss": self.config.trainer.router_aux_loss_coef,
            "loss/replay": self.config.loss.replay.weight,
            "loss/sdpo": self.config.loss.sdpo.weight,
        }
        parts = [weight * metrics[name] for name, weight in weights.items() if name in metrics]
        return sum(parts) if parts else math.nan

    def _join_islands(self) -> None:
        from meshrl.trainer.islands import Islands  # the optional [islands] extra

        self.islands = Islands(self.config.trainer.diloco, self.model, self.optimizer, self.rank, self.world)
        self._restore_islands()

    def _restore_islands(self) -> None:
        """A resumed checkpoint's outer state goes into the islands once they are joined."""
        if self.islands is not None and self._islands_state is not None:
            self.islands.load(self._islands_state)
            self._islands_state = None

    def _aux_channels(self) -> list[str]:
        """Key prefixes of the live replay/SDPO channels. Each runs as its own pass, so under
        FSDP2 every rank runs each channel's forward passes (collectives) the same number of
        times even when only some ranks have that channel's data."""
        loss = self.config.loss
        return [prefix for prefix, weight in (("dpo_", loss.replay.weight), ("sdpo_", loss.sdpo.weight)) if weight > 0]

    def start_rl(self) -> None:
        """After a warm start: the DPO reference becomes the policy RL starts from (with LoRA a frozen
        copy of the warm-started adapters), and RL starts with fresh AdamW moments (the warm start's, at
        its own learning rate, would steer the first RL steps) unless `trainer.warm_start_keep_optimizer`."""
        if not self.config.trainer.warm_start_keep_optimizer:
            self.optimizer.state.clear()
        if isinstance(self.ref_call, FrozenAdapters):
            self.ref_call.take()
        if self.ref_model is not None and not self.fixed_ref:  # shard to shard (sharded alike under FSDP2)
            with torch.no_grad():
                for ref, param in zip(self.ref_model.parameters(), self.model.parameters(), strict=True):
                    ref.copy_(param)

    def sft_step(self, shards: list[dict[str, Any]], rank: int = 0) -> dict[str, float]:
        """Warm start: masked NLL of the assistant tokens (the collator's loss_mask), at the
        warm-start learning rate and outside the RL schedule. `shards` holds every rank's batch; each
        runs in micro-batches of whole rows within `trainer.micro_batch_tokens` (sixteen SmolLM2
        demonstrations of a few hundred tokens in one pass held 20 GB), weighted so the gradient is
        the mean over every rank's tokens."""
        lr = self.config.trainer.warm_start_lr or self.config.trainer.lr
        scheduled = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        chunk_size = self.config.model.logprob_chunk_size

        def nll(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor]:
            kwargs = {k: batch[k] for k in ("attention_mask", "position_ids") if k in batch}
            mask = batch["loss_mask"].float()
            logprobs = sequence_token_logprobs(model, batch["input_ids"], chunk_size, 1.0, mask, **kwargs)
            return (-(logprobs * mask).sum() / mask.sum().clamp_min(1),)

        # a demonstration's own rows alone: the run's collator also builds SDPO rows at its error sites
        shards = [{k: v for k, v in shard.items() if k in SFT_KEYS} for shard in shards]
        summed, counted = 0.0, 0
        for unit_pass in self._unit_passes(SFT, shards, rank)[0]:
            with self._autocast():
                (loss,) = self.call(nll, _to(unit_pass.batch, self.device))
            (loss * unit_pass.scale).backward()
            summed, counted = summed + float(loss.detach()) * unit_pass.count, counted + unit_pass.count
        metrics = {"loss/sft": summed / max(1, counted), **self._apply(schedule=False)}
        for group, value in zip(self.optimizer.param_groups, scheduled):
            group["lr"] = value
        return metrics

    # ------------------------------------------------------------------ weights and checkpoints

    def weights(self, dtype: torch.dtype | None = None, adapters_only: bool = False) -> dict[str, torch.Tensor]:
        """The full policy weights on CPU on rank 0, {} on the others, in `dtype` when given
        (generators get the compute dtype; checkpoints keep the float32 masters). Every rank
        must call: under FSDP2 it is an all-gather. `adapters_only` (LoRA): the adapters' tensors
        alone, under the names an engine with the same adapters injected has (`lora_generators`)."""
        if adapters_only:
            full = self._adapters_state()
        else:
            full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if self.adapters is not None and full:  # LoRA (rank 0 holds the gathered state): adapted weights merged
                from meshrl.trainer.lora import merged_state

                full = merged_state(full, self.lora_plan)
        return full if dtype is None else {name: value.to(dtype) for name, value in full.items()}

    def _adapters_state(self) -> dict[str, torch.Tensor]:
        """The adapters' tensors, whole and on CPU (every rank calls: under FSDP2 each is gathered)."""
        from meshrl.trainer.lora import adapter_tensors

        return {name: _whole(value) for name, value in adapter_tensors(self.model.state_dict()).items()}

    def save(self, directory: str | Path, wait: bool = True) -> None:
        """Model (safetensors), optimizer, scheduler and RNG state into `directory`.

        Every rank calls (the full state dicts are gathered under FSDP2); rank 0 snapshots them
        and writes. `wait=False` returns after the snapshot: the write runs in the background
        (`checkpoint_written` says when it is done) while training goes on.
        """
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = self.weights()
        optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        reference = get_model_state_dict(self.ref_model, options=options) if self.ref_model is not None else None
        adapters = frozen = None
        if self.adapters is not None:
            from meshrl.trainer.lora import peft_names

            adapters = peft_names(self.adapters, self._adapters_state())
        if isinstance(self.ref_call, FrozenAdapters):
            frozen = self.ref_call.state()
        if self.rank != 0:
            return
        weights, optimizer, reference, scheduler, adapters, frozen = own_copy(
            (weights, optimizer, reference, self.scheduler.state_dict(), adapters, frozen),
            clone_tensors=self.device.type == "cpu",
        )
        state = TrainerState(
            weights=weights,
            optimizer=optimizer,
            scheduler=scheduler,
            skipped_steps=self.skipped_steps,
            rng={"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
            reference=reference,
            islands=self.islands.state() if self.islands is not None else self._islands_state,
            adapters=adapters,
            adapter_config=self.adapters.peft_config["default"] if self.adapters is not None else None,
            reference_adapters=frozen,
        )
        directory = Path(directory)
        self.writer.submit(
            directory,
            lambda: write_checkpoint(state, directory, self.model, self.ref_model, self.model_path, self.chat_template),
        )
        if wait:
            self.checkpoint_written(wait=True)

    def checkpoint_written(self, wait: bool) -> bool:
        """True once this rank's last `save` is on disk (`wait`: block until then); a failed
        write raises here."""
        return self.writer.written(wait)

    def load(self, directory: str | Path) -> None:
        """Every rank reads the checkpoint rank 0 wrote and keeps its own part. A LoRA run's checkpoint
        (`adapter/`) continues without adapters (`model.lora` turned off on resume) from its merged
        weights, with a fresh AdamW and the LoRA run's reference merged into full weights."""
        directory = Path(directory)
        options = StateDictOptions(full_state_dict=True)
        lora_off = self.adapters is None and (directory / "adapter").is_dir()
        if self.adapters is not None:  # the base is the run's model; the adapters are what trained
            from meshrl.trainer.lora import saved_adapters

            adapters = saved_adapters(self.model, directory / "adapter")
            set_model_state_dict(self.model, adapters, options=StateDictOptions(full_state_dict=True, strict=False))
        else:
            saved = AutoModelForCausalLM.from_pretrained(directory / "model", dtype=torch.float32)
            set_model_state_dict(self.model, saved.state_dict(), options=options)
        state = torch.load(directory / "trainer.pt", weights_only=False)
        if not lora_off:
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        elif self.rank == 0:  # its AdamW state was the adapters'
            print("model.lora is off: AdamW starts fresh (the checkpoint's optimizer state was the LoRA adapters')",
                  flush=True)  # fmt: skip
        self._schedule_from(state["scheduler"]["last_epoch"])
        self.skipped_steps = state["skipped_steps"]
        self._islands_state = state.get("islands")
        self._restore_islands()
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        frozen = state.get("reference_adapters")  # absent before they were saved: the base, as then
        if isinstance(self.ref_call, FrozenAdapters) and frozen is not None:
            self.ref_call.load(frozen)
        elif lora_off and self.ref_model is not None and not self.fixed_ref and frozen is not None:
            from meshrl.trainer.lora import merged_reference  # the LoRA run's reference, as full weights

            merged = merged_reference(self.model_path, directory / "adapter", frozen)
            set_model_state_dict(self.ref_model, merged, options=options)
        if self.ref_model is not None and (directory / "reference").exists():
            reference = AutoModelForCausalLM.from_pretrained(directory / "reference", dtype=torch.float32)
            set_model_state_dict(self.ref_model, reference.state_dict(), options=options)

    def _schedule_from(self, step: int) -> None:
        """AdamW's settings and the learning-rate schedule as the config gives them, at the checkpoint's
        step: the checkpoint's param groups and scheduler hold the settings it trained with, so a resume
        that changed trainer.lr, betas, weight_decay or the schedule (--allow-config-change) recorded the
        change and trained as before; and a LoRA run resumed without adapters would keep the adapters'
        learning rate, far too high for full weights. Unchanged, the rate is the same exactly."""
        t = self.config.trainer
        for group in self.optimizer.param_groups:
            group.update(initial_lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(self.config), last_epoch=step - 1)
