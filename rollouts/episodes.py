"""Multi-turn episodes: the generator samples assistant turns, the task answers tool calls.

A rollout keeps the exact token ids the policy saw and sampled — prompt, completions, and
the templated tool turns spliced in between — with the sampler's logprob and policy version
on every sampled token. The trainer scores those same ids, so nothing is re-tokenized
between sampling and training.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from meshrl.configs.schema import RunConfig
from meshrl.inference.backends import EngineLimits
from meshrl.inference.completion import Completion
from meshrl.rollouts.chat import ChatSettings, make_chat
from meshrl.tasks.base import Ending, Episodic, Prompt, Score, Scoring, Stopping, Task, ToolResult, task_tools
from meshrl.traces.schema import TokenSpan, TraceExample

log = logging.getLogger(__name__)


@dataclass
class Segment:
    """A context an episode left behind when it elided tool results (`generator.context_policy =
    "elide"`): its ids, which of them were sampled in it, their logprobs, and a mixture of experts'
    routing of them: a row of its own."""

    token_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    routing: np.ndarray | None = None


@dataclass
class Rollout:
    prompt: Prompt
    messages: list[dict[str, Any]]
    token_ids: list[int]
    loss_mask: list[bool]  # sampled tokens
    logprobs: list[float]  # the sampler's, 0 off the mask
    versions: list[int]  # policy version that sampled each masked token, in order
    finish_reason: str = "stop"
    stop_condition: str = ""  # why the episode ended (`Ending.stop_condition`), set by `EpisodeFormat.goes_on`
    # (or `TOOL_FAILED`, by the scheduler)
    reward: float | None = None
    score: Score | None = None  # the rubric's parts, for tasks that score by rubric (`Scoring`)
    turns: int = 0
    tool_errors: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    episode_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # what an `Episodic` task's state is kept under
    earlier: list[Segment] = field(default_factory=list)  # contexts left behind by elision, oldest first
    turn_ids: list[list[int]] = field(default_factory=list)  # each sampled turn's ids, in order
    elided: set[int] = field(default_factory=set)  # indices in `messages` of the tool results the policy sees elided
    # A mixture of experts' routed experts of token_ids[:len(routing)] as the sampler recorded them
    # (`models.routing`): its last turn's record; the tool turn after it is not routed yet.
    routing: np.ndarray | None = None

    def segments(self) -> list[Segment]:
        """Every context the episode was sampled in: the earlier ones, then the current one."""
        return [*self.earlier, Segment(self.token_ids, self.loss_mask, self.logprobs, self.routing)]

    @property
    def version(self) -> int:
        """The oldest policy version among its tokens: how stale the rollout is."""
        return min(self.versions)

    @property
    def budget_ended(self) -> bool:
        """It ended because its next turn would not fit its token budget (`prompt_too_long`,
        finish reason `length`): its last turn itself had finished."""
        return self.stop_condition == PROMPT_TOO_LONG

    @property
    def last_turn_cut(self) -> bool:
        """Its last turn stopped at generator.max_new_tokens: an unfinished answer. (A cut turn
        has no tool calls, so it ends the episode before the budget is looked at.)"""
        return self.finish_reason == "length" and not self.budget_ended


def fresh_rollouts(rollouts: list[Rollout], step: int, max_off_policy_steps: int) -> list[Rollout]:
    """The rollouts whose oldest token was sampled at most `max_off_policy_steps` versions before `step`."""
    return [r for r in rollouts if step - r.version <= max_off_policy_steps]


def sampled_spans(loss_mask: Sequence[bool]) -> list[TokenSpan]:
    """The runs of sampled tokens, in order: one per assistant turn of an episode (tool turns,
    unsampled, lie between them)."""
    spans, start = [], None
    for i, sampled in enumerate([*loss_mask, False]):
        if sampled and start is None:
            start = i
        elif not sampled and start is not None:
            spans.append(TokenSpan(start=start, end=i))
            start = None
    return spans


def rubric_means(rollouts: list[Rollout]) -> dict[str, float]:
    """Each rubric part's mean over the rollouts that carry it: `rubric/<component>`, `task_metric/<metric>`."""
    values: dict[str, list[float]] = {}
    for rollout in rollouts:
        if rollout.score is None:
            continue
        for prefix, parts in (("rubric", rollout.score.components), ("task_metric", rollout.score.metrics)):
            for name, value in parts.items():
                values.setdefault(f"{prefix}/{name}", []).append(value)
    return {key: sum(v) / len(v) for key, v in values.items()}


def reasoning_stats(rollouts: list[Rollout], think_end: int) -> dict[str, float]:
    """How long a thinking policy reasons, which a loss channel can quietly train away, measured so a
    change in how many turns episodes take does not read as one: `reasoning/tokens`, the mean sampled
    tokens through `think_end` (`</think>`) over the assistant turns that closed their reasoning, and
    `reasoning/first_turn_tokens` over episodes' first turns alone (the same state in every episode);
    `reasoning/unclosed`, the fraction of turns that never closed it (cut off while thinking, or no
    think block at all: a policy that stops reasoning shows here, not as 0-token turns in the mean)."""
    closed, first, turns = [], [], 0
    for rollout in rollouts:
        for i, span in enumerate(sampled_spans(rollout.loss_mask)):
            ids = rollout.token_ids[span.start : span.end]
            turns += 1
            if think_end in ids:
                closed.append(ids.index(think_end) + 1)
                if i == 0:
                    first.append(closed[-1])
    nan = float("nan")
    return {
        "reasoning/tokens": sum(closed) / len(closed) if closed else nan,
        "reasoning/first_turn_tokens": sum(first) / len(first) if first else nan,
        "reasoning/unclosed": (turns - len(closed)) / turns if turns else nan,
    }


# What ends an episode whose next turn would not fit its token budget (verifiers' name for it).
PROMPT_TOO_LONG = "prompt_too_long"
# What ends an episode whose tool call, or the tool turn answering it, raised (`EpisodeFormat.score`).
TOOL_FAILED = "tool_failed"
MIN_TOOL_SHARE = 64  # tokens a result keeps however many calls share a turn's tool budget
TRUNCATION = "\n[... {cut} characters of tool output cut: this result is capped at {cap} tokens ...]\n"
ELIDED = "[{tokens} tokens elided]"  # short: a result only shorter than its marker is never elided
WINDOW_CHARS = 16  # characters tokenized per token a capped result keeps, at its head and its tail


@dataclass(frozen=True)
class EpisodeLimits:
    """The sizes a policy controls, bounded in tokens. `max_tokens`: an episode's whole context
    (prompt, turns, tool turns); a turn starts only while it plus `max_new_tokens` fits, else the
    episode ends cut off (finish reason `length`). `max_tool_tokens`: one tool turn's results
    together; longer ones keep their head and tail around a marker the policy reads."""

    max_tokens: int
    max_new_tokens: int
    max_tool_tokens: int
    elide: bool = False  # `generator.context_policy = "elide"`: elide old tool results before cutting

    @classmethod
    def of(cls, config: RunConfig) -> EpisodeLimits:
        """A run's limits: an episode fits one generator's KV budget and one trainer micro-batch
        (a longer one would be cut there, its sampled tail never trained)."""
        g = config.generator
        budget = min(g.max_concurrent_tokens, config.trainer.micro_batch_tokens)
        return cls(budget, g.max_new_tokens, g.max_tool_result_tokens, g.context_policy == "elide")

    def room_for_a_turn(self, context: int) -> bool:
        """Whether a turn of `max_new_tokens` still fits after `context` tokens."""
        return context + self.max_new_tokens <= self.max_tokens


def engine_limits(config: RunConfig) -> EngineLimits:
    """What a run's engines are sized for: its longest episode and the generator's concurrency caps."""
    g = config.generator
    return EngineLimits(EpisodeLimits.of(config).max_tokens, g.max_concurrent_tokens, g.max_concurrent_episodes)


def cap_tokens(tokenizer: PreTrainedTokenizerBase, text: str, cap: int) -> str:
    """`text` when it is at most `cap` tokens, else its head and tail around the truncation
    marker, at most `cap` tokens in all. Idempotent (a capped text is kept as it is), so a tool
    turn capped on a worker and capped again by the verifier reads the same. Only a window of
    `WINDOW_CHARS` characters per token kept is tokenized at either end (each keeps half): a
    flood of megabytes costs what its head and tail cost."""
    window = WINDOW_CHARS * cap // 2
    head_ids = tail_ids = []
    if len(text) > 2 * window:
        head_ids = tokenizer.encode(text[:window], add_special_tokens=False)
        tail_ids = tokenizer.encode(text[-window:], add_special_tokens=False)
    if len(head_ids) + len(tail_ids) <= cap:  # short, or tokens so long that only the whole text tells
        head_ids = tail_ids = tokenizer.encode(text, add_special_tokens=False)
        if len(head_ids) <= cap:
            return text
    keep = cap - len(tokenizer.encode(TRUNCATION.format(cut=len(text), cap=cap), add_special_tokens=False))
    while True:  # re-tokenizing decoded pieces can merge or split at the seams: shrink until it fits
        keep = max(0, keep)
        head = tokenizer.decode(head_ids[: keep - keep // 2])
        tail = tokenizer.decode(tail_ids[len(tail_ids) - keep // 2 :]) if keep // 2 else ""
        capped = head + TRUNCATION.format(cut=len(text) - len(head) - len(tail), cap=cap) + tail
        if len(tokenizer.encode(capped, add_special_tokens=False)) <= cap or keep == 0:
            return capped
        keep -= 8


def tool_share(max_tool_tokens: int, calls: int) -> int:
    """Tokens each of a turn's `calls` results may keep: the turn's cap split between them."""
    return max(MIN_TOOL_SHARE, max_tool_tokens // max(1, calls))


def cap_trace(example: TraceExample, tokenizer: PreTrainedTokenizerBase, max_tool_tokens: int) -> TraceExample:
    """A trace whose tool results are capped as an episode's are (a demonstration or an ingested
    session then shows what the policy would see, and trains within the budget). A sampled trace
    is left as it is: its ids are what was sampled, and its tool turns were capped then."""
    if example.token_ids is not None:
        return example
    turns, share = [], tool_share(max_tool_tokens, 1)
    for turn in example.turns:
        if turn.role == "assistant":
            share = tool_share(max_tool_tokens, len(turn.tool_calls or []))
        elif turn.role == "tool":
            turn = turn.model_copy(update={"content": cap_tokens(tokenizer, turn.content, share)})
        turns.append(turn)
    return example.model_copy(update={"turns": turns})


class EpisodeFormat:
    """How an episode's turns become token ids under the policy's chat format (`rollouts.chat`),
    within `limits` (none: unbounded, for tools that drive episodes by hand).

    The schedulers (per-episode in `rollouts.scheduler`, lock-step in the benchmark) and the
    ingress verifier share it, so all build the same rollouts from the same completions.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        task: Task,
        settings: ChatSettings | None = None,
        limits: EpisodeLimits | None = None,
    ) -> None:
        self.tokenizer, self.task, self.limits = tokenizer, task, limits
        self.tools = task_tools(task)  # rendered by the chat format (e.g. Hermes' system turn)
        self.chat = make_chat(tokenizer, settings or ChatSettings(), self.tools)
        self.stop_ids = self.chat.stop_ids
        self.footer = tokenizer.convert_ids_to_tokens(self.stop_ids[0]) if self.stop_ids else ""  # end of a turn

    def start(self, prompt: Prompt) -> Rollout:
        """A rollout holding the templated prompt, ready for its first assistant turn. A prompt
        that leaves no room for one turn is the task's or the config's error, named here."""
        ids = self.chat.prompt_ids(prompt.messages)
        if self.limits is not None and not self.limits.room_for_a_turn(len(ids)):
            raise ValueError(
                f"prompt {prompt.prompt_id} renders to {len(ids)} tokens: with generator.max_new_tokens "
                f"{self.limits.max_new_tokens} it does not fit an episode's {self.limits.max_tokens} tokens "
                "(the smaller of generator.max_concurrent_tokens and trainer.micro_batch_tokens)"
            )
        return Rollout(prompt, [dict(m) for m in prompt.messages], ids, [False] * len(ids), [0.0] * len(ids), [])

    def add_turn(self, rollout: Rollout, completion: Completion) -> list[dict[str, Any]]:
        """Append a sampled assistant turn; returns its tool calls (none when it was cut by length).

        Calls of the task's last turn are still answered, so the reward sees their results."""
        message = self.chat.parse(rollout.token_ids, completion.completion_ids)
        rollout.turns += 1
        rollout.token_ids += completion.completion_ids
        rollout.loss_mask += [True] * len(completion.completion_ids)
        rollout.logprobs += completion.logprobs
        rollout.versions += completion.versions
        rollout.finish_reason = completion.finish_reason
        rollout.messages.append(message)
        rollout.turn_ids.append(list(completion.completion_ids))
        rollout.routing = completion.routing  # the whole context's, as the engine's cache holds it
        return message.get("tool_calls", []) if completion.finish_reason == "stop" else []

    def goes_on(self, rollout: Rollout, calls: list[dict[str, Any]]) -> bool:
        """Whether another assistant turn follows the one just added (and its tool results);
        when none does, the rollout records why."""
        if not calls:
            rollout.stop_condition = "agent_completed"
        elif rollout.turns >= self.task.max_turns:
            rollout.stop_condition = "max_turns"
        elif isinstance(self.task, Stopping) and (stop := self.task.stops(rollout.prompt, rollout.messages)):
            rollout.stop_condition = stop
        elif self.limits is not None and not self.limits.room_for_a_turn(len(rollout.token_ids)):
            if self.limits.elide and self.elide(rollout):
                return True
            rollout.stop_condition, rollout.finish_reason = PROMPT_TOO_LONG, "length"
        else:
            return True
        return False

    def elide(self, rollout: Rollout) -> bool:
        """Replace the oldest tool results the policy still sees in full, one at a time, by a marker
        (`ELIDED`), until a turn fits; the context so far becomes a `Segment` and the episode goes on
        from the shorter one. False (nothing changed) when eliding every result would not make room.
        A result no longer than its marker stays: eliding it would lengthen the context."""
        tools = [
            i
            for i, m in enumerate(rollout.messages)
            if m.get("role") == "tool" and i not in rollout.elided and self._elision_shortens(m["content"])
        ]
        elided = set(rollout.elided)
        for index in tools:
            elided.add(index)
            ids = self.context_ids(rollout, elided)
            if self.limits.room_for_a_turn(len(ids)):
                rollout.earlier.append(rollout.segments()[-1])
                rollout.token_ids, rollout.loss_mask, rollout.logprobs = ids, [False] * len(ids), [0.0] * len(ids)
                rollout.routing = None
                rollout.elided = elided
                return True
        return False

    def _elision_shortens(self, content: str) -> bool:
        count = len(self.tokenizer.encode(content, add_special_tokens=False))
        return count > len(self.tokenizer.encode(ELIDED.format(tokens=count), add_special_tokens=False))

    def context_ids(self, rollout: Rollout, elided: set[int]) -> list[int]:
        """The episode's context with the tool results at `elided` replaced by the marker: the prompt,
        then each sampled turn's own ids and its tool turn as the chat format extends it (so with nothing
        elided, exactly the episode's ids)."""
        start = len(rollout.prompt.messages)
        ids = self.chat.prompt_ids(rollout.prompt.messages)
        messages = [dict(m) for m in rollout.prompt.messages]
        turns = iter(rollout.turn_ids)
        i = start
        while i < len(rollout.messages):
            message = rollout.messages[i]
            sampled, before = next(turns), len(ids)
            ids += sampled
            messages.append(message)
            i += 1
            results = []
            while i < len(rollout.messages) and rollout.messages[i].get("role") == "tool":
                result = dict(rollout.messages[i])
                if i in elided:
                    count = len(self.tokenizer.encode(result["content"], add_special_tokens=False))
                    result["content"] = ELIDED.format(tokens=count)
                results.append(result)
                i += 1
            if results:
                ids += self.chat.tool_turn_ids(ids[:before], sampled, messages, results)
                messages += results
        return ids

    def call_tool(self, rollout: Rollout, call: dict[str, Any]) -> ToolResult:
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        if isinstance(self.task, Episodic):
            return self.task.episode_call(rollout.episode_id, rollout.prompt, name, arguments)
        return self.task.call_tool(rollout.prompt, name, arguments)

    def end(self, rollout: Rollout) -> None:
        """The episode is over (finished, failed or dropped): an `Episodic` task frees its state."""
        if isinstance(self.task, Episodic):
            self.task.end_episode(rollout.episode_id)

    def add_tool_results(self, rollout: Rollout, calls: list[dict[str, Any]], results: list[ToolResult]) -> list[int]:
        """Append the tool turn answering `calls`; returns its token ids (what the next turn prefills)."""
        tool_messages = []
        share = tool_share(self.limits.max_tool_tokens, len(calls)) if self.limits is not None else None
        for call, result in zip(calls, results, strict=True):
            content = result.content if share is None else cap_tokens(self.tokenizer, result.content, share)
            tool_messages.append({"role": "tool", "content": content, "tool_call_id": call["id"],
                                  "is_error": result.is_error})  # fmt: skip
        split = sampled_spans(rollout.loss_mask)[-1].start  # where the turn just sampled begins
        ids = self.chat.tool_turn_ids(
            rollout.token_ids[:split], rollout.token_ids[split:], rollout.messages, tool_messages
        )
        rollout.token_ids += ids  # the rollout changes only once the turn is built: a raise leaves it whole
        rollout.loss_mask += [False] * len(ids)
        rollout.logprobs += [0.0] * len(ids)
        rollout.messages += tool_messages
        rollout.tool_errors += sum(result.is_error for result in results)
        return ids

    def score(self, rollout: Rollout) -> None:
        """The task's verdict on the episode. A task whose scoring raises gives this episode reward 0
        and the metric `score_errors` (logged with its traceback), never a failed generator: what
        it scored was the policy's, which the policy can shape to break a scorer. An episode ended
        by a failed tool (`TOOL_FAILED`) is not scored: its last calls have no results, and a task
        replaying them would fail again; it gets reward 0 and the metric `tool_failures`."""
        if rollout.stop_condition == TOOL_FAILED:
            rollout.score, rollout.reward = Score(0.0, {}, {"tool_failures": 1.0}), 0.0
            return
        try:
            if isinstance(self.task, Scoring):
                ending = Ending(rollout.stop_condition, rollout.finish_reason)
                rollout.score = self.task.score(rollout.prompt, rollout.messages, ending)
                rollout.reward = float(rollout.score.reward)
            else:
                rollout.reward = float(self.task.reward(rollout.prompt, rollout.messages))
        except Exception:
            log.exception("scoring episode %s of prompt %s raised: reward 0", rollout.episode_id,
                          rollout.prompt.prompt_id)  # fmt: skip
            rollout.score, rollout.reward = Score(0.0, {}, {"score_errors": 1.0}), 0.0
