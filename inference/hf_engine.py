"""Sampling from an HF causal LM with a KV cache kept per conversation, for CPU (or any torch device).

The decode loop is written out instead of calling `model.generate`, so each token's
logprob is taken from exactly the distribution it was drawn from (temperature, then
top-p) and the trainer can recompute it.

A `Sequence` is one conversation: its token ids and the KV cache of those the model has
seen, kept across turns, so a new turn prefills only the ids appended since (a tool turn).
A `DecodeBatch` advances many sequences by one token per forward: their caches are
left-padded into one batched cache, rebuilt only when sequences join; a sequence whose turn
ends leaves the batch with its own cache. Each sequence samples from its own seeded
generator, so what it samples does not depend on which others share its batch.

A mixture of experts' routing is recorded from router hooks (`record_routing`): each forward's
choice goes to the positions it ran over, so a turn's `Completion.routing` holds every position
the conversation's KV cache was computed with (`models.routing`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from meshrl.inference.completion import Completion, check_sampling, generate_all
from meshrl.models.routing import RoutingRecorder

# Padded tokens in one batched prefill forward: bounds its activations and attention mask.
PREFILL_TOKENS = 8192


def sample_rows(logits: Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
    """Each row's next token and its logprob, drawn with its sequence's own generator, every row at
    once on the device and read back in one transfer: drawing row by row (`sample`) was a host round
    trip per sequence and token, which held the engine to 0.38-0.43x transformers' `generate` on a GPU.

    The draw is `torch.multinomial`'s for one sample (argmax of p / Exp(1), the exponentials from the
    row's generator), so a seed gives the tokens `sample` gave. Temperature 0 is greedy, with
    logprobs under the temperature-1 distribution."""
    device, vocab = logits.device, logits.shape[-1]
    temperatures = [seq.temperature for seq in seqs]
    greedy = torch.tensor([t == 0 for t in temperatures], device=device)
    scale = torch.tensor([t or 1.0 for t in temperatures], device=device, dtype=logits.dtype)[:, None]
    filtered = logits / scale
    if any(seq.top_p < 1.0 for seq in seqs):
        top_p = torch.tensor([seq.top_p for seq in seqs], device=device, dtype=logits.dtype)[:, None]
        ordered, order = filtered.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        outside = ((probs.cumsum(dim=-1) - probs) >= top_p) & (top_p < 1.0)
        filtered = filtered.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
    logprobs = torch.log_softmax(torch.where(greedy[:, None], logits, filtered), dim=-1)
    race = torch.stack([
        torch.empty(vocab, device=device, dtype=logprobs.dtype).exponential_(1, generator=seq.generator)
        if seq.temperature else torch.ones(vocab, device=device, dtype=logprobs.dtype)
        for seq in seqs
    ])  # fmt: skip
    tokens = torch.where(greedy, logits.argmax(dim=-1), (logprobs.exp() / race).argmax(dim=-1))
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()


def eos_token_ids(model: PreTrainedModel) -> list[int]:
    """The ids that end a completion: the generation config's (which may list several), else the model config's."""
    for source in (model.generation_config, model.config):
        ids = getattr(source, "eos_token_id", None)
        if ids is not None:
            return [ids] if isinstance(ids, int) else list(ids)
    raise ValueError("the model names no eos_token_id; pass eos_token_ids to HFEngine directly")


class HFEngine:
    """Inference engine around an HF causal LM; `load_weights` swaps in a new policy version in place."""

    def __init__(self, model: PreTrainedModel, eos_token_ids: list[int], record_routing: bool = False) -> None:
        if not eos_token_ids:
            raise ValueError("eos_token_ids is empty: completions could only end by length")
        if any(type(layer) is not DynamicLayer for layer in DynamicCache(config=model.config).layers):
            raise ValueError(
                f"{type(model).__name__} uses sliding-window or other non-dynamic KV cache layers, "
                "which the HF engine's per-conversation caches do not support; use generator.backend = vllm"
            )
        self.model = model.eval()
        self.eos_token_ids = list(eos_token_ids)
        self._version = 0
        # a mixture of experts' routed experts, per forward, for routing replay (None: a dense model, or not asked)
        self.recorder = RoutingRecorder.attach(model) if record_routing else None

    @classmethod
    def from_pretrained(
        cls, path: str, dtype: str = "float32", device: str = "cpu", record_routing: bool = False
    ) -> HFEngine:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
        return cls(model, eos_token_ids(model), record_routing)

    @property
    def version(self) -> int:
        """Policy version of the weights now loaded (0 until the first `load_weights`)."""
        return self._version

    @property
    def device(self) -> torch.device:
        return self.model.device

    def load_weights(self, state_dict: dict[str, Tensor], version: int) -> None:
        """Copy trainer weights into the model in place; a subset of names is allowed.

        Every name and shape is checked before anything is copied, so a bad update leaves the
        current policy intact rather than half-replaced.
        """
        current = self.model.state_dict(keep_vars=True)
        unknown = sorted(set(state_dict) - set(current))
        if unknown:
            raise KeyError(f"{len(unknown)} weights are not in the model, e.g. {unknown[:3]}")
        for name, tensor in state_dict.items():
            if tensor.shape != current[name].shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != model's {tuple(current[name].shape)}")
        with torch.no_grad():
            for name, tensor in state_dict.items():
                current[name].copy_(tensor)
        self._version = version

    def close(self) -> None:
        """Nothing to stop: the decode loop runs on the caller's thread (continuous batching's does not)."""

    def sequence(self, ids: list[int], seed: int | None = None) -> Sequence:
        """A conversation starting with `ids`, sampling from a generator seeded with `seed`."""
        return Sequence(ids, seed, self.device)

    @torch.inference_mode()
    def begin_turns(
        self,
        seqs: list[Sequence],
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        stop_token_ids: list[int] | None = None,
    ) -> list[bool]:
        """Prefill the ids each sequence's cache lacks and sample each turn's first token.

        Sequences without a cache (new episodes) prefill together, left-padded, in forwards of
        at most `PREFILL_TOKENS` padded tokens: one forward per prompt cost SmolLM2 2.4x the time
        of one batched forward on CPU. A sequence with a cache (a later turn) prefills its new ids
        alone. Returns, per sequence, whether its turn goes on (then it joins a `DecodeBatch`);
        `seq.turn` holds the turn.
        """
        check_sampling([seq.ids for seq in seqs], temperature, top_p, max_new_tokens)
        stops = set(self.eos_token_ids) | set(stop_token_ids or [])
        for seq in seqs:
            seq.turn = Completion(list(seq.ids), [], [], "length")
            seq.temperature, seq.top_p, seq.max_new_tokens, seq.stops = temperature, top_p, max_new_tokens, stops
        logits: dict[int, Tensor] = {}
        fresh = sorted((seq for seq in seqs if seq.cache is None), key=lambda seq: len(seq.ids))
        while fresh:
            group = [fresh.pop()]  # longest first; the group's width is its first row's
            while fresh and (len(group) + 1) * len(group[0].ids) <= PREFILL_TOKENS:
                group.append(fresh.pop())
            logits.update(zip(map(id, group), self._prefill_fresh(group)))
        for seq in seqs:
            if seq.cache is not None and id(seq) not in logits:
                new = torch.tensor([seq.ids[seq.cached :]], device=self.device)
                positions = torch.arange(seq.cached, len(seq.ids), device=self.device)[None]
                mask = torch.ones((1, len(seq.ids)), dtype=torch.long, device=self.device)
                logits[id(seq)] = self._next_logits(new, mask, positions, seq.cache, logits_to_keep=1)[0]
                self._record([seq], new.shape[1], [new.shape[1]])
                seq.cached = len(seq.ids)
        return self.sample_next(seqs, torch.stack([logits[id(seq)] for seq in seqs])) if seqs else []

    def _prefill_fresh(self, group: list[Sequence]) -> Tensor:
        """One left-padded forward over sequences with no cache; each gets its own unpadded cache."""
        width = max(len(seq.ids) for seq in group)
        ids = torch.zeros((len(group), width), dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for i, seq in enumerate(group):
            ids[i, width - len(seq.ids) :] = torch.tensor(seq.ids, device=self.device)
            mask[i, width - len(seq.ids) :] = 1
        cache = self.empty_cache()
        logits = self._next_logits(ids, mask, (mask.cumsum(-1) - 1).clamp_min(0), cache, logits_to_keep=1)
        self._record(group, width, [len(seq.ids) for seq in group])
        for i, seq in enumerate(group):
            seq.cache, seq.cached = self.row_cache(cache, i, len(seq.ids)), len(seq.ids)
        return logits

    def row_cache(self, cache: DynamicCache, row: int, length: int) -> DynamicCache:
        """Row `row` of a left-padded batched cache as a one-row cache of its last `length` positions."""
        mine = self.empty_cache()
        for layer, batched in zip(mine.layers, cache.layers):
            layer.update(
                batched.keys[row : row + 1, :, -length:].clone(), batched.values[row : row + 1, :, -length:].clone()
            )
        return mine

    def _record(self, seqs: list[Sequence], width: int, new: list[int]) -> None:
        """The last forward's routing (rows `seqs`, `width` columns, left-padded) onto each sequence:
        its row's last `new[i]` columns are its next positions."""
        if self.recorder is not None:
            routing = self.recorder.take(len(seqs), width)
            for seq, row, count in zip(seqs, routing, new, strict=True):
                seq.routes.append(row[width - count :])

    def sample_next(self, seqs: list[Sequence], logits: Tensor) -> list[bool]:
        """Sample each sequence's next token from its row of `logits` (`sample_rows`); returns, per
        sequence, whether its turn goes on."""
        going = []
        for seq, token, logprob in zip(seqs, *sample_rows(logits, seqs), strict=True):
            turn = seq.turn
            seq.ids.append(token)
            turn.completion_ids.append(token)
            turn.logprobs.append(logprob)
            turn.versions.append(self._version)
            turn.finish_reason = "stop" if token in seq.stops else turn.finish_reason
            going.append(token not in seq.stops and len(turn.completion_ids) < seq.max_new_tokens)
            if not going[-1] and self.recorder is not None:
                turn.routing = seq.routing()
        return going

    def batch(self) -> DecodeBatch:
        """An empty batch of running turns, for `begin_turns`' sequences that go on."""
        return DecodeBatch(self)

    def empty_cache(self) -> DynamicCache:
        """A cache for one sequence or a batch (its layers are plain dynamic ones: checked at init)."""
        return DynamicCache(config=self.model.config)

    def generate(
        self,
        prompts: list[list[int]],
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
    ) -> list[Completion]:
        """One completion per prompt, all advanced together; deterministic given `seed`."""
        return generate_all(self, prompts, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                            stop_token_ids=stop_token_ids, seed=seed)  # fmt: skip

    def _next_logits(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        cache: DynamicCache,
        logits_to_keep: int = 0,
    ) -> Tensor:
        """Logits for each row's next token, at least float32 so sampling is not done in bf16.

        `logits_to_keep=1` spares the prefill the LM head over every prompt position.
        """
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        logits = out.logits[:, -1]
        return logits.to(torch.promote_types(logits.dtype, torch.float32))


class Sequence:
    """One conversation: its ids, the KV cache of `ids[:cached]`, its sampler, and its current turn."""

    def __init__(self, ids: list[int], seed: int | None, device: torch.device) -> None:
        if not ids:
            raise ValueError("a sequence needs at least one token to condition on")
        self.ids = list(ids)
        self.cache: DynamicCache | None = None
        self.cached = 0
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.turn: Completion | None = None
        self.temperature, self.top_p, self.max_new_tokens = 1.0, 1.0, 1
        self.stops: set[int] = set()
        self.routes: list[np.ndarray] = []  # routed experts of ids[:cached], in pieces (a recording engine's)

    def routing(self) -> np.ndarray:
        """The routed experts of every position the KV cache holds, in one piece."""
        self.routes = [np.concatenate(self.routes)]
        return self.routes[0]

    def extend(self, ids: list[int]) -> None:
        """Append ids the model did not sample (a tool turn); the next turn prefills them."""
        self.ids += ids

    def release(self) -> None:
        """Drop the KV cache (the next turn prefills the whole conversation again)."""
        self.cache, self.cached, self.routes = None, 0, []


class DecodeBatch:
    """Sequences mid-turn, advanced by one token per forward.

    The batch's cache is the truth for its rows while they stay; rows whose turn ends are cut
    out with their caches, and sequences that join trigger one rebuild (every row's cache
    split out, then left-padded together again), so the cost of re-padding is paid per join,
    not per token.
    """

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine
        self.rows: list[Sequence] = []
        self.joining: list[Sequence] = []
        self.cache: DynamicCache | None = None
        self.mask: Tensor | None = None

    def __len__(self) -> int:
        return len(self.rows) + len(self.joining)

    def add(self, seq: Sequence) -> None:
        """A sequence whose turn `begin_turns` started and that goes on."""
        self.joining.append(seq)

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One token for every row; returns the sequences whose turn ended (they leave the batch)."""
        if self.joining:
            self._rebuild()
        engine, rows = self.engine, self.rows
        device = engine.device
        tokens = torch.tensor([[seq.ids[-1]] for seq in rows], device=device)
        positions = torch.tensor([[seq.cached] for seq in rows], device=device)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(rows), 1)], dim=1)
        logits = engine._next_logits(tokens, self.mask, positions, self.cache)
        engine._record(rows, 1, [1] * len(rows))
        for seq in rows:
            seq.cached += 1
        going = engine.sample_next(rows, logits)
        if all(going):
            return []
        ended = [seq for seq, on in zip(rows, going) if not on]
        for i, on in enumerate(going):
            if not on:
                self._split(i)
        keep = [i for i, on in enumerate(going) if on]
        self.rows = [rows[i] for i in keep]
        if keep:
            self.cache.batch_select_indices(torch.tensor(keep, device=device))
            self.mask = self.mask[keep]
        else:
            self.cache = self.mask = None
        return ended

    def _split(self, i: int) -> None:
        """Row i's cache, without its left padding, back onto its sequence."""
        seq = self.rows[i]
        seq.cache = self.engine.row_cache(self.cache, i, seq.cached)

    def _rebuild(self) -> None:
        for i in range(len(self.rows)):
            self._split(i)
        self.rows += self.joining
        self.joining = []
        width = max(seq.cached for seq in self.rows)
        self.cache = self.engine.empty_cache()
        for layer_index, layer in enumerate(self.cache.layers):
            keys, values = zip(*(_padded(seq.cache.layers[layer_index], width) for seq in self.rows))
            layer.update(torch.cat(keys), torch.cat(values))
        self.mask = torch.zeros((len(self.rows), width), dtype=torch.long, device=self.engine.device)
        for i, seq in enumerate(self.rows):
            self.mask[i, width - seq.cached :] = 1
            seq.cache = None  # the batch holds it now


def _padded(layer: DynamicLayer, width: int) -> tuple[Tensor, Tensor]:
    """A one-row layer's keys and values left-padded with zeros to `width` positions."""
    pad = width - layer.keys.shape[-2]
    return (
        torch.nn.functional.pad(layer.keys, (0, 0, pad, 0)),
        torch.nn.functional.pad(layer.values, (0, 0, pad, 0)),
    )
