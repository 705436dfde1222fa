"""The inference engine a run's `generator.backend` selects."""

from __future__ import annotations

from typing import Any

from meshrl.inference.hf_engine import HFEngine


def make_engine(backend: str, model_path: str, dtype: str) -> Any:
    """An HFEngine, or a VLLMEngine (vLLM is an optional extra, imported only when asked for)."""
    if backend == "vllm":
        from meshrl.inference.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, dtype=dtype)
    return HFEngine.from_pretrained(model_path, dtype=dtype)
