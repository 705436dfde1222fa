"""The flat weight buffer generators read over RDMA carries its dtype."""

from __future__ import annotations

import pytest
import torch

from meshrl.inference.weights import flatten_weights, unflatten_weights


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
