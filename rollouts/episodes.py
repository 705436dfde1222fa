"""Multi-turn episodes: the generator samples assistant turns, the task answers tool calls.

A rollout keeps the exact token ids the policy saw and sampled — prompt, completions, and
the templated tool turns spliced in between — with the sampler's logprob on every sampled
token. The trainer scores those same ids, so nothing is re-tokenized between sampling and
training.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from meshrl.inference.toolcalls import parse_tool_calls
from meshrl.tasks.base import Prompt, Task
from meshrl.traces.collator import TraceCollator


@dataclass
class Rollout:
    prompt: Prompt
    messages: list[dict[str, Any]]
    token_ids: list[int]
    loss_mask: list[bool]  # sampled tokens
    logprobs: list[float]  # the sampler's, 0 off the mask
    version: int  # policy version that sampled it
    finish_reason: str = "stop"
    reward: float | None = None
    group: int = 0  # rollouts of one prompt share a group (advantage normalisation)
    turns: int = 0
    tool_errors: int = 0
    info: dict[str, Any] = field(default_factory=dict)


class EpisodeRunner:
    """Runs batches of episodes of a task with an engine (HF or vLLM) and the policy's chat template."""

    def __init__(self, engine: Any, tokenizer: PreTrainedTokenizerBase, task: Task) -> None:
        self.engine, self.tokenizer, self.task = engine, tokenizer, task
        self.footer = TraceCollator(tokenizer).footer  # the end-of-turn marker the engine stops on
        self.stop_ids = [tokenizer.convert_tokens_to_ids(self.footer)] if self.footer else []

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _tool_turn_ids(self, messages: list[dict[str, Any]], tool_messages: list[dict[str, Any]]) -> list[int]:
        """Tokens between the sampled end-of-turn and the next assistant turn's first sampled token."""
        before = self._render(messages)
        after = self._render(messages + tool_messages, generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("the chat template does not render tool turns as an extension of the conversation")
        tail = before[before.rfind(self.footer) + len(self.footer) :] if self.footer else ""
        return self._ids(tail + after[len(before) :])

    def run(
        self,
        prompts: list[Prompt],
        samples_per_prompt: int,
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        version: int,
        seed: int,
    ) -> list[Rollout]:
        rollouts = []
        for group, prompt in enumerate(prompts):
            for _ in range(samples_per_prompt):
                ids = self._ids(self._render(prompt.messages, generation_prompt=True))
                rollouts.append(Rollout(prompt, [dict(m) for m in prompt.messages], ids, [False] * len(ids),
                                        [0.0] * len(ids), version, group=group))  # fmt: skip
        active = list(rollouts)
        rng = random.Random(seed)
        for _ in range(self.task.max_turns):
            if not active:
                break
            completions = self.engine.generate(
                [r.token_ids for r in active], temperature=temperature, top_p=top_p,
                max_new_tokens=max_new_tokens, stop_token_ids=self.stop_ids, seed=rng.randrange(2**31),
            )  # fmt: skip
            still = []
            for r, c in zip(active, completions):
                r.turns += 1
                r.token_ids += list(c.completion_ids)
                r.loss_mask += [True] * len(c.completion_ids)
                r.logprobs += list(c.logprobs)
                r.finish_reason = c.finish_reason
                content, calls = parse_tool_calls(self.tokenizer.decode(c.completion_ids, skip_special_tokens=True))
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    message["tool_calls"] = calls
                r.messages.append(message)
                if c.finish_reason != "stop" or not calls:
                    continue
                tool_messages = []
                for call in calls:
                    result = self.task.call_tool(r.prompt, call["function"]["name"], call["function"]["arguments"])
                    r.tool_errors += result.is_error
                    tool_messages.append({"role": "tool", "content": result.content, "tool_call_id": call["id"],
                                          "is_error": result.is_error})  # fmt: skip
                tool_ids = self._tool_turn_ids(r.messages, tool_messages)
                r.token_ids += tool_ids
                r.loss_mask += [False] * len(tool_ids)
                r.logprobs += [0.0] * len(tool_ids)
                r.messages += tool_messages
                still.append(r)
            active = still
        for r in rollouts:
            r.reward = float(self.task.reward(r.prompt, r.messages))
        return rollouts
