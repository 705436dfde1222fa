"""The GPU backend: the same `generate`/`load_weights` contract as HFEngine, served by vLLM's offline `LLM`.

Written against vLLM's V1 offline API as of vllm-project/vllm main at commit 10fdb8f
(vllm/entrypoints/llm.py, about v0.15; `logprobs_mode` needs >= 0.10.2) and the V1 sampler
at commit 3e34265 (vllm/v1/sample/sampler.py). vLLM is imported only inside the
constructor, so this module imports on machines without it; the request/response
mapping lives in pure functions that are tested without vLLM.
"""

from __future__ import annotations

import os
from typing import Any

from torch import Tensor

from meshrl.inference.completion import Completion, check_sampling, request_seeds


def to_sampling_kwargs(
    *, temperature: float, top_p: float, max_new_tokens: int, stop_token_ids: list[int] | None, seed: int | None
) -> dict[str, Any]:
    """Keyword arguments of one request's `vllm.SamplingParams`.

    `logprobs=0` returns just the sampled token's logprob; `detokenize=False` skips text
    we never read. EOS stays on vLLM's own handling (tokenizer and generation config).
    """
    return {
        "n": 1,
        "temperature": temperature,
        "top_p": top_p,
        "max_tokens": max_new_tokens,
        "stop_token_ids": list(stop_token_ids or []),
        "logprobs": 0,
        "seed": seed,
        "detokenize": False,
    }


def to_prompt_inputs(prompts: list[list[int]]) -> list[dict[str, list[int]]]:
    """Token-id prompts in vLLM's `TokensPrompt` shape, so vLLM never re-tokenizes them."""
    return [{"prompt_token_ids": list(prompt)} for prompt in prompts]


def from_request_output(prompt_ids: list[int], output: Any) -> Completion:
    """A `Completion` from one `vllm.RequestOutput` (n=1, requested with logprobs=0)."""
    if list(output.prompt_token_ids) != list(prompt_ids):
        raise ValueError("the request output answers a different prompt: outputs and prompts are out of order")
    sample = output.outputs[0]
    token_ids = list(sample.token_ids)
    if sample.logprobs is None or len(sample.logprobs) != len(token_ids):
        raise ValueError("the request output carries no logprob per sampled token; request with logprobs=0")
    if sample.finish_reason not in ("stop", "length"):
        raise ValueError(f"the request ended with finish_reason {sample.finish_reason!r}, not 'stop' or 'length'")
    return Completion(
        prompt_ids=list(prompt_ids),
        completion_ids=token_ids,
        logprobs=[position[token].logprob for token, position in zip(token_ids, sample.logprobs)],
        finish_reason=sample.finish_reason,
    )


def load_into_worker(worker: Any, weights: list[tuple[str, Tensor]]) -> None:
    """Runs inside each vLLM worker (via `collective_rpc`): hand HF-named weights to the model's loader.

    A module-level function rather than a lambda, so a multi-GPU executor can pickle it by name.
    """
    worker.get_model().load_weights(weights=weights)


class VLLMEngine:
    """Inference engine around `vllm.LLM`; `load_weights` swaps in a new policy version in place."""

    def __init__(self, path: str, *, dtype: str = "bfloat16", seed: int = 0, **llm_kwargs: Any) -> None:
        # An in-process engine core lets load_weights hand tensors to the model by reference;
        # across vLLM's process boundary collective_rpc arguments are msgpack-encoded and only
        # msgspec structs are typed back, so tensors would not arrive as tensors.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        # processed_logprobs: logprobs after temperature and top-p (temperature-1 for greedy),
        # the distribution each token was drawn from, as HFEngine reports them.
        self._llm = LLM(model=path, dtype=dtype, seed=seed, logprobs_mode="processed_logprobs", **llm_kwargs)
        self._version = 0

    @property
    def version(self) -> int:
        """Policy version of the weights now loaded (0 until the first `load_weights`)."""
        return self._version

    def load_weights(self, state_dict: dict[str, Tensor], version: int) -> None:
        """Load trainer weights (HF names) through the model's own `load_weights`, which fuses and shards them."""
        self._llm.collective_rpc(load_into_worker, args=(list(state_dict.items()),))
        # Cached prefix KV blocks were computed by the old weights.
        self._llm.reset_prefix_cache()
        self._version = version

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
        """Sample one completion per prompt; deterministic given `seed`."""
        from vllm import SamplingParams

        check_sampling(prompts, temperature, top_p, max_new_tokens)
        if not prompts:
            return []
        params = [
            SamplingParams(
                **to_sampling_kwargs(
                    temperature=temperature,
                    top_p=top_p,
                    max_new_tokens=max_new_tokens,
                    stop_token_ids=stop_token_ids,
                    seed=request_seed,
                )
            )
            for request_seed in request_seeds(seed, len(prompts))
        ]
        outputs = self._llm.generate(to_prompt_inputs(prompts), params, use_tqdm=False)
        return [from_request_output(prompt, output) for prompt, output in zip(prompts, outputs, strict=True)]
