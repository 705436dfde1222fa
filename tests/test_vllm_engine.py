"""VLLMEngine's request/response mapping, on data shaped like vLLM's outputs; the engine itself on a GPU with vLLM."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch

from meshrl.inference.completion import Completion, request_seeds
from meshrl.inference.vllm_engine import add_output, to_prompt_inputs, to_sampling_kwargs


# Shapes of vllm.logprobs.Logprob, vllm.outputs.CompletionOutput and vllm.outputs.RequestOutput (fields we read).
@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


def request_output(prompt, tokens, logprobs, finish_reason="stop", per_position=None) -> RequestOutput:
    positions = per_position or [{token: Logprob(lp, rank=1)} for token, lp in zip(tokens, logprobs)]
    sample = CompletionOutput(0, "", tokens, sum(logprobs), positions, finish_reason, None)
    return RequestOutput("0", prompt, [sample])


def complete(prompt: list[int], output: RequestOutput, version: int = 0) -> Completion:
    """A turn from one finished output."""
    turn = Completion(prompt, [], [], "length")
    assert add_output(turn, output, version)
    return turn


def test_importing_the_module_does_not_import_vllm():
    # A fresh interpreter, so other tests that start vLLM cannot have imported it already.
    check = "import sys, meshrl.inference.vllm_engine; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], check=True)


def test_sampling_kwargs_ask_for_one_sample_with_its_logprob_and_no_text():
    kwargs = to_sampling_kwargs(temperature=0.7, top_p=0.9, max_new_tokens=32, stop_token_ids=[5, 9], seed=11)
    assert kwargs == {
        "n": 1,
        "temperature": 0.7,
        "top_p": 0.9,
        "max_tokens": 32,
        "stop_token_ids": [5, 9],
        "logprobs": 0,
        "seed": 11,
        "detokenize": False,
    }
    assert (
        to_sampling_kwargs(temperature=0.0, top_p=1.0, max_new_tokens=1, stop_token_ids=None, seed=None)[
            "stop_token_ids"
        ]
        == []
    )


def test_request_seeds_are_reproducible_and_distinct_for_duplicated_prompts():
    assert request_seeds(None, 3) == [None, None, None]
    seeds = request_seeds(7, 8)
    assert seeds == request_seeds(7, 8)
    assert len(set(seeds)) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert seeds != request_seeds(8, 8)


def test_prompt_inputs_are_token_prompts_salted_by_policy_version():
    prompts = [[1, 2, 3], [4]]
    inputs = to_prompt_inputs(prompts, version=3)
    assert inputs == [{"prompt_token_ids": [1, 2, 3], "cache_salt": "policy-3"},
                      {"prompt_token_ids": [4], "cache_salt": "policy-3"}]  # fmt: skip
    assert inputs[0]["prompt_token_ids"] is not prompts[0]
    # the same ids under another version share no prefix-cache blocks with these
    assert {i["cache_salt"] for i in to_prompt_inputs(prompts, version=4)}.isdisjoint({"policy-3"})


def test_a_stopped_request_becomes_a_completion_ending_in_its_stop_token():
    out = complete([1, 2], request_output([1, 2], [7, 8, 3], [-0.5, -1.25, -0.01]))
    expected = Completion([1, 2], [7, 8, 3], [-0.5, -1.25, -0.01], finish_reason="stop", versions=[0, 0, 0])
    assert out == expected


def test_delta_outputs_accumulate_and_each_token_keeps_the_version_that_sampled_it():
    turn = Completion([1], [], [], "length")
    first = request_output([1], [7, 8], [-0.5, -1.0])
    first.finished = False
    assert not add_output(turn, first, version=3)
    later = request_output(None, [9], [-0.2], finish_reason="length")
    assert add_output(turn, later, version=4)  # the weights changed between two engine steps
    assert turn == Completion([1], [7, 8, 9], [-0.5, -1.0, -0.2], "length", versions=[3, 3, 4])


def test_the_sampled_tokens_logprob_is_read_when_other_tokens_are_listed():
    # With logprobs=1 vLLM also lists the top token; only the sampled one's logprob counts.
    positions = [{7: Logprob(-2.0, rank=3), 4: Logprob(-0.1, rank=1)}, {9: Logprob(-0.3, rank=1)}]
    out = complete([1], request_output([1], [7, 9], [-2.0, -0.3], "length", positions))
    assert out.logprobs == [-2.0, -0.3] and out.finish_reason == "length"


def test_outputs_that_break_the_contract_are_refused():
    with pytest.raises(ValueError, match="no logprob"):
        complete([1], request_output([1], [7, 8], [-0.5], per_position=[{7: Logprob(-0.5)}]))
    missing = request_output([1], [7], [-0.5])
    missing.outputs[0].logprobs = None
    with pytest.raises(ValueError, match="no logprob"):
        complete([1], missing)
    with pytest.raises(ValueError, match="abort"):
        complete([1], request_output([1], [7], [-0.5], finish_reason="abort"))
    with pytest.raises(ValueError, match="different prompt"):
        complete([1, 2], request_output([2, 1], [7], [-0.5]))


@pytest.mark.gpu
@pytest.mark.slow
def test_the_engine_on_the_tiny_model(tmp_path):
    pytest.importorskip("vllm")
    from meshrl.configs.schema import TinyModelConfig
    from meshrl.inference.hf_engine import top_p_filter
    from meshrl.inference.vllm_engine import VLLMEngine
    from meshrl.models.tiny import build_model, build_tokenizer, ensure_tiny

    spec = TinyModelConfig(hidden_size=128, num_heads=2)  # head size 64: every vLLM attention backend takes it
    directory = ensure_tiny(tmp_path / "tiny", spec)
    engine = VLLMEngine(
        str(directory), dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=512
    )
    reference = build_model(spec, build_tokenizer(spec.vocab_size)).cuda().eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23]]

    sampled = engine.generate(prompts, temperature=0.8, top_p=0.9, max_new_tokens=16, seed=1)
    assert sampled == engine.generate(prompts, temperature=0.8, top_p=0.9, max_new_tokens=16, seed=1)
    for completion in sampled:
        ids = torch.tensor([completion.prompt_ids + completion.completion_ids], device="cuda")
        with torch.no_grad():
            logits = reference(ids).logits[0, len(completion.prompt_ids) - 1 : -1].float() / 0.8
        expected = torch.log_softmax(top_p_filter(logits, 0.9), -1)
        expected = expected.gather(-1, ids[0, len(completion.prompt_ids) :, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(completion.logprobs, device="cuda"), expected, rtol=0, atol=1e-3)

    greedy = engine.generate(prompts, temperature=0.0, top_p=1.0, max_new_tokens=8)
    stop = greedy[0].completion_ids[2]
    stopped = engine.generate(prompts, temperature=0.0, top_p=1.0, max_new_tokens=8, stop_token_ids=[stop])
    end = greedy[0].completion_ids.index(stop) + 1
    assert stopped[0].completion_ids == greedy[0].completion_ids[:end] and stopped[0].finish_reason == "stop"

    other = build_model(spec, build_tokenizer(spec.vocab_size), seed=1)
    engine.load_weights(other.state_dict(), version=2)
    assert engine.version == 2
    assert engine.generate(prompts, temperature=0.0, top_p=1.0, max_new_tokens=8) != greedy
