from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TINY_VOCAB = 97


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised float64 two-layer Llama built in memory: nothing is downloaded."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).double()


@pytest.fixture
def tiny_lm() -> LlamaForCausalLM:
    return tiny_llama(0)
