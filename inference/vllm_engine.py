"""The GPU backend: the same `generate`/`load_weights` contract as HFEngine, served by vLLM's offline `LLM`.

Written against vLLM's V1 offline API as of vllm-project/vllm main at commit 10fdb8f
(vllm/entrypoints/llm.py, about v0.15; `logprobs_mode` needs >= 0.10.2, a prompt's
`cache_salt` >= 0.9) and the V1 sampler
at commit 3e34265 (vllm/v1/sample/sampler.py). vLLM is imported only inside the
constructor, so this module imports on machines without it; the request/response
mapping lives in pure functions that are tested without vLLM.
"""

from __future__ import annotations

import os
import random
from typing import Any

from torch import Tensor

from meshrl.inference.completion import Completion, check_sampling, generate_all


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


def to_prompt_inputs(prompts: list[list[int]], version: int) -> list[dict[str, Any]]:
    """Token-id prompts in vLLM's `TokensPrompt` shape, so vLLM never re-tokenizes them, salted
    with the policy version: prefix-cache blocks are shared only between requests of one version.

    Without the salt a request at version v+k reuses blocks computed by version v's weights:
    `reset_prefix_cache()` does nothing while any block is in use, which is always the case
    while generation runs ahead of training (PRIME-RL salts by version for the same reason).
    """
    return [{"prompt_token_ids": list(prompt), "cache_salt": f"policy-{version}"} for prompt in prompts]


def add_output(turn: Completion, output: Any, version: int) -> bool:
    """Append one `vllm.RequestOutput` (n=1, logprobs=0, output_kind DELTA: the tokens new since
    the last step) to the turn, each token stamped with `version`; returns whether it finished."""
    if output.prompt_token_ids is not None and list(output.prompt_token_ids) != turn.prompt_ids:
        raise ValueError("the request output answers a different prompt: outputs and requests are mixed up")
    sample = output.outputs[0]
    token_ids = list(sample.token_ids)
    if sample.logprobs is None or len(sample.logprobs) != len(token_ids):
        raise ValueError("the request output carries no logprob per sampled token; request with logprobs=0")
    turn.completion_ids += token_ids
    turn.logprobs += [position[token].logprob for token, position in zip(token_ids, sample.logprobs)]
    turn.versions += [version] * len(token_ids)
    if not output.finished:
        return False
    if sample.finish_reason not in ("stop", "length"):
        raise ValueError(f"the request ended with finish_reason {sample.finish_reason!r}, not 'stop' or 'length'")
    turn.finish_reason = sample.finish_reason
    return True


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
        # Cached prefix blocks of the old weights stay until evicted, unreachable: requests from now
        # on carry the new version's cache salt. A request already running keeps its KV, as the HF
        # engine's episodes do.
        self._version = version

    def sequence(self, ids: list[int], seed: int | None = None) -> VLLMSequence:
        return VLLMSequence(ids, seed)

    def batch(self) -> VLLMBatch:
        return VLLMBatch(self)

    def begin_turns(
        self,
        seqs: list[VLLMSequence],
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        stop_token_ids: list[int] | None = None,
    ) -> list[bool]:
        """Queue each turn as a request over its whole conversation: vLLM's prefix cache finds the
        blocks of the earlier turns, so only the new ids are prefilled, and its scheduler batches
        the prefills. Tokens come in `VLLMBatch.step`; every turn goes on."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        check_sampling([seq.ids for seq in seqs], temperature, top_p, max_new_tokens)
        for seq in seqs:
            seq.turn = Completion(list(seq.ids), [], [], "length")
            seq.request_id = f"{id(seq)}-{seq.turns}"
            seq.turns += 1
            kwargs = to_sampling_kwargs(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                        stop_token_ids=stop_token_ids, seed=seq.rng.getrandbits(63))  # fmt: skip
            params = SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
            self._llm.llm_engine.add_request(seq.request_id, to_prompt_inputs([seq.ids], self._version)[0], params)
        return [True] * len(seqs)

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


class VLLMSequence:
    """One conversation's ids and current turn; vLLM's prefix cache holds its KV blocks."""

    cached = 0  # vLLM manages its KV memory itself: nothing counts against the scheduler's cap

    def __init__(self, ids: list[int], seed: int | None) -> None:
        if not ids:
            raise ValueError("a sequence needs at least one token to condition on")
        self.ids = list(ids)
        self.rng = random.Random(seed)
        self.turn: Completion | None = None
        self.turns = 0
        self.request_id = ""

    def extend(self, ids: list[int]) -> None:
        self.ids += ids

    def release(self) -> None:
        """Nothing to drop: vLLM evicts prefix-cache blocks itself."""


class VLLMBatch:
    """The engine's running requests, advanced by `LLMEngine.step` (vLLM's own continuous batching)."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine
        self.running: dict[str, VLLMSequence] = {}

    def __len__(self) -> int:
        return len(self.running)

    def add(self, seq: VLLMSequence) -> None:
        self.running[seq.request_id] = seq

    def step(self) -> list[VLLMSequence]:
        """One engine step; returns the sequences whose turn ended."""
        ended = []
        for output in self.engine._llm.llm_engine.step():
            seq = self.running[output.request_id]
            if add_output(seq.turn, output, self.engine.version):
                seq.ids += seq.turn.completion_ids
                ended.append(self.running.pop(output.request_id))
        return ended
