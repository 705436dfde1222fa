"""TraceCollator against the chat-templated token stream of a locally built tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshrl.models.tiny import build_tokenizer
from meshrl.rollouts.packing import Encoded
from meshrl.traces.collator import TraceCollator, _through_divergence, to_message
from meshrl.traces.schema import TraceExample


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512)


def _trace(trace_id: str = "t1", reward: float | None = 1.0, n_errors: int = 1) -> TraceExample:
    turns = [{"role": "system", "content": "You are a careful coding agent."},
             {"role": "user", "content": "Run the tests and fix what fails."}]  # fmt: skip
    for i in range(n_errors):
        turns += [
            {"role": "assistant", "content": f"Running them ({i}).",
             "tool_calls": [{"id": f"c{i}", "name": "bash", "arguments": {"cmd": "pytest -q", "n": i}}]},
            {"role": "tool", "content": "bash: pytest: command not found", "tool_call_id": f"c{i}", "is_error": True},
            {"role": "assistant", "content": f"pip install pytest first, attempt {i}.", "tool_error": "command_not_found",
             "error_meta": {"tool_name": "bash", "excerpt": "bash: pytest: command not found"}},
        ]  # fmt: skip
    turns.append({"role": "user", "content": "thanks"})
    return TraceExample(trace_id=trace_id, source="test", turns=turns, final_reward=reward)


def _assistant_texts(trace: TraceExample) -> list[str]:
    """What each assistant turn renders to under the tiny template (content + tool calls)."""
    out = []
    for t in trace.turns:
        if t.role == "assistant":
            calls = "".join(
                f'\n<tool_call>{{"name": "{c.name}", "arguments": {_json(c.arguments)}}}</tool_call>'
                for c in t.tool_calls or []
            )
            out.append(t.content + calls)
    return out


def _json(value) -> str:
    import json

    return json.dumps(value)


def hint(kind: str, meta: dict) -> str:
    return f"Hint: the {meta['tool_name']} call failed with {kind}; install the tool first."


def test_loss_mask_covers_exactly_the_assistant_turns(tok):
    trace = _trace(n_errors=2)
    batch = TraceCollator(tok)([trace]).batch
    ids, mask = batch["input_ids"][0], batch["loss_mask"][0]
    assert torch.equal(ids, torch.tensor(tok.apply_chat_template([to_message(t) for t in trace.turns])["input_ids"]))
    assert tok.decode(ids[mask], skip_special_tokens=True) == "".join(_assistant_texts(trace))
    # every masked run ends on the end-of-turn token, which the model must learn to emit
    runs_end = mask & ~torch.cat([mask[1:], torch.tensor([False])])
    assert (ids[runs_end] == tok.convert_tokens_to_ids("<|im_end|>")).all()
    assert int(runs_end.sum()) == 4
    assert "inference_logprobs" not in batch  # the trace carries none


def test_hermes_template_masks_the_assistant_turns_and_not_the_tool_responses():
    hermes = build_tokenizer(512, "hermes")
    trace = _trace(n_errors=2)
    batch = TraceCollator(hermes)([trace]).batch
    ids, mask = batch["input_ids"][0], batch["loss_mask"][0]
    assert torch.equal(ids, torch.tensor(hermes.apply_chat_template([to_message(t) for t in trace.turns])["input_ids"]))
    hermes_texts = [text.replace("\n<tool_call>", "\n<tool_call>\n").replace("</tool_call>", "\n</tool_call>")
                    for text in _assistant_texts(trace)]  # fmt: skip
    assert hermes.decode(ids[mask], skip_special_tokens=True) == "".join(hermes_texts)
    assert "<tool_response>" in hermes.decode(ids[~mask]) and "<tool_response>" not in hermes.decode(ids[mask])


def test_masks_do_not_depend_on_segment_tokenization(tok):
    """A span that starts mid-word in segment tokenization still lines up with the template's tokens."""
    trace = TraceExample(trace_id="x", source="t", turns=[
        {"role": "user", "content": "say ab"}, {"role": "assistant", "content": "abab  ab\n\nab"}])  # fmt: skip
    batch = TraceCollator(tok)([trace]).batch
    assert tok.decode(batch["input_ids"][0][batch["loss_mask"][0]], skip_special_tokens=True) == "abab  ab\n\nab"


def test_sdpo_rows_align_recovery_tokens_and_decode_to_the_recovery_text(tok):
    trace = _trace(n_errors=2)
    batch = TraceCollator(tok, hint_generator=hint)([trace, _trace("t2", n_errors=0)]).batch
    student, teacher, mask = batch["sdpo_student_input_ids"], batch["sdpo_teacher_input_ids"], batch["sdpo_loss_mask"]
    assert student.shape == teacher.shape == mask.shape and student.shape[0] == 2  # one row per error site
    recoveries = [t.content for t in trace.turns if t.tool_error]
    for row in range(2):
        on = mask[row] == 1
        assert set(mask[row].tolist()) <= {1, -100}
        assert torch.equal(student[row][on], teacher[row][on])
        assert tok.decode(teacher[row][on], skip_special_tokens=True) == recoveries[row]
        teacher_text = tok.decode(teacher[row][batch["sdpo_teacher_attention_mask"][row] == 1])
        student_text = tok.decode(student[row][batch["sdpo_student_attention_mask"][row] == 1])
        assert "Hint: the bash call failed with command_not_found" in teacher_text
        assert "Hint" not in student_text
        # the hint sits right before the recovery turn; the student is the plain prefix through it
        assert teacher_text.index("Hint") > teacher_text.index("command not found")
        assert student_text.endswith(recoveries[row] + "<|im_end|>\n")
    # attention covers the real tokens only, left-padded; positions count real tokens
    am = batch["sdpo_student_attention_mask"]
    assert torch.equal(batch["sdpo_student_position_ids"][am == 1][: int(am[0].sum())], torch.arange(int(am[0].sum())))


def test_no_hint_generator_or_no_error_sites_means_no_sdpo_keys(tok):
    assert "sdpo_loss_mask" not in TraceCollator(tok)([_trace()]).batch
    assert "sdpo_loss_mask" not in TraceCollator(tok, hint_generator=hint)([_trace(n_errors=0)]).batch
    assert "sdpo_loss_mask" not in TraceCollator(tok, hint_generator=lambda k, m: None)([_trace()]).batch


def test_dpo_rows_mask_the_response_after_the_generation_prompt(tok):
    state = [{"role": "user", "content": "list the files"}]
    pair = {"state_messages": state, "chosen": {"role": "assistant", "content": "",
            "tool_calls": [{"id": "a", "name": "bash", "arguments": {"cmd": "ls"}}]},
            "rejected": {"role": "assistant", "content": "I cannot do that."}}  # fmt: skip
    batch = TraceCollator(tok)([], pairs=[pair, pair]).batch
    prompt = tok.apply_chat_template(state, add_generation_prompt=True)["input_ids"]
    # the chosen response whole; the rejected one through its first token unlike the chosen's
    first = tok("I cannot do that.", add_special_tokens=False)["input_ids"][0]
    for side, text in (("chosen", '\n<tool_call>{"name": "bash", "arguments": {"cmd": "ls"}}</tool_call>'),
                       ("rejected", tok.decode([first]))):  # fmt: skip
        ids, mask = batch[f"dpo_{side}_input_ids"][0], batch[f"dpo_{side}_response_mask"][0].bool()
        assert ids[: len(prompt)].tolist() == prompt and not mask[: len(prompt)].any()
        assert tok.decode(ids[mask], skip_special_tokens=True) == text
        assert batch[f"dpo_{side}_attention_mask"].shape == batch[f"dpo_{side}_input_ids"].shape
    rejected = batch["dpo_rejected_input_ids"][0][batch["dpo_rejected_attention_mask"][0].bool()]
    assert "I cannot do that." in tok.decode(rejected)  # the row holds the whole turn; the loss sees its start


def test_a_sampled_rejected_turn_is_scored_through_its_first_token_unlike_the_teachers(tok):
    """The student's sampled call goes wrong at the key and then rambles (ids the policy gives almost
    no probability): the rejected row is scored from the turn's start through the wrong key, not the
    ramble after it. A rejected turn that is a prefix of the chosen one (cut off) is scored whole."""
    state = [{"role": "user", "content": 'Value of "k"?'}]
    before = tok.apply_chat_template(state, add_generation_prompt=True)["input_ids"]
    good = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "a", "name": "lookup", "arguments": {"key": "k"}}],
    }
    collator = TraceCollator(tok)
    chosen_ids = collator.reply_ids(state, good).tolist()
    head = tok('\n<tool_call>{"name": "lookup", "arguments": {"key": "', add_special_tokens=False)["input_ids"]
    assert chosen_ids[: len(head)] == head and tok.decode(chosen_ids[len(head) :]).startswith("k")
    ramble = head + tok('x"}} lookup lookup ls cd , }}</tool_call>', add_special_tokens=False)["input_ids"]
    cut_off = chosen_ids[: len(head) + 1]  # stopped at the token limit right after the right key
    pairs = [
        {"trace_id": "t", "turn_index": 1, "state_messages": state, "chosen": good, "rejected": {"role": "assistant"},
         "prompt_token_ids": before, "rejected_token_ids": sampled}
        for sampled in (ramble, cut_off)
    ]  # fmt: skip
    batch = collator([], pairs=pairs).batch
    scored = [
        batch["dpo_rejected_input_ids"][i][batch["dpo_rejected_response_mask"][i].bool()].tolist() for i in range(2)
    ]
    assert scored[0] == ramble[: len(head) + 1] and tok.decode(scored[0][-1:]) == "x"
    assert scored[1] == cut_off
    for i, sampled in enumerate((ramble, cut_off)):  # the rows still hold every sampled id
        row = batch["dpo_rejected_input_ids"][i][batch["dpo_rejected_attention_mask"][i].bool()].tolist()
        assert row == before + sampled
        chosen = batch["dpo_chosen_input_ids"][i][batch["dpo_chosen_response_mask"][i].bool()].tolist()
        assert chosen == chosen_ids


def test_advantages_default_to_reward_minus_batch_mean(tok):
    batch = TraceCollator(tok)([_trace("a", 1.0), _trace("b", 0.0), _trace("c", None)]).batch
    advs = batch["advantages"]
    assert advs[0][batch["attention_mask"][0] == 1].unique().tolist() == [0.5]
    assert advs[1][batch["attention_mask"][1] == 1].unique().tolist() == [-0.5]
    assert advs[2].abs().sum() == 0 and torch.isnan(batch["rewards"][2])
    given = TraceCollator(tok)([_trace("a"), _trace("b")], advantages=[2.0, -1.0]).batch["advantages"]
    assert given[0, 0] == 2.0 and given[1, 0] == -1.0


def test_packing_first_fit_decreasing_with_position_resets(tok):
    traces = [_trace(str(i), n_errors=i % 3) for i in range(7)]
    plain = TraceCollator(tok)(traces).batch
    lengths = plain["attention_mask"].sum(1).tolist()
    budget = max(lengths) + 40
    packed = TraceCollator(tok, pack_tokens=budget)(traces).batch
    assert packed["input_ids"].shape[1] <= budget
    assert packed["input_ids"].shape[0] < len(traces)
    index = packed["sample_index"]
    for i, length in enumerate(lengths):
        where = index == i
        assert int(where.sum()) == length  # every sample whole, in one row
        row = int(where.any(1).nonzero()[0])
        assert packed["position_ids"][row][where[row]].tolist() == list(range(length))
        assert torch.equal(packed["input_ids"][row][where[row]], plain["input_ids"][i][:length])
        assert torch.equal(packed["loss_mask"][row][where[row]], plain["loss_mask"][i][:length])


def test_truncation_keeps_the_head_and_counts(tok):
    trace = _trace(n_errors=3)
    full = TraceCollator(tok)([trace]).batch["input_ids"].shape[1]
    out = TraceCollator(tok, max_seq_len=full // 2, hint_generator=hint)([trace])
    assert out.batch["input_ids"].shape[1] == full // 2 and out.stats.truncated == 1
    # SDPO rows whose recovery turn would be cut are dropped and counted, never half-kept
    kept = out.batch.get("sdpo_teacher_input_ids")
    assert out.stats.sdpo_dropped >= 1
    assert kept is None or kept.shape[1] <= full // 2


def test_trace_logprobs_land_on_assistant_tokens(tok):
    trace = _trace(n_errors=1)
    plain = TraceCollator(tok)([trace]).batch
    n = int(plain["loss_mask"].sum())
    mask = plain["loss_mask"][0]
    # split the n assistant tokens by turn: runs of the mask
    runs, count = [], 0
    for on in mask.tolist() + [False]:
        if on:
            count += 1
        elif count:
            runs.append(count)
            count = 0
    turns = [t.model_dump(exclude_none=True) for t in trace.turns]
    values = iter(torch.linspace(-3, -0.1, n).tolist())
    assistant = [t for t in turns if t["role"] == "assistant"]
    for turn, size in zip(assistant, runs):
        turn["logprobs"] = [next(values) for _ in range(size)]
    batch = TraceCollator(tok)([{**trace.model_dump(exclude_none=True), "turns": turns}]).batch
    got = batch["inference_logprobs"][0]
    assert torch.allclose(got[mask], torch.linspace(-3, -0.1, n)) and (got[~mask] == 0).all()
    assistant[0]["logprobs"] = assistant[0]["logprobs"][:-1]
    with pytest.raises(ValueError, match="logprobs"):
        TraceCollator(tok)([{**trace.model_dump(exclude_none=True), "turns": turns}])


def test_a_template_that_rewrites_content_falls_back_to_exact_rendering(tok):
    """A template that strips content defeats the fast span search; the exact path takes over."""
    stripping = build_tokenizer(512)
    stripping.chat_template = stripping.chat_template.replace("message['content'] }}", "message['content'] | trim }}")
    trace = TraceExample(trace_id="x", source="t", turns=[
        {"role": "user", "content": "  hi  "}, {"role": "assistant", "content": "  padded reply  "}])  # fmt: skip
    collator = TraceCollator(stripping)
    text = collator.render([to_message(t) for t in trace.turns])
    assert collator.assistant_spans([to_message(t) for t in trace.turns], text) is None
    batch = collator([trace]).batch
    assert tok.decode(batch["input_ids"][0][batch["loss_mask"][0]], skip_special_tokens=True) == "padded reply"


def test_tokenizer_without_template_is_refused(tok):
    bare = build_tokenizer(300)
    bare.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        TraceCollator(bare)


@pytest.mark.parametrize(
    ("chosen", "rejected", "mask_from", "scored"),
    [
        ([1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 9], 2, [3, 9]),  # differs at the 4th id: scored through it
        ([1, 2, 3, 4, 5], [1, 2, 3], 2, [3]),  # a prefix of the chosen row (cut off): whole
        ([1, 2, 3], [1, 2, 3, 7, 8], 2, [3, 7]),  # the chosen row ends first: through the first id past it
        ([1, 2, 3], [1, 2, 3], 2, [3]),  # identical rows: whole
        ([1, 5, 3, 4], [1, 6, 3, 9], 2, [3]),  # differs before the response: its first id kept
    ],
)
def test_the_rejected_row_is_scored_through_its_first_id_unlike_the_chosen_row(chosen, rejected, mask_from, scored):
    def row(ids: list[int]) -> Encoded:
        return Encoded(np.array(ids), np.arange(len(ids)) >= mask_from)

    out = _through_divergence(row(chosen), row(rejected))
    assert out.ids.tolist() == rejected and out.ids[out.mask].tolist() == scored
