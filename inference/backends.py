"""The inference engine a run's `generator.backend` selects."""

from __future__ import annotations

import os
from typing import Any

from meshrl.inference.hf_engine import HFEngine


def make_engine(backend: str, model_path: str, dtype: str, gpus: list[int]) -> Any:
    """An HFEngine on the first of `gpus` (CPU when none), or a VLLMEngine on its one GPU (vLLM
    is an optional extra, imported only when asked for; the config refuses it without one GPU)."""
    if backend == "vllm":
        from meshrl.inference.vllm_engine import VLLMEngine

        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))  # read when vLLM initialises CUDA
        return VLLMEngine(model_path, dtype=dtype)
    return HFEngine.from_pretrained(model_path, dtype=dtype, device=f"cuda:{gpus[0]}" if gpus else "cpu")
