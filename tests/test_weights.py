"""Weights generators read without pickling: the flat RDMA buffer carries its dtype; the
published safetensors file (filesystem sync) handles tied embeddings."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from meshrl.configs import load_config
from meshrl.inference.hf_engine import HFEngine
from meshrl.inference.weights import flatten_weights, save_weights_file, unflatten_weights
from meshrl.models.tiny import ensure_tiny


def test_a_bf16_buffer_is_read_back_bit_exact():
    weights = {"embed": torch.randn(7, 3), "norm": torch.randn(3), "head": torch.randn(2, 3)}
    flat, layout = flatten_weights(weights, torch.bfloat16)
    received = layout.empty()  # what a generator allocates before `read_into`
    assert received.dtype == torch.bfloat16 and received.shape == flat.shape
    received.view(torch.int16).copy_(flat.view(torch.int16))  # RDMA moves bytes
    got = unflatten_weights(received, layout)
    for name, value in weights.items():
        assert torch.equal(got[name], value.to(torch.bfloat16)), name


def test_a_buffer_of_another_dtype_is_refused():
    flat, layout = flatten_weights({"w": torch.randn(4)}, torch.bfloat16)
    with pytest.raises(ValueError, match="does not match its layout"):
        unflatten_weights(flat.float(), layout)


def test_a_published_weights_file_stores_tied_weights_once_and_loads_into_a_tied_model(tmp_path):
    config = load_config(["--model.tiny.family", "qwen3", "--model.tiny.tie_embeddings", "true"])
    path = ensure_tiny(tmp_path / "model", config.model.tiny)
    trained = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for param in trained.parameters():
            param.add_(torch.randn_like(param))
    weights = trained.state_dict()
    assert weights["lm_head.weight"].data_ptr() == weights["model.embed_tokens.weight"].data_ptr()  # tied

    published = tmp_path / "weights" / "step_3.safetensors"
    save_weights_file(weights, published)
    assert sorted(p.name for p in published.parent.iterdir()) == ["step_3.safetensors"]  # no partial left
    loaded = load_file(published)
    assert "lm_head.weight" not in loaded and len(loaded) == len(weights) - 1

    engine = HFEngine(AutoModelForCausalLM.from_pretrained(path), eos_token_ids=[0])
    engine.load_weights(loaded, version=3)
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, weights[name]), name  # the head too, through the tie
