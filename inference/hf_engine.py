"""Batched sampling from an HF causal LM with a KV cache, for CPU (or any torch device).

The decode loop is written out instead of calling `model.generate`, so each token's
logprob is taken from exactly the distribution it was drawn from (temperature, then
top-p) and the trainer can recompute it. Prompts are left-padded into one batch: one
forward prefills them all, then each step feeds only the new tokens; rows that finish are
dropped from the batch and the cache.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from meshrl.inference.completion import Completion, FinishReason, check_sampling


def top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """Set to -inf every logit outside the nucleus: the most likely tokens whose mass reaches `top_p`.

    A token stays if the mass of the tokens ranked above it is below `top_p` (vLLM's rule), so
    the most likely token always stays.
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    outside = (probs.cumsum(dim=-1) - probs) >= top_p
    return logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))


def sample(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Draw one token per row; return the tokens and their logprobs under the distribution sampled.

    Temperature 0 is greedy, with logprobs under the temperature-1 distribution.
    """
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1)
    else:
        logprobs = torch.log_softmax(top_p_filter(logits / temperature, top_p), dim=-1)
        tokens = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def eos_token_ids(model: PreTrainedModel) -> list[int]:
    """The ids that end a completion: the generation config's (which may list several), else the model config's."""
    for source in (model.generation_config, model.config):
        ids = getattr(source, "eos_token_id", None)
        if ids is not None:
            return [ids] if isinstance(ids, int) else list(ids)
    raise ValueError("the model names no eos_token_id; pass eos_token_ids to HFEngine directly")


class HFEngine:
    """Inference engine around an HF causal LM; `load_weights` swaps in a new policy version in place."""

    def __init__(self, model: PreTrainedModel, eos_token_ids: list[int], pad_token_id: int) -> None:
        if not eos_token_ids:
            raise ValueError("eos_token_ids is empty: completions could only end by length")
        self.model = model.eval()
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self._version = 0

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "float32", device: str = "cpu") -> HFEngine:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
        eos = eos_token_ids(model)
        pad = model.config.pad_token_id
        # The pad id only fills masked positions, so any valid id serves when the model names none.
        return cls(model, eos, eos[0] if pad is None else pad)

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

    @torch.inference_mode()
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
        """Sample one completion per prompt, all prompts in one batch; deterministic given `seed`."""
        check_sampling(prompts, temperature, top_p, max_new_tokens)
        if not prompts:
            return []
        device = self.device
        stops = torch.tensor(sorted(set(self.eos_token_ids) | set(stop_token_ids or [])), device=device)
        generator = torch.Generator(device=device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)

        input_ids, attention_mask = self._left_pad(prompts)
        position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self._next_logits(input_ids, attention_mask, position_ids, cache, logits_to_keep=1)
        next_position = position_ids[:, -1] + 1

        rows = torch.arange(len(prompts), device=device)  # batch slot -> prompt index
        completions: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        finish: list[FinishReason] = ["length"] * len(prompts)
        for step in range(max_new_tokens):
            tokens, token_logprobs = sample(logits, temperature, top_p, generator)
            for row, token, logprob in zip(rows.tolist(), tokens.tolist(), token_logprobs.tolist()):
                completions[row].append(token)
                logprobs[row].append(logprob)
            done = torch.isin(tokens, stops)
            for row in rows[done].tolist():
                finish[row] = "stop"
            if step == max_new_tokens - 1 or bool(done.all()):
                break
            if bool(done.any()):
                keep = (~done).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                rows, tokens, attention_mask, next_position = (
                    rows[keep],
                    tokens[keep],
                    attention_mask[keep],
                    next_position[keep],
                )
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1)
            logits = self._next_logits(tokens[:, None], attention_mask, next_position[:, None], cache)
            next_position = next_position + 1

        return [
            Completion(prompt_ids=list(prompt), completion_ids=ids, logprobs=lps, finish_reason=reason)
            for prompt, ids, lps, reason in zip(prompts, completions, logprobs, finish)
        ]

    def _left_pad(self, prompts: list[list[int]]) -> tuple[Tensor, Tensor]:
        """Right-align prompts so every row's next token lands in the last column."""
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[i, width - len(prompt) :] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)

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
