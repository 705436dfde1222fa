"""The built-in toy agentic task: look a key up in a small store, then answer with its value.

Small enough that a tiny randomly initialised model learns it in a few hundred CPU steps, yet
it feeds every loss channel: the reward is graded (RL), a miscopied key is a tool error whose
message lists the keys so the next turn can recover (an SDPO error site), and the task can
demonstrate episodes and act as an oracle teacher (SFT warm start, replay pairs).

A correct episode (three assistant turns allow one failed call and its recovery):

    system     Tools: lookup(key)
    user       Value of "k"?
    assistant  <tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call>
    tool       42
    assistant  42

Keys are quoted in the question and in error listings as JSON quotes them in the call, so
copying a key copies the same tokens. Keys default to one letter (one token): a tiny model
learns to copy one token across the ~40-token tool-call preamble within a few hundred steps,
two-letter keys take it much longer.

Reward rubric, in [0, 1]:
    1.0  the last assistant message's content, stripped, is the value
    otherwise the sum of
    0.1  some call was a well-formed lookup (arguments {"key": str})
    0.3  some lookup asked for the question's key
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from string import ascii_lowercase
from typing import Any

from meshrl.tasks.base import Prompt, ToolResult
from meshrl.traces.errors import ErrorClassifier, mark_error_sites
from meshrl.traces.schema import ToolCall, TraceExample, Turn

LOOKUP = "lookup"
SYSTEM = "Tools: lookup(key)"  # short, so an episode stays under 120 tiny-tokenizer tokens
SOURCE = "meshrl.tasks.toy"

ANSWER_REWARD = 1.0
RIGHT_KEY_REWARD = 0.3
WELL_FORMED_REWARD = 0.1

_CLASSIFIER = ErrorClassifier()


def _quoted(keys: Iterable[str]) -> str:
    return ", ".join(f'"{key}"' for key in keys)


def _lookup_call(call_id: str, key: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": LOOKUP, "arguments": {"key": key}}}


def lookup_key(call: dict[str, Any]) -> str | None:
    """The key of a well-formed lookup call (arguments {"key": str}), else None."""
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if function.get("name") != LOOKUP or not isinstance(arguments, dict):
        return None
    key = arguments.get("key")
    return key if isinstance(key, str) else None


def malformed_lookup(name: str, arguments: Any, listing: str) -> ToolResult | None:
    """The tool error of a call that is not `lookup` with a string key (`listing` appended to the
    missing-key error: where the task points the policy), None for a well-formed one."""
    if name != LOOKUP:
        return ToolResult(f'error: unknown tool "{name}"; tools: "{LOOKUP}"', is_error=True)
    if not isinstance(arguments, dict) or not isinstance(arguments.get("key"), str):
        return ToolResult(f'error: lookup needs {{"key": "..."}}{listing}', is_error=True)
    return None


def _asked_keys(messages: list[dict[str, Any]]) -> list[str]:
    """Keys of the well-formed lookup calls in the conversation."""
    keys = []
    for message in messages:
        if message.get("role") != "assistant":
            continue
        keys += [key for call in message.get("tool_calls") or [] if (key := lookup_key(call)) is not None]
    return keys


LOOKUP_SCHEMA = {
    "type": "function",
    "function": {
        "name": LOOKUP,
        "description": "The value stored under a key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}


class ToolTask:
    """Key-value lookup with one tool; all randomness comes from the rng passed in.

    `declare_tools = False` leaves the lookup's schema out of the chat template (the system prompt
    names the tool either way): a template that renders schemas (Qwen3's) puts ~280 tokens of JSON
    before the question, across which the tiny model never learns to copy the key.
    """

    def __init__(
        self,
        n_keys: int = 4,
        key_len: int = 1,
        value_len: int = 2,
        max_turns: int = 3,
        recovery_rate: float = 0.3,
        guess_rate: float = 0.0,
        think_words: int = 0,
        declare_tools: bool = True,
    ) -> None:
        if not 1 <= n_keys <= 25 * key_len:
            raise ValueError(f"n_keys must be in [1, {25 * key_len}] so a misspelled key can miss the store")
        if value_len < 1 or n_keys > 9 * 10 ** (value_len - 1):
            raise ValueError(f"value_len {value_len} has too few distinct values for {n_keys} keys")
        if max_turns < 2:
            raise ValueError("max_turns must be at least 2: a lookup and an answer")
        if not 0.0 <= recovery_rate <= 1.0 or (recovery_rate > 0 and max_turns < 3):
            raise ValueError("recovery_rate must be in [0, 1], and recoveries need max_turns >= 3")
        if not 0.0 <= guess_rate <= 1.0:
            raise ValueError("guess_rate must be in [0, 1]")
        if think_words < 0:
            raise ValueError("think_words must be at least 0")
        self.n_keys = n_keys
        self.key_len = key_len
        self.value_len = value_len
        self.max_turns = max_turns
        self.recovery_rate = recovery_rate
        self.guess_rate = guess_rate
        self.think_words = think_words
        self.tools = [LOOKUP_SCHEMA] if declare_tools else None

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        return [self._prompt(rng) for _ in range(n)]

    def _prompt(self, rng: random.Random) -> Prompt:
        keys: list[str] = []
        while len(keys) < self.n_keys:
            key = "".join(rng.choice(ascii_lowercase) for _ in range(self.key_len))
            if key not in keys:
                keys.append(key)
        values = rng.sample(range(10 ** (self.value_len - 1), 10**self.value_len), self.n_keys)
        store = {key: str(value) for key, value in zip(keys, values)}
        key = rng.choice(keys)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f'Value of "{key}"?'}]
        return Prompt(
            prompt_id=f"toy-{rng.getrandbits(64):016x}",
            messages=messages,
            answer=store[key],
            info={"store": store, "key": key},
        )

    def call_tool(self, prompt: Prompt, name: str, arguments: dict[str, Any]) -> ToolResult:
        store = prompt.info["store"]
        if (malformed := malformed_lookup(name, arguments, f"; keys: {_quoted(store)}")) is not None:
            return malformed
        key = arguments["key"]
        if key not in store:
            return ToolResult(f'error: no such key "{key}"; keys: {_quoted(store)}', is_error=True)
        return ToolResult(store[key])

    def reward(self, prompt: Prompt, messages: list[dict[str, Any]]) -> float:
        replies = [m for m in messages if m.get("role") == "assistant"]
        if replies and (replies[-1].get("content") or "").strip() == prompt.answer:
            return ANSWER_REWARD
        asked = _asked_keys(replies)
        return (WELL_FORMED_REWARD if asked else 0.0) + (RIGHT_KEY_REWARD if prompt.info["key"] in asked else 0.0)

    def demonstrations(self, rng: random.Random, n: int) -> list[TraceExample]:
        """Episodes of the prompts `sample_prompts` draws from the same rng state.

        About `guess_rate` of them answer at once with a value from memory (a shortcut real
        traces carry; usually wrong, rewarded as the rubric says), the others are correct,
        about `recovery_rate` of those after miscopying the key and recovering. With `think_words`,
        every assistant turn reasons first (1 to `think_words` words of a plan, as
        `reasoning_content`; the answer turn at most 2): a thinking model's demonstrations, for chat
        formats that render it.
        """
        demos = []
        for prompt in self.sample_prompts(rng, n):
            if self.guess_rate and rng.random() < self.guess_rate:
                demos.append(self._guess(rng, prompt))
                continue
            keys = [prompt.info["key"]]
            if rng.random() < self.recovery_rate:
                keys.insert(0, self._misspelled(rng, prompt))
            turns = [Turn(role=m["role"], content=m["content"]) for m in prompt.messages]
            for i, key in enumerate(keys):
                call = ToolCall(id=f"call_{i}", name=LOOKUP, arguments={"key": key})
                result = self.call_tool(prompt, call.name, call.arguments)
                plan = f'The question asks for "{prompt.info["key"]}" so I call lookup with a key from it first'
                turns.append(Turn(role="assistant", reasoning_content=self._thought(rng, plan), tool_calls=[call]))
                turns.append(
                    Turn(role="tool", content=result.content, tool_call_id=call.id, is_error=result.is_error or None)
                )
            plan = "The tool returned the value so I answer with it now and stop"
            thought = self._thought(rng, plan, most=2)  # the tiny model copies the value across a short thought only
            turns.append(Turn(role="assistant", reasoning_content=thought, content=prompt.answer))
            mark_error_sites(turns, _CLASSIFIER)  # as ingestion and rollouts mark them
            demos.append(
                TraceExample(trace_id=prompt.prompt_id, source=SOURCE, turns=turns, final_reward=ANSWER_REWARD)
            )
        return demos

    def _guess(self, rng: random.Random, prompt: Prompt) -> TraceExample:
        guess = str(rng.randrange(10 ** (self.value_len - 1), 10**self.value_len))
        turns = [Turn(role=m["role"], content=m["content"]) for m in prompt.messages]
        thought = self._thought(rng, "I remember this store so I answer from memory at once")
        turns.append(Turn(role="assistant", reasoning_content=thought, content=guess))
        reward = self.reward(prompt, [*prompt.messages, {"role": "assistant", "content": guess}])
        return TraceExample(trace_id=prompt.prompt_id, source=SOURCE, turns=turns, final_reward=reward)

    def _thought(self, rng: random.Random, plan: str, most: int | None = None) -> str | None:
        """The first 1 to `think_words` (at most `most`) words of `plan` (None without `think_words`:
        no rng drawn)."""
        if not self.think_words:
            return None
        return " ".join(plan.split()[: rng.randint(1, min(self.think_words, most or self.think_words))])

    @staticmethod
    def _misspelled(rng: random.Random, prompt: Prompt) -> str:
        """The question's key with one letter changed, missing from the store."""
        key, store = prompt.info["key"], prompt.info["store"]
        near = [key[:i] + c + key[i + 1 :] for i in range(len(key)) for c in ascii_lowercase if c != key[i]]
        return rng.choice([k for k in near if k not in store])

    def oracle_action(self, prompt: Prompt, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """Answer once the last tool result is the value; otherwise look the question's key up."""
        last = messages[-1] if messages else {}
        if last.get("role") == "tool" and last.get("content") == prompt.answer:
            return {"role": "assistant", "content": prompt.answer}
        n_calls = sum(len(m.get("tool_calls") or []) for m in messages)
        return {"role": "assistant", "content": "", "tool_calls": [_lookup_call(f"call_{n_calls}", prompt.info["key"])]}

    def hint(self, error_kind: str, error_meta: dict[str, Any]) -> str | None:
        if "unknown tool" in str(error_meta.get("excerpt", "")):
            return "Hint: the only tool is lookup; call it with the key from the question."
        return "Hint: call lookup with one of the listed keys, exactly as written."
