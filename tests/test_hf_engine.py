"""HFEngine, on its own decode loop ("rows") and on transformers' continuous batching: logprobs equal
a teacher-forced forward, left padding is invisible, stops, updates and seeds behave."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, tiny_llama
from transformers import LlamaForCausalLM

from meshrl.inference.hf_continuous import ContinuousHFEngine
from meshrl.inference.hf_engine import HFEngine, Sequence, sample_rows
from meshrl.models.tiny import ensure_tiny, load_tokenizer

VOCAB = TINY_VOCAB
EOS = 96
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23], [30]]  # different lengths: left padding


def peaked_llama(seed: int) -> LlamaForCausalLM:
    """conftest's tiny Llama with the head scaled up, so distributions are peaked and top-p drops many tokens."""
    model = tiny_llama(seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    return model


@pytest.fixture
def model() -> LlamaForCausalLM:
    return peaked_llama(0)


@pytest.fixture(params=["rows", "continuous"])
def kind(request) -> str:
    """Each test of the engines' shared contract runs on both HF engines."""
    return request.param


def engine_for(model: LlamaForCausalLM, eos: int = EOS, kind: str = "rows") -> HFEngine:
    if kind == "continuous":
        return ContinuousHFEngine(model, eos_token_ids=[eos], kv_tokens=2048)
    return HFEngine(model, eos_token_ids=[eos])


def close(*engines: HFEngine) -> None:
    for engine in engines:
        if isinstance(engine, ContinuousHFEngine):
            engine.close()


# Continuous batching runs every request in one varlen forward over a paged cache: its float32
# logprobs match a teacher-forced forward to rounding, not bit for bit as the rows' loop does.
ATOL = {"rows": 1e-9, "continuous": 2e-5}


def reference_logprobs(
    model: LlamaForCausalLM, prompt: list[int], completion: list[int], temperature: float, top_p: float
) -> torch.Tensor:
    """Teacher-forced logprobs of `completion`, with the nucleus found by walking the sorted probabilities."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    if temperature == 0:
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
    logits = logits / temperature
    out = []
    for row, token in zip(logits, completion):
        probs = row.softmax(-1)
        kept, mass = [], 0.0
        for index in probs.argsort(descending=True).tolist():
            if mass >= top_p:
                break
            kept.append(index)
            mass += probs[index].item()
        assert token in kept, "a token outside the nucleus was sampled"
        out.append(row[token] - torch.logsumexp(row[kept], -1))
    return torch.stack(out)


def one_row(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> tuple[int, float]:
    """The sampler as it drew one row at a time (a host round trip per row and token)."""
    if temperature == 0:
        return int(logits.argmax()), float(torch.log_softmax(logits, -1)[int(logits.argmax())])
    scaled = logits / temperature
    if top_p < 1.0:
        ordered, order = scaled.sort(descending=True)
        probs = ordered.softmax(-1)
        outside = (probs.cumsum(-1) - probs) >= top_p
        scaled = scaled.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
    logprobs = torch.log_softmax(scaled, -1)
    token = int(torch.multinomial(logprobs.exp(), 1, generator=generator))
    return token, float(logprobs[token])


def test_all_rows_at_once_draw_what_one_row_at_a_time_drew():
    """Same seeds, same tokens and logprobs, rows of mixed temperature and top-p, over many steps."""
    settings = [(1.0, 1.0), (0.7, 0.8), (0.0, 1.0), (1.3, 0.5), (1.0, 0.95)]
    seqs = [Sequence([1], seed, torch.device("cpu")) for seed in range(len(settings))]
    reference = [torch.Generator().manual_seed(seed) for seed in range(len(settings))]
    for seq, (temperature, top_p) in zip(seqs, settings):
        seq.temperature, seq.top_p = temperature, top_p
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(len(settings), VOCAB, generator=g) * 4
        tokens, logprobs = sample_rows(logits, seqs)
        for i, (temperature, top_p) in enumerate(settings):
            token, logprob = one_row(logits[i], temperature, top_p, reference[i])
            assert tokens[i] == token and logprobs[i] == pytest.approx(logprob, abs=1e-6), (i, temperature, top_p)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8), (1.3, 0.5), (0.0, 1.0)])
def test_logprobs_equal_a_teacher_forced_forward(model, kind, temperature, top_p):
    completions = engine_for(model, kind=kind).generate(
        PROMPTS, temperature=temperature, top_p=top_p, max_new_tokens=12, seed=3
    )
    for prompt, completion in zip(PROMPTS, completions):
        assert completion.prompt_ids == prompt
        assert len(completion.logprobs) == len(completion.completion_ids) > 0
        expected = reference_logprobs(model, prompt, completion.completion_ids, temperature, top_p)
        torch.testing.assert_close(
            torch.tensor(completion.logprobs, dtype=torch.float64), expected, rtol=0, atol=ATOL[kind]
        )


def test_greedy_is_the_argmax_chain_and_the_same_alone_or_batched(model, kind):
    engine = engine_for(model, kind=kind)
    batched = engine.generate(PROMPTS, temperature=0.0, top_p=1.0, max_new_tokens=10)
    for prompt, completion in zip(PROMPTS, batched):
        alone = engine.generate([prompt], temperature=0.0, top_p=1.0, max_new_tokens=10)[0]
        assert alone.completion_ids == completion.completion_ids
        torch.testing.assert_close(
            torch.tensor(alone.logprobs), torch.tensor(completion.logprobs), rtol=0, atol=ATOL[kind]
        )
        ids = torch.tensor([prompt + completion.completion_ids])
        with torch.no_grad():
            argmax = model(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
        assert argmax.tolist() == completion.completion_ids


def test_stop_tokens_end_rows_and_are_included(model, kind):
    engine = engine_for(model, kind=kind)
    free = engine.generate(PROMPTS, temperature=0.0, top_p=1.0, max_new_tokens=10)
    stop = free[0].completion_ids[3]
    assert stop not in free[0].completion_ids[:3]  # the fixture's greedy chain; row 0 stops after 4 tokens

    stopped = engine.generate(PROMPTS, temperature=0.0, top_p=1.0, max_new_tokens=10, stop_token_ids=[stop])
    as_eos = engine_for(model, eos=stop, kind=kind).generate(PROMPTS, temperature=0.0, top_p=1.0, max_new_tokens=10)
    for full, cut, by_eos in zip(free, stopped, as_eos):
        if stop in full.completion_ids:
            end = full.completion_ids.index(stop) + 1
            assert cut.completion_ids == full.completion_ids[:end] and cut.finish_reason == "stop"
            assert cut.logprobs == pytest.approx(full.logprobs[:end], abs=1e-12 if kind == "rows" else ATOL[kind])
        else:
            assert cut.completion_ids == full.completion_ids and cut.finish_reason == "length"
        assert (by_eos.completion_ids, by_eos.finish_reason) == (cut.completion_ids, cut.finish_reason)
    assert stopped[0].completion_ids[-1] == stop and len(stopped[0].completion_ids) == 4


def test_length_finish_when_no_stop_is_drawn(model, kind):
    completions = engine_for(model, kind=kind).generate(PROMPTS, temperature=0.0, top_p=1.0, max_new_tokens=5)
    drawn = {token for c in completions for token in c.completion_ids}
    unused = next(t for t in range(VOCAB) if t not in drawn)
    again = engine_for(model, eos=unused, kind=kind).generate(PROMPTS, temperature=0.0, top_p=1.0, max_new_tokens=5)
    assert all(c.finish_reason == "length" and len(c.completion_ids) == 5 for c in again)


def test_a_seed_reproduces_its_samples_and_another_seed_differs(model):
    engine = engine_for(model)
    run = lambda seed: engine.generate(PROMPTS, temperature=1.0, top_p=0.9, max_new_tokens=12, seed=seed)  # noqa: E731
    first, again, other = run(7), run(7), run(8)
    assert first == again
    assert [c.completion_ids for c in first] != [c.completion_ids for c in other]


def test_a_tiny_top_p_samples_the_greedy_chain_with_certainty(model, kind):
    engine = engine_for(model, kind=kind)
    greedy = engine.generate(PROMPTS, temperature=0.0, top_p=1.0, max_new_tokens=10)
    nucleus_of_one = engine.generate(PROMPTS, temperature=1.0, top_p=1e-6, max_new_tokens=10, seed=0)
    for g, n in zip(greedy, nucleus_of_one):
        assert n.completion_ids == g.completion_ids
        assert n.logprobs == [0.0] * len(n.logprobs)


def test_load_weights_swaps_the_policy_and_sets_the_version(model, kind):
    engine = engine_for(model, kind=kind)
    other = peaked_llama(1)
    before = engine.generate(PROMPTS, temperature=0.0, top_p=1.0, max_new_tokens=8)
    assert engine.version == 0

    engine.load_weights(other.state_dict(), version=3)
    after = engine.generate(PROMPTS, temperature=0.0, top_p=1.0, max_new_tokens=8)
    assert engine.version == 3
    reference = engine_for(other).generate(PROMPTS, temperature=0.0, top_p=1.0, max_new_tokens=8)
    assert [c.completion_ids for c in after] == [c.completion_ids for c in reference]
    for got, expected in zip(after, reference):
        assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-12 if kind == "rows" else ATOL[kind])
    assert {v for c in after for v in c.versions} == {3}
    assert [c.completion_ids for c in after] != [c.completion_ids for c in before]


def test_a_bad_update_is_refused_whole(model, kind):
    engine = engine_for(model, kind=kind)
    good = peaked_llama(1).state_dict()
    snapshot = {name: t.clone() for name, t in model.state_dict().items()}
    with pytest.raises(KeyError, match="not in the model"):
        engine.load_weights({**good, "module.lm_head.weight": good["lm_head.weight"]}, version=1)
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights({**good, "lm_head.weight": good["lm_head.weight"][:5]}, version=1)
    assert engine.version == 0
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, snapshot[name])


def test_from_pretrained_reads_eos_from_the_saved_model(tmp_path):
    directory = ensure_tiny(tmp_path / "tiny")
    tokenizer = load_tokenizer(directory)
    engine = HFEngine.from_pretrained(str(directory))
    assert engine.eos_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    messages = [{"role": "user", "content": "run the tests"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    (completion,) = engine.generate([prompt], temperature=1.0, top_p=0.95, max_new_tokens=6, seed=0)
    assert 1 <= len(completion.completion_ids) <= 6


def test_arguments_both_backends_would_read_differently_are_refused(model, kind):
    engine = engine_for(model, kind=kind)
    assert engine.generate([], temperature=1.0, top_p=1.0, max_new_tokens=4) == []
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[1, 2], []], temperature=1.0, top_p=1.0, max_new_tokens=4)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(PROMPTS, temperature=1.0, top_p=0.0, max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(PROMPTS, temperature=-1.0, top_p=1.0, max_new_tokens=4)


def test_new_episodes_prefill_in_batches_within_the_token_budget(model, monkeypatch):
    """New sequences prefill together, left-padded, in forwards of at most PREFILL_TOKENS padded
    tokens; how they are grouped changes no sample and no logprob."""
    import meshrl.inference.hf_engine as hf_engine

    forwards = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: forwards.append(k["input_ids"].shape) or forward(*a, **k))
    together = engine_for(model).generate(PROMPTS, temperature=1.0, top_p=0.9, max_new_tokens=8, seed=5)
    assert forwards[0] == (4, 7)  # every prompt in the first forward
    forwards.clear()
    monkeypatch.setattr(hf_engine, "PREFILL_TOKENS", 8)
    grouped = engine_for(model).generate(PROMPTS, temperature=1.0, top_p=0.9, max_new_tokens=8, seed=5)
    assert forwards[:3] == [(1, 7), (2, 4), (1, 1)]  # longest first, at most 8 padded tokens each
    for a, b in zip(together, grouped, strict=True):
        assert a.completion_ids == b.completion_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-6)


def test_continuous_turns_continue_a_conversation_and_an_update_stamps_each_token():
    """A second turn of a conversation (tool ids appended) is scored over the whole conversation; an
    update mid-turn pauses the loop: tokens before it carry the old version and the old weights'
    logprobs, tokens after it the new version."""
    model = peaked_llama(0)
    engine = engine_for(model, kind="continuous")
    seqs = [engine.sequence(prompt) for prompt in PROMPTS[:2]]
    batch = engine.batch()
    engine.begin_turns(seqs, temperature=1.0, top_p=1.0, max_new_tokens=6)
    for seq in seqs:
        batch.add(seq)
    while len(batch):
        batch.step()
    for seq in seqs:
        seq.extend([40, 41, 42])  # a tool's result
    first = [seq.turn for seq in seqs]
    engine.begin_turns(seqs, temperature=1.0, top_p=1.0, max_new_tokens=6)
    for seq in seqs:
        batch.add(seq)
    while len(batch):
        batch.step()
    for seq, earlier in zip(seqs, first):
        turn = seq.turn
        assert turn.prompt_ids == earlier.prompt_ids + earlier.completion_ids + [40, 41, 42]
        expected = reference_logprobs(model, turn.prompt_ids, turn.completion_ids, 1.0, 1.0)
        torch.testing.assert_close(torch.tensor(turn.logprobs, dtype=torch.float64), expected, rtol=0, atol=2e-5)

    before = copy.deepcopy(model)
    seq = engine.sequence(PROMPTS[0])
    engine.begin_turns([seq], temperature=1.0, top_p=1.0, max_new_tokens=400, stop_token_ids=[])
    batch.add(seq)
    while not seq.turn.completion_ids:
        batch.step()
    engine.load_weights(peaked_llama(1).state_dict(), version=1)
    while len(batch):
        batch.step()
    versions = seq.turn.versions
    cut = versions.index(1)
    assert 0 < cut and versions == [0] * cut + [1] * (len(versions) - cut)
    expected = reference_logprobs(before, PROMPTS[0], seq.turn.completion_ids[:cut], 1.0, 1.0)
    torch.testing.assert_close(torch.tensor(seq.turn.logprobs[:cut], dtype=torch.float64), expected, rtol=0, atol=2e-5)
    engine.close()


def test_a_process_with_a_continuous_engine_left_open_still_exits():
    """transformers' generation loop is not a daemon thread: an engine nobody closed (an eval that
    raised) is closed at exit, so its process ends instead of hanging."""
    import subprocess
    import sys

    here = Path(__file__).parent
    script = (
        f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]\n"
        "from meshrl.inference.hf_continuous import ContinuousHFEngine\n"
        "from test_hf_engine import peaked_llama\n"
        "engine = ContinuousHFEngine(peaked_llama(0), [96], kv_tokens=2048)\n"
        "engine.generate([[5, 6, 7]], temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0)\n"
        "raise SystemExit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], timeout=120, capture_output=True, text=True)
    assert done.returncode == 3, done.stderr[-2000:]
