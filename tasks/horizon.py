"""A built-in task whose horizon is a knob: follow a chain of lookups, `hops` of them, then answer.

The question names the chain's first key; each key's result names the next one among decoys
(`use "q", not "x", not "Z"`; with `shuffle`, in random order), and the last key's result holds the
digit the assistant answers with (quoted, one token as the keys are: the task asks the policy to
follow and copy, not to respell a number; guessing it pays nothing, as the reward below says). An
episode of `hops` hops is `hops` lookups and an answer: `hops + 1` turns, every one of which the
policy must get right. Keys are single letters (one token), so the
tiny model can copy them; `decoys` sets how many wrong keys each result offers and `filler_words`
pads each result with that many words, so an episode's tokens can pass the run's budget and the
context policy has to act.

    system     Tools: lookup(key)
    user       Follow "k".
    assistant  <tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call>
    tool       use "q", not "x", not "Z"
    assistant  <tool_call>{"name": "lookup", "arguments": {"key": "q"}}</tool_call>
    tool       value "7"
    assistant  7

A decoy is in no store: looking one up is a tool error repeating the result it was offered in (an
SDPO site at whatever depth it happens, whose hint is that result's `use "q"`), from which the next
turn can recover.

Reward, in [0, 1]:
    1.0  the last assistant message's content, stripped, is the value, and every key of the chain
         was reached in order (below): guessing keys until the last one turns up earns no answer
    otherwise `hop_credit` × (chain keys reached in order) / `hops`, where a key counts only when a
    turn that made no other call looked it up after the previous key's result was shown: a policy
    that calls every letter, or the same key again, or guesses ahead, reaches nothing it did not follow.

With `start_hops` the task is a curriculum (`tasks.base.Curriculum`): prompts start at
`start_hops` hops and the horizon grows by `grow_by` hops (up to `hops`) once the success rate over
the last `window` episodes at the current horizon reaches `promote_at`.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from string import ascii_letters
from typing import Any

from meshrl.tasks.base import Prompt, ToolResult
from meshrl.tasks.toy import LOOKUP, LOOKUP_SCHEMA, SYSTEM, _lookup_call, lookup_key, malformed_lookup
from meshrl.traces.errors import ErrorClassifier, mark_error_sites
from meshrl.traces.schema import ToolCall, TraceExample, Turn

SOURCE = "meshrl.tasks.horizon"
ANSWER_REWARD = 1.0
FILLER = "the a of and to in is it that for on with as this be are was you or by from at".split()
HELD_OUT = 5  # one chain in HELD_OUT is the eval split's, never drawn for training
HOP_BUDGET = "hop_budget"  # the stop that ends an episode past its prompt's hops + retries turns
BESIDE = "the result beside it: "  # a decoy's error, then the result it sat in (where `hint` reads the marked key)

_CLASSIFIER = ErrorClassifier()


@dataclass
class Reached:
    """How far an episode followed its chain: keys reached in order, and whether it answered right."""

    keys: int
    answered: bool


def _calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    return list(message.get("tool_calls") or []) if message.get("role") == "assistant" else []


class HorizonTask:
    """Chains of `hops` lookups (1 to 32); with `start_hops`, a curriculum that grows to `hops`.

    All randomness comes from the rng passed in. `retries`: turns an episode may spend on wrong
    calls beyond its `hops + 1` (the task stops it after, `hop_budget`)."""

    def __init__(
        self,
        hops: int = 4,
        decoys: int = 2,
        shuffle: bool = False,
        filler_words: int = 0,
        retries: int = 2,
        hop_credit: float = 0.5,
        recovery_rate: float = 0.1,
        demo_hops: int | None = None,
        eval_hops: int | None = None,
        start_hops: int | None = None,
        promote_at: float = 0.8,
        window: int = 64,
        grow_by: int = 1,
    ) -> None:
        if not 1 <= hops <= 32:
            raise ValueError(f"hops must be in [1, 32], got {hops}")
        if not 0 <= decoys <= len(ascii_letters) - hops:
            raise ValueError(f"decoys must be in [0, {len(ascii_letters) - hops}] for {hops} hops")
        if filler_words < 0 or retries < 0:
            raise ValueError("filler_words and retries must be at least 0")
        if not 0.0 <= hop_credit < ANSWER_REWARD:
            raise ValueError(f"hop_credit must be in [0, {ANSWER_REWARD}): following is worth less than answering")
        if not 0.0 <= recovery_rate <= 1.0 or (recovery_rate > 0 and (retries < 1 or decoys < 1)):
            raise ValueError("recovery_rate must be in [0, 1], and recoveries need retries >= 1 and decoys >= 1")
        for name, value in (("demo_hops", demo_hops), ("eval_hops", eval_hops), ("start_hops", start_hops)):
            if value is not None and not 1 <= value <= hops:
                raise ValueError(f"{name} must be in [1, hops = {hops}], got {value}")
        if not 0.0 < promote_at <= 1.0 or window < 1 or grow_by < 1:
            raise ValueError("promote_at must be in (0, 1], window and grow_by at least 1")
        self.hops, self.decoys, self.shuffle, self.filler_words = hops, decoys, shuffle, filler_words
        self.retries = retries
        self.hop_credit, self.recovery_rate = hop_credit, recovery_rate
        self.demo_hops = demo_hops or hops
        self.eval_hops = eval_hops or hops
        self.start_hops, self.promote_at, self.window, self.grow_by = start_hops, promote_at, window, grow_by
        self.horizon = start_hops or hops  # the hops of the prompts drawn now (the curriculum moves it)
        self.max_turns = hops + 1 + retries
        self.tools = [LOOKUP_SCHEMA]

    # ------------------------------------------------------------------ prompts

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        return [self._prompt(rng, self.horizon, held_out=False) for _ in range(n)]

    def eval_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """The held-out split at `eval_hops`: chains training never draws."""
        return [self._prompt(rng, self.eval_hops, held_out=True) for _ in range(n)]

    def _prompt(self, rng: random.Random, hops: int, held_out: bool) -> Prompt:
        while True:
            chain = rng.sample(ascii_letters, hops)
            pool = [letter for letter in ascii_letters if letter not in chain]
            value = str(rng.randrange(10))  # one token, copied as the keys are
            digest = zlib.crc32(f"{''.join(chain)}={value}".encode())
            if (digest % HELD_OUT == 0) == held_out:
                break
        store = {}
        for i, key in enumerate(chain):
            decoys = rng.sample(pool, self.decoys)
            entries = [f'use "{chain[i + 1]}"' if i + 1 < hops else f'value "{value}"']
            entries += [f'not "{decoy}"' for decoy in decoys]
            if self.shuffle:
                rng.shuffle(entries)
            filler = " ".join(rng.choice(FILLER) for _ in range(self.filler_words))
            store[key] = ", ".join(entries) + (f"; {filler}" if filler else "")
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f'Follow "{chain[0]}".'}]
        return Prompt(
            prompt_id=f"horizon-{rng.getrandbits(64):016x}",
            messages=messages,
            answer=value,
            info={"horizon": hops, "chain": chain, "store": store, "problem": f"{digest:08x}"},
        )

    # ------------------------------------------------------------------ the episode

    def call_tool(self, prompt: Prompt, name: str, arguments: dict[str, Any]) -> ToolResult:
        store = prompt.info["store"]
        if (malformed := malformed_lookup(name, arguments, "")) is not None:
            return malformed
        key = arguments["key"]
        if key in store:
            return ToolResult(store[key])
        beside = [k for k, result in store.items() if f'"{key}"' in result]
        if not beside:
            return ToolResult(f'error: no such key "{key}"; start from "{prompt.info["chain"][0]}"', is_error=True)
        offered = store[beside[0]].split(";")[0]
        return ToolResult(f'error: no such key "{key}"; {BESIDE}{offered}', is_error=True)

    def stops(self, prompt: Prompt, messages: list[dict[str, Any]]) -> str | None:
        """An episode gets its prompt's hops + 1 turns and `retries` more, whatever the horizon now."""
        return HOP_BUDGET if self._turns_left(prompt, messages) <= 0 else None

    def _turns_left(self, prompt: Prompt, messages: list[dict[str, Any]]) -> int:
        return prompt.info["horizon"] + 1 + self.retries - sum(m.get("role") == "assistant" for m in messages)

    def reached(self, prompt: Prompt, messages: list[dict[str, Any]]) -> Reached:
        """Chain keys looked up in order, each alone in its turn and after the previous one's result
        (the tool turn answering its lookup) was shown."""
        chain, keys, shown = prompt.info["chain"], 0, True  # the question shows the first key
        for message in messages:
            calls = _calls(message)
            if calls:
                if len(calls) == 1 and shown and keys < len(chain) and lookup_key(calls[0]) == chain[keys]:
                    keys, shown = keys + 1, False
            elif message.get("role") == "tool":
                shown = True
        replies = [m for m in messages if m.get("role") == "assistant"]
        last = replies[-1] if replies else {}
        answered = not _calls(last) and (last.get("content") or "").strip() == prompt.answer
        return Reached(keys, answered)

    def reward(self, prompt: Prompt, messages: list[dict[str, Any]]) -> float:
        """The full reward only for the value answered after the whole chain was followed: a policy
        that guesses keys reaches the last one by chance within its turns, and answering from there
        would otherwise pay in full."""
        reached = self.reached(prompt, messages)
        if reached.answered and reached.keys == prompt.info["horizon"]:
            return ANSWER_REWARD
        return self.hop_credit * reached.keys / prompt.info["horizon"]

    # ------------------------------------------------------------------ teachers

    def demonstrations(self, rng: random.Random, n: int) -> list[TraceExample]:
        """Correct episodes of 1 to `demo_hops` hops (uniformly), about `recovery_rate` of them
        looking a decoy up once first and recovering from its error."""
        demos = []
        for _ in range(n):
            prompt = self._prompt(rng, rng.randint(1, self.demo_hops), held_out=False)
            chain, store = prompt.info["chain"], prompt.info["store"]
            wrong = rng.randrange(len(chain)) if self.decoys and rng.random() < self.recovery_rate else None
            turns = [Turn(role=m["role"], content=m["content"]) for m in prompt.messages]
            calls = 0
            for i, key in enumerate(chain):
                keys = [key] if i != wrong else [rng.choice(_decoys(store[chain[i - 1]])) if i else "?", key]
                for attempt in keys:
                    if attempt == "?":  # the first key has no decoys beside it: miscopy the question's
                        attempt = rng.choice([c for c in ascii_letters if c not in store])
                    call = ToolCall(id=f"call_{calls}", name=LOOKUP, arguments={"key": attempt})
                    calls += 1
                    result = self.call_tool(prompt, call.name, call.arguments)
                    turns.append(Turn(role="assistant", tool_calls=[call]))
                    turns.append(
                        Turn(
                            role="tool", content=result.content, tool_call_id=call.id, is_error=result.is_error or None
                        )
                    )
            turns.append(Turn(role="assistant", content=prompt.answer))
            mark_error_sites(turns, _CLASSIFIER)
            demos.append(
                TraceExample(trace_id=prompt.prompt_id, source=SOURCE, turns=turns, final_reward=ANSWER_REWARD)
            )
        return demos

    def oracle_action(self, prompt: Prompt, messages: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Answer once the last key's result is shown; otherwise look the next key of the chain up.

        None (no label, so no replay pair) once the episode left the chain, or has too few turns
        left to finish it: there, going back to the chain's next key (no longer in view) would push
        down the locally right action, copying the key the last result marks."""
        chain, done = prompt.info["chain"], self.reached(prompt, messages).keys
        if _found(messages) != chain[:done] or self._turns_left(prompt, messages) < len(chain) - done + 1:
            return None
        if done == len(chain) and messages and messages[-1].get("role") == "tool":
            return {"role": "assistant", "content": prompt.answer}
        calls = sum(len(_calls(m)) for m in messages)
        return {"role": "assistant", "content": "", "tool_calls": [_lookup_call(f"call_{calls}", chain[done])]}

    def hint(self, error_kind: str, error_meta: dict[str, Any]) -> str | None:
        """The marked key, in the result's own words (`use "q"`), read from the error beside a decoy;
        None where the error names no marked key. The tiny model copies quoted keys, and a hint in
        other words was copied from instead (its teacher picked the right key at none of 25 sites)."""
        excerpt = str(error_meta.get("excerpt", ""))
        marked = excerpt.split(BESIDE, 1)[1] if BESIDE in excerpt else ""
        return next((entry for entry in marked.split(", ") if entry.startswith('use "')), None)

    # ------------------------------------------------------------------ the curriculum

    def summarize(self, prompts: list[Prompt], rewards: list[float]) -> dict[str, Any]:
        """A step's episodes as the curriculum reads them: successes and episodes by horizon."""
        by_horizon: dict[str, list[int]] = {}
        for prompt, reward in zip(prompts, rewards, strict=True):
            tally = by_horizon.setdefault(str(prompt.info["horizon"]), [0, 0])
            tally[0] += reward >= ANSWER_REWARD
            tally[1] += 1
        return by_horizon

    def stage(self, summaries: list[dict[str, Any]]) -> dict[str, float]:
        """Set the horizon prompts are drawn at from the summaries of the steps seen so far, in step
        order (a fold: the same summaries give the same horizon, so a resumed run draws as the
        uninterrupted one did); returns the curriculum's metrics."""
        if self.start_hops is None:
            return {}
        horizon, recent = self.start_hops, []
        for summary in summaries:
            if horizon == self.hops:
                break
            successes, episodes = summary.get(str(horizon), (0, 0))
            if episodes:
                recent.append((successes, episodes))
            while len(recent) > 1 and sum(e for _, e in recent[1:]) >= self.window:
                recent.pop(0)  # the oldest steps beyond the window's episodes
            if sum(e for _, e in recent) >= self.window and sum(s for s, _ in recent) >= self.promote_at * sum(
                e for _, e in recent
            ):
                horizon, recent = min(self.hops, horizon + self.grow_by), []
        self.horizon = horizon
        return {"curriculum/horizon": float(horizon)}


def _found(messages: list[dict[str, Any]]) -> list[str]:
    """The keys an episode looked up that were found (their result no error), in order."""
    keys, pending = [], None
    for message in messages:
        calls = _calls(message)
        if calls:
            pending = lookup_key(calls[0]) if len(calls) == 1 else "?"
        elif message.get("role") == "tool" and pending is not None:
            if not str(message.get("content", "")).startswith("error:"):
                keys.append(pending)
            pending = None
    return keys


def _decoys(result: str) -> list[str]:
    return [part.split('"')[1] for part in result.split(";")[0].split(", ") if part.startswith("not ")]
