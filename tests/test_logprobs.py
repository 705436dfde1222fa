"""Chunked LM-head logprobs equal the naive full-logits path, forward and backward."""

from __future__ import annotations

import pytest
import torch

from meshrl.loss_adapters.logprobs import chunked_token_logprobs, naive_token_logprobs, sequence_token_logprobs


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_equals_naive_values_and_gradients(chunk_size, temperature):
    torch.manual_seed(0)
    hidden = torch.randn(53, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(301, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 301, (53,))
    upstream = torch.randn(53, dtype=torch.float64)  # a non-uniform incoming gradient

    naive = naive_token_logprobs(hidden, weight, labels, temperature)
    g_hidden, g_weight = torch.autograd.grad((naive * upstream).sum(), (hidden, weight))
    chunked = chunked_token_logprobs(hidden, weight, labels, chunk_size, temperature)
    c_hidden, c_weight = torch.autograd.grad((chunked * upstream.float()).sum(), (hidden, weight))

    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, naive.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c_hidden, g_hidden, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(c_weight, g_weight, rtol=1e-4, atol=1e-5)


def test_chunked_gradcheck():
    torch.manual_seed(1)
    hidden = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 13, (9,))

    def fn(h, w):  # float64 end to end for gradcheck: logits cast to float32 inside, so compare loosely
        return chunked_token_logprobs(h, w, labels, 4).double()

    assert torch.autograd.gradcheck(fn, (hidden, weight), eps=1e-3, atol=1e-3, rtol=1e-3)


def test_bfloat16_inputs_keep_their_dtype_in_gradients():
    torch.manual_seed(2)
    hidden = torch.randn(20, 8, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(50, 8, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 50, (20,))
    out = chunked_token_logprobs(hidden, weight, labels, 6)
    out.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    reference = naive_token_logprobs(hidden.float(), weight.float(), labels)
    torch.testing.assert_close(out, reference, rtol=2e-2, atol=2e-2)


def test_sequence_logprobs_match_the_models_own_logits(tiny_lm):
    ids = torch.randint(0, 97, (3, 12))
    got = sequence_token_logprobs(tiny_lm, ids, chunk_size=5)
    logits = tiny_lm(input_ids=ids).logits
    expected = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert got.shape == ids.shape and torch.all(got[:, 0] == 0)
    torch.testing.assert_close(got[:, 1:], expected, rtol=1e-5, atol=1e-5)


def test_scoring_only_the_loss_positions_gives_their_logprobs_and_gradients(tiny_lm):
    """`positions` skips the head for the other tokens: the scored ones are unchanged, in value and in
    the gradient a masked loss sends to every parameter; the rest are 0."""
    torch.manual_seed(3)
    ids = torch.randint(0, 97, (3, 12))
    positions = torch.rand(3, 12) < 0.4
    positions[:, 0] = True  # position 0 has no prefix: 0 either way
    weights = torch.randn(3, 12)
    full = sequence_token_logprobs(tiny_lm, ids, chunk_size=5)
    expected = torch.autograd.grad((full * weights * positions).sum(), list(tiny_lm.parameters()))
    some = sequence_token_logprobs(tiny_lm, ids, chunk_size=5, positions=positions)
    got = torch.autograd.grad((some * weights * positions).sum(), list(tiny_lm.parameters()))
    torch.testing.assert_close(some, torch.where(positions, full, 0.0))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_label_count_mismatch_is_refused():
    with pytest.raises(ValueError, match="rows"):
        chunked_token_logprobs(torch.randn(4, 2), torch.randn(5, 2), torch.zeros(3, dtype=torch.long))
