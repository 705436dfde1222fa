"""TraceCollator: trace examples (and mined DPO pairs) → tensors for all three loss channels.

Masks come from the chat-templated token stream itself: each conversation is rendered
once with the tokenizer's own chat template (or the one the run renders with instead,
`chat_template`), every assistant turn's character span is located in that text, and the
text is tokenized once (batched) with offsets, so a token is in a span exactly when its
characters are. Nothing is tokenized segment by segment (which misaligns with the template's
role tokens).

Span location is linear in the trace: the template's assistant header and end-of-turn
footer are learned once per tokenizer from a probe conversation, then found by string
search: a turn's span runs from just after its header (so anything the template puts before the
content, like Qwen3's think block, is in it) to the footer after its content. When a template
rewrites content so that search fails, the trace falls back to exact incremental rendering
(prefix by prefix).

Truncation: a sequence longer than `max_seq_len` keeps its first `max_seq_len` tokens (the
prompt and earliest turns) and is counted in `truncated`; an SDPO row whose masked span would
be cut, and a DPO pair either of whose rows is longer (the rejected row's unscored tail
included), are dropped and counted instead, since half a recovery turn or response teaches the
wrong thing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, Protocol

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from meshrl.models.routing import extended, unrecorded
from meshrl.rollouts.packing import Encoded, pack_rows
from meshrl.traces.schema import TraceExample, Turn

HintGenerator = Callable[[str, dict[str, Any]], "str | None"]


class SampledFormat(Protocol):
    """The policy's chat format (`rollouts.chat`: a `renderers` renderer or the template): what a
    sampled turn's prompt is, and how an answer reads as the policy would sample it."""

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]: ...

    def reply_ids(self, messages: list[dict[str, Any]], action: dict[str, Any]) -> list[int]: ...

    def tool_turn_ids(
        self,
        prompt_ids: list[int],
        completion_ids: list[int],
        messages: list[dict[str, Any]],
        tool_messages: list[dict[str, Any]],
    ) -> list[int]: ...


IGNORE = -100
THINK_END = "</think>"
_PROBE_USER, _PROBE_REPLY = "meshrl probe question", "meshrl probe reply 7f3a"


def to_message(turn: Turn | Mapping[str, Any]) -> dict[str, Any]:
    """A trace turn as an OpenAI-style chat message, the form chat templates expect."""
    turn = turn if isinstance(turn, Turn) else Turn.model_validate(turn)
    message: dict[str, Any] = {"role": turn.role, "content": turn.content}
    if turn.reasoning_content is not None:
        message["reasoning_content"] = turn.reasoning_content
    if turn.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in turn.tool_calls
        ]
    if turn.tool_call_id is not None:
        message["tool_call_id"] = turn.tool_call_id
    return message


@dataclass
class CollateStats:
    """What collation left out: RL rows cut to `max_seq_len`, SDPO and DPO rows dropped whole."""

    truncated: int = 0
    sdpo_dropped: int = 0
    dpo_dropped: int = 0
    dpo_open_reasoning: int = 0  # pairs whose student turn never closed its reasoning

    def __iadd__(self, other: CollateStats) -> CollateStats:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self


@dataclass
class Collated:
    """The collator's tensors by key (RL/SFT, `sdpo_*`, `dpo_*`; only the channels that got rows)
    and what it left out."""

    batch: dict[str, torch.Tensor]
    stats: CollateStats


def _then(before: np.ndarray, ids: np.ndarray, routing: np.ndarray | None = None) -> Encoded:
    """A row of `before` then `ids`, the mask on `ids`; `routing`: the sampler's routing of the episode
    whose prefix the row is (a mixture of experts), cut to the row."""
    mask = np.zeros(before.size + ids.size, dtype=bool)
    mask[before.size :] = True
    return Encoded(np.concatenate([before, ids]).astype(np.int64), mask, routing=extended(routing, mask.size))


def _through_divergence(chosen: Encoded, rejected: Encoded) -> Encoded:
    """The rejected row scored through its first id that differs from the chosen row's, no further.

    That id is where the student took another action than the teachers; what it sampled after it is
    a continuation in a context the chosen row never enters (a malformed call's tail, a ramble cut
    off at the token limit), often of tokens the policy gives almost no probability. Pushing those
    down teaches nothing about the action and, summed over a row, made the replay gradient alone
    exceed the clip norm. A rejected row that is a prefix of the chosen one keeps its mask. Rows that
    differ before the response starts (a tokenizer that merges the response's first characters into
    the generation prompt's last token) keep at least the response's first id.
    """
    n = min(chosen.ids.size, rejected.ids.size)
    differs = np.flatnonzero(chosen.ids[:n] != rejected.ids[:n])
    end = int(differs[0]) + 1 if differs.size else (n + 1 if rejected.ids.size > n else rejected.ids.size)
    start = np.flatnonzero(rejected.mask)
    mask = rejected.mask.copy()
    mask[max(end, int(start[0]) + 1 if start.size else 0) :] = False
    return Encoded(rejected.ids, mask, rejected.logprobs)


class TraceCollator:
    """Collate trace examples into RL/SFT, SDPO and replay-DPO tensors.

    `hint_generator(error_kind, error_meta) -> hint text | None` turns on SDPO rows (one per
    error site; `error_meta` is the site's ErrorMeta and the trace's `trace_id`); `pack_tokens` packs RL rows first-fit-decreasing into rows of at most that
    many tokens with per-sample position ids (else rows are right-padded with an attention
    mask); `max_seq_len` truncates (see the module docstring); `tools` (OpenAI function schemas,
    the task's) are rendered by the chat template as they were when the policy sampled.
    `chat_template` (a template's text) renders in place of the tokenizer's own (`model.renderer =
    "hermes"`). `sampled_format` (the run's chat format) renders what goes beside sampled ids (the
    teachers' chosen answers, SDPO's hinted prompt); without one the template does.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        hint_generator: HintGenerator | None = None,
        *,
        max_seq_len: int | None = None,
        pack_tokens: int | None = None,
        hint_role: str = "user",
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        sampled_format: SampledFormat | None = None,
    ) -> None:
        if (chat_template or tokenizer.chat_template) is None:
            raise ValueError("the tokenizer has no chat template; TraceCollator needs one")
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("TraceCollator needs a fast (Rust-backed) tokenizer for character offsets")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token first")
        if pack_tokens is not None and max_seq_len is not None and max_seq_len > pack_tokens:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds pack_tokens {pack_tokens}")
        self.tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self.hint_generator = hint_generator
        self.max_seq_len = max_seq_len if max_seq_len is not None else pack_tokens
        self.pack_tokens = pack_tokens
        self.hint_role = hint_role
        self.tools = tools
        self.template_kwargs = dict(template_kwargs or {})
        self.chat_template = chat_template
        self.sampled_format = sampled_format

    # ------------------------------------------------------------------ rendering and spans

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **self.template_kwargs,
        )

    @cached_property
    def turn_markers(self) -> tuple[str, str]:
        """The assistant header (the generation prompt) and the end-of-turn marker after a reply,
        learned from a probe. Only conversations without sampled ids need them: a template that
        prefills the reply (DeepSeek-R1's open think block) can still collate sampled rollouts."""
        user = [{"role": "user", "content": _PROBE_USER}]
        bare, prompted = self.render(user), self.render(user, generation_prompt=True)
        full = self.render([*user, {"role": "assistant", "content": _PROBE_REPLY}])
        if not prompted.startswith(bare) or not full.startswith(prompted) or _PROBE_REPLY not in full:
            raise ValueError(
                "the chat template does not render conversations prefix by prefix, so traces without sampled "
                "ids (warm-start demonstrations, task.traces) cannot be rendered for training"
            )
        after = full[full.index(_PROBE_REPLY) + len(_PROBE_REPLY) :]
        return prompted[len(bare) :], after.rstrip()

    @property
    def header(self) -> str:
        return self.turn_markers[0]

    @property
    def footer(self) -> str:
        return self.turn_markers[1]

    @cached_property
    def think_end(self) -> int | None:
        """The id of `</think>` where the vocabulary has it as one token (thinking families)."""
        ids = self.tokenizer.encode(THINK_END, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def reasoning_end(self, ids: np.ndarray) -> int:
        """Where a sampled turn's reasoning ends: just after its first `</think>` (0: it has none)."""
        found = np.flatnonzero(ids == self.think_end) if self.think_end is not None else ()
        return int(found[0]) + 1 if len(found) else 0

    def assistant_spans(self, messages: list[dict[str, Any]], text: str) -> list[tuple[int, int]] | None:
        """Character spans of every assistant turn (content, tool calls, end marker) in `text`.

        None when the template rewrote something the search relies on."""
        spans, cursor = [], 0
        for message in messages:
            content = message.get("content") or ""
            if message["role"] != "assistant":
                found = text.find(content, cursor)
                if found < 0:
                    return None
                cursor = found + len(content)
                continue
            found = text.find(self.header, cursor)
            start = found + len(self.header)
            at = text.find(content, start) if found >= 0 else -1
            if at < 0 or (self.footer and self.footer in text[start:at]):  # the content must be this turn's
                return None
            end = text.find(self.footer, at + len(content)) if self.footer else len(text)
            if end < 0:
                return None
            end += len(self.footer)
            spans.append((start, end))
            cursor = end
        return spans

    def exact_assistant_spans(self, messages: list[dict[str, Any]], text: str) -> list[tuple[int, int]]:
        """Spans by rendering each prefix (quadratic in turns; the fallback)."""
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:k], generation_prompt=True)
            upto = self.render(messages[: k + 1])
            if not (upto.startswith(prompt) and text.startswith(upto)):
                raise ValueError("the chat template does not render this conversation prefix by prefix")
            reply = upto[len(prompt) :]
            cut = reply.rfind(self.footer) + len(self.footer) if self.footer and self.footer in reply else len(reply)
            spans.append((len(prompt), len(prompt) + cut))
        return spans

    def _spans(self, messages: list[dict[str, Any]], text: str) -> list[tuple[int, int]]:
        return self.assistant_spans(messages, text) or self.exact_assistant_spans(messages, text)

    def _encode_all(self, texts: list[str], spans: list[list[tuple[int, int]]]) -> list[Encoded]:
        """Tokenize all texts in one batched call; a token is masked when its first character is in a span."""
        if not texts:
            return []
        out = []
        for encoding, text, text_spans in zip(
            self._backend.encode_batch(texts, add_special_tokens=False), texts, spans
        ):
            ids = np.asarray(encoding.ids, dtype=np.int64)
            mask = np.zeros(ids.size, dtype=bool)
            for lo, hi in text_spans:
                mask[
                    self._first_token_from(encoding, lo, len(text)) : self._first_token_from(encoding, hi, len(text))
                ] = True
            out.append(Encoded(ids, mask))
        return out

    @staticmethod
    def _first_token_from(encoding: Any, char: int, n_chars: int) -> int:
        """Index of the first token starting at or after `char` (the token count past the end)."""
        if char >= n_chars:
            return len(encoding.ids)
        token = encoding.char_to_token(char)
        while token is None:  # a character no token covers (normalised away): look further
            char += 1
            if char >= n_chars:
                return len(encoding.ids)
            token = encoding.char_to_token(char)
        starts_here = char == 0 or encoding.char_to_token(char - 1) != token
        return token if starts_here else token + 1

    # ------------------------------------------------------------------ channels

    def _rl(self, examples: Sequence[TraceExample], advantages: Sequence[float] | None, stats: CollateStats):
        messages = [[to_message(t) for t in ex.turns] for ex in examples]
        texts = [self.render(m) for m in messages]
        encoded = self._encode_all(texts, [self._spans(m, t) for m, t in zip(messages, texts)])
        for ex, enc in zip(examples, encoded):
            enc.logprobs = self._trace_logprobs(ex, enc)
        rewards = [ex.final_reward for ex in examples]
        if advantages is None:
            known = [r for r in rewards if r is not None]
            baseline = sum(known) / len(known) if known else 0.0
            advantages = [0.0 if r is None else r - baseline for r in rewards]
        elif len(advantages) != len(examples):
            raise ValueError(f"{len(advantages)} advantages for {len(examples)} examples")
        for enc in encoded:
            stats.truncated += self._truncate(enc)
        return encoded, rewards, list(advantages)

    def _trace_logprobs(self, example: TraceExample, enc: Encoded) -> np.ndarray | None:
        """Per-token sampler logprobs placed on the assistant tokens, when every assistant turn has them."""
        assistant = [t for t in example.turns if t.role == "assistant"]
        if not assistant or any(t.logprobs is None for t in assistant):
            return None
        values = np.concatenate([np.asarray(t.logprobs, dtype=np.float32) for t in assistant])
        if values.size != int(enc.mask.sum()):
            raise ValueError(
                f"trace {example.trace_id}: {values.size} logprobs for {int(enc.mask.sum())} assistant tokens "
                "(logprobs must be per token of the turns as this tokenizer's chat template tokenizes them)"
            )
        out = np.zeros(enc.ids.size, dtype=np.float32)
        out[enc.mask] = values
        return out

    def _truncate(self, enc: Encoded) -> bool:
        if self.max_seq_len is None or enc.ids.size <= self.max_seq_len:
            return False
        enc.ids, enc.mask = enc.ids[: self.max_seq_len], enc.mask[: self.max_seq_len]
        if enc.logprobs is not None:
            enc.logprobs = enc.logprobs[: self.max_seq_len]
        return True

    def _sdpo(self, examples: Sequence[TraceExample], stats: CollateStats) -> tuple[list[Encoded], list[Encoded]]:
        """One (student, teacher) pair per error site: the teacher sees a hint right before the recovery turn.

        A sampled recovery turn keeps its exact ids in both rows, after the exact ids before it
        (student) or the rendered conversation with the hint (teacher); only a trace without ids
        (ingested) is rendered whole."""
        students, teachers, exact = [], [], []
        for ex in examples:
            messages = [to_message(t) for t in ex.turns]
            for k, turn in enumerate(ex.turns):
                if turn.role != "assistant" or turn.tool_error is None:
                    continue
                meta = {**(turn.error_meta.model_dump() if turn.error_meta else {}), "trace_id": ex.trace_id}
                hint = self.hint_generator(turn.tool_error, meta)
                if hint is None:
                    continue
                hinted = [*messages[:k], {"role": self.hint_role, "content": hint}]
                sampled = ex.sampled_ids(turn)
                if sampled is not None:
                    before, ids = (self._checked(part, ex.trace_id) for part in sampled)
                    # the student row is the episode's prefix, routed as sampled; the teacher's routes itself
                    exact.append((_then(before, ids, ex.routing), _then(self._hinted_prompt(ex, k, hinted), ids)))
                    continue
                students.append(messages[: k + 1])
                teachers.append([*hinted, messages[k]])
        kept_s, kept_t = [], []
        texts = [self.render(m) for m in students + teachers]
        last_spans = [[self._spans(m, t)[-1]] for m, t in zip(students + teachers, texts)]
        encoded = self._encode_all(texts, last_spans)
        for student, teacher in [*exact, *zip(encoded[: len(students)], encoded[len(students) :])]:
            same = np.array_equal(student.ids[student.mask], teacher.ids[teacher.mask])
            too_long = self.max_seq_len is not None and teacher.ids.size > self.max_seq_len
            if not same or too_long:
                stats.sdpo_dropped += 1
                continue
            kept_s.append(student)
            kept_t.append(teacher)
        return kept_s, kept_t

    def _hinted_prompt(self, example: TraceExample, k: int, hinted: list[dict[str, Any]]) -> np.ndarray:
        """SDPO's teacher prompt for sampled turn `k`: the exact ids through the student's last sampled
        turn before it, extended by what followed that turn and the hint as the chat format extends a
        sampled turn. It differs from the student's prompt in the hint alone: a re-rendered
        conversation would also drop the earlier turns' reasoning in formats that keep reasoning only
        after the last user message (Qwen3), and the teacher would reason less than the student did.
        Rendered whole where no sampled turn precedes, or the format cannot extend one by a hint."""
        turns = example.turns
        previous = next((j for j in range(k - 1, -1, -1) if turns[j].role == "assistant" and turns[j].token_span), None)
        if previous is not None and self.sampled_format is not None:
            before, ids = (list(part) for part in example.sampled_ids(turns[previous]))
            try:
                tail = self.sampled_format.tool_turn_ids(before, ids, hinted[: previous + 1], hinted[previous + 1 :])
                return self._checked([*before, *ids, *tail], example.trace_id)
            except ValueError:
                pass
        return self.prompt_ids(hinted)

    def _ids(self, text: str) -> np.ndarray:
        return np.asarray(self._backend.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def _checked(self, ids: Sequence[int] | None, where: str) -> np.ndarray:
        """Ids a trace brings, refused (naming the trace) unless there are some and every one is in
        the vocabulary."""
        if ids is None:
            raise ValueError(f"trace {where}: sampled ids without the ids before them")
        out = np.asarray(ids, dtype=np.int64)
        if out.size and (out.min() < 0 or out.max() >= len(self.tokenizer)):
            raise ValueError(f"trace {where}: token ids outside the vocabulary of {len(self.tokenizer)}")
        return out

    def prompt_ids(self, messages: list[dict[str, Any]]) -> np.ndarray:
        """`messages` as the policy's prompt for the next assistant turn."""
        if self.sampled_format is not None:
            return np.asarray(self.sampled_format.prompt_ids(messages), dtype=np.int64)
        return self._ids(self.render(messages, generation_prompt=True))

    def reply_ids(self, state: list[dict[str, Any]], action: Mapping[str, Any]) -> np.ndarray:
        """`action` (a pair's side) as the policy would sample it after `state`'s prompt, through
        its end-of-turn marker."""
        message = to_message(action)
        if self.sampled_format is not None:
            return np.asarray(self.sampled_format.reply_ids(state, message), dtype=np.int64)
        return self.template_reply_ids(state, message)

    def template_reply_ids(self, state: list[dict[str, Any]], message: dict[str, Any]) -> np.ndarray:
        prompt = self.render(state, generation_prompt=True)
        full, end = self._reply(state, prompt, message)
        return self._ids(full[len(prompt) : end])

    def _reply(self, state: list[dict[str, Any]], prompt: str, message: dict[str, Any]) -> tuple[str, int]:
        """The state and `message` rendered, and where the message's end-of-turn marker ends."""
        full = self.render([*state, message])
        if not full.startswith(prompt):
            raise ValueError("the chat template does not render the pair's prompt as a prefix of prompt+response")
        return full, full.rfind(self.footer) + len(self.footer) if self.footer else len(full)

    def _dpo(self, pairs: Iterable[Any], stats: CollateStats) -> tuple[list[Encoded], list[Encoded]]:
        """Prompt through the template with a generation prompt; response tokens masked 1.

        A pair whose student turn was sampled keeps its exact ids: the rejected row is the ids
        before the turn and the ids it sampled; the chosen row is the same ids before it and the
        teachers' answer as the policy's chat format renders it. The pair contrasts actions only:
        where the student reasoned first (`<think>…</think>`), its sampled reasoning is context of
        both rows, and the teachers' answer follows it in place of the empty think block a chat
        format renders for an answer without reasoning; else every pair would raise empty reasoning
        and lower the policy's own. A sampled turn that never closed its reasoning (cut off while
        thinking, or no think block where the format renders one) has no action to contrast: such a
        pair is left out and counted (`dpo_open_reasoning`), since its rows could only contrast
        reasoning with the empty think block. Other pairs are rendered whole. Either way the rejected row is
        scored only through its first id unlike the chosen row's (`_through_divergence`)."""
        texts, spans, rows = [], [], []
        for pair in pairs:
            pair = pair if isinstance(pair, Mapping) else pair.model_dump()
            state = [to_message(m) for m in pair["state_messages"]]
            if pair.get("rejected_token_ids") is not None:  # the student's turn is rendered by no one
                where = f"{pair['trace_id']} turn {pair['turn_index']}"
                before = self._checked(pair["prompt_token_ids"], where)
                sampled = self._checked(pair["rejected_token_ids"], where)
                chosen_ids = self.reply_ids(state, pair["chosen"])
                thought, rendered_thought = self.reasoning_end(sampled), self.reasoning_end(chosen_ids)
                if rendered_thought and not thought:  # no action after reasoning: the rows would differ in it
                    stats.dpo_open_reasoning += 1
                    continue
                if thought:
                    before, sampled = np.concatenate([before, sampled[:thought]]), sampled[thought:]
                    chosen_ids = chosen_ids[rendered_thought:]
                rows.append((_then(before, chosen_ids), _then(before, sampled)))
                continue
            rows.append(None)
            prompt = self.render(state, generation_prompt=True)
            for action in (pair["chosen"], pair["rejected"]):
                full, end = self._reply(state, prompt, to_message(action))
                texts.append(full)
                spans.append([(len(prompt), end)])
        encoded = iter(self._encode_all(texts, spans))
        chosen, rejected = [], []
        for c, r in (row or (next(encoded), next(encoded)) for row in rows):
            if self.max_seq_len is not None and max(c.ids.size, r.ids.size) > self.max_seq_len:
                stats.dpo_dropped += 1
                continue
            chosen.append(c)
            rejected.append(_through_divergence(c, r))
        return chosen, rejected

    # ------------------------------------------------------------------ tensors

    def _pad(self, rows: list[Encoded], left: bool = False) -> dict[str, torch.Tensor]:
        width = max(r.ids.size for r in rows)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        logprobs = torch.zeros(len(rows), width, dtype=torch.float32)
        routed = next((r.routing for r in rows if r.routing is not None), None)
        padded = (
            {}
            if routed is None
            else {"routed_experts": unrecorded((len(rows), width, *routed.shape[1:]), routed.dtype)}
        )
        for i, r in enumerate(rows):
            cols = slice(width - r.ids.size, width) if left else slice(0, r.ids.size)
            ids[i, cols] = torch.from_numpy(r.ids)
            attention[i, cols] = 1
            mask[i, cols] = torch.from_numpy(r.mask)
            if r.logprobs is not None:
                logprobs[i, cols] = torch.from_numpy(r.logprobs)
            if r.routing is not None:
                padded["routed_experts"][i, cols] = r.routing
        padded = {k: torch.from_numpy(v) for k, v in padded.items()}
        return {"input_ids": ids, "attention_mask": attention, "mask": mask, "logprobs": logprobs, **padded}

    def __call__(
        self,
        examples: Sequence[TraceExample | Mapping[str, Any]],
        pairs: Iterable[Any] = (),
        advantages: Sequence[float] | None = None,
        rl: bool = True,
    ) -> Collated:
        """Collate. `pairs` are mined DPO pairs (DpoPair or dicts with state_messages/chosen/rejected);
        `advantages` (one per example) default to reward minus the batch's mean reward; `rl=False`
        builds only the SDPO and DPO rows (for rollouts whose RL rows come from their own tokens)."""
        examples = [ex if isinstance(ex, TraceExample) else TraceExample.model_validate(ex) for ex in examples]
        stats = CollateStats()
        batch: dict[str, Any] = {}
        if examples and rl:
            rows, rewards, advs = self._rl(examples, advantages, stats)
            has_logprobs = all(r.logprobs is not None for r in rows)
            if self.pack_tokens is not None:
                packed = pack_rows(rows, advs, self.pack_tokens, self.tokenizer.pad_token_id)
                if not has_logprobs:
                    del packed["inference_logprobs"]
                batch.update(packed)
            else:
                padded = self._pad(rows)
                batch.update(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"])
                batch["loss_mask"] = padded["mask"]
                batch["advantages"] = torch.tensor(advs, dtype=torch.float32)[:, None] * padded["attention_mask"]
                if has_logprobs:
                    batch["inference_logprobs"] = padded["logprobs"]
            batch["rewards"] = torch.tensor([float("nan") if r is None else r for r in rewards])
        if self.hint_generator is not None and examples:
            students, teachers = self._sdpo(examples, stats)
            if students:
                padded_s = self._pad(students + teachers, left=True)
                half = len(students)
                ids, attention, mask = padded_s["input_ids"], padded_s["attention_mask"], padded_s["mask"]
                positions = (attention.cumsum(1) - 1).clamp_min(0)
                batch["sdpo_student_input_ids"], batch["sdpo_teacher_input_ids"] = ids[:half], ids[half:]
                batch["sdpo_student_attention_mask"] = attention[:half]
                batch["sdpo_teacher_attention_mask"] = attention[half:]
                batch["sdpo_student_position_ids"], batch["sdpo_teacher_position_ids"] = (
                    positions[:half],
                    positions[half:],
                )
                loss_mask = torch.full_like(ids[half:], IGNORE)
                loss_mask[mask[half:]] = 1
                batch["sdpo_loss_mask"] = loss_mask
                if "routed_experts" in padded_s:  # the students' (the teachers' rows route themselves)
                    batch["sdpo_student_routed_experts"] = padded_s["routed_experts"][:half]
        chosen, rejected = self._dpo(pairs, stats)
        if chosen:
            for side, rows in (("chosen", chosen), ("rejected", rejected)):
                padded = self._pad(rows)
                batch[f"dpo_{side}_input_ids"] = padded["input_ids"]
                batch[f"dpo_{side}_attention_mask"] = padded["attention_mask"]
                batch[f"dpo_{side}_response_mask"] = padded["mask"].long()
        return Collated(batch, stats)
