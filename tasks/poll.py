"""A multi-turn task with mixed episode lengths and a slow tool: poll a job until it is done.

It stands in for long-horizon agent work (a test run, a build in a sandbox) when measuring
and testing generation: each prompt's job takes 0 to `max_polls - 1` further polls, the tool
sleeps `tool_latency_s` per call, and the episode ends with the job's result.

    user       Job "k": poll it until done.
    assistant  <tool_call>{"name": "poll", "arguments": {"ticket": "k"}}</tool_call>
    tool       running; next ticket "q"
    assistant  <tool_call>{"name": "poll", "arguments": {"ticket": "q"}}</tool_call>
    tool       done: 42
    assistant  42

Tickets chain (each result names the next), so the tool is stateless: the same call always
gets the same answer, whichever episode or process makes it. A wrong ticket is a tool error
listing the right one. Reward: 1 when the last assistant message is the result, else 0.1 per
valid poll up to 0.5.
"""

from __future__ import annotations

import random
import time
from string import ascii_lowercase
from typing import Any

from meshrl.tasks.base import Prompt, ToolResult
from meshrl.traces.schema import ToolCall, TraceExample, Turn

POLL = "poll"


class PollTask:
    def __init__(self, min_polls: int = 1, max_polls: int = 8, tool_latency_s: float = 0.0) -> None:
        if not 1 <= min_polls <= max_polls:
            raise ValueError(f"need 1 <= min_polls <= max_polls, got {min_polls}, {max_polls}")
        if tool_latency_s < 0:
            raise ValueError(f"tool_latency_s must be >= 0, got {tool_latency_s}")
        self.min_polls, self.max_polls, self.tool_latency_s = min_polls, max_polls, tool_latency_s
        self.max_turns = max_polls + 1  # the polls and the answer

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        prompts = []
        for _ in range(n):
            tickets = rng.sample(ascii_lowercase, rng.randint(self.min_polls, self.max_polls))
            result = str(rng.randrange(10, 100))
            prompts.append(Prompt(
                prompt_id=f"poll-{rng.getrandbits(64):016x}",
                messages=[{"role": "user", "content": f'Job "{tickets[0]}": poll it until done.'}],
                answer=result,
                info={"tickets": tickets},
            ))  # fmt: skip
        return prompts

    def call_tool(self, prompt: Prompt, name: str, arguments: dict[str, Any]) -> ToolResult:
        time.sleep(self.tool_latency_s)
        tickets = prompt.info["tickets"]
        ticket = arguments.get("ticket") if isinstance(arguments, dict) else None
        if name != POLL or not isinstance(ticket, str):
            return ToolResult(f'error: call poll with {{"ticket": "..."}}; next ticket "{tickets[0]}"', is_error=True)
        # tickets are distinct: one before the last answers with the next, the last with the result
        for i, known in enumerate(tickets[:-1]):
            if ticket == known:
                return ToolResult(f'running; next ticket "{tickets[i + 1]}"')
        if ticket == tickets[-1]:
            return ToolResult(f"done: {prompt.answer}")
        return ToolResult(f'error: no ticket "{ticket}"; first ticket "{tickets[0]}"', is_error=True)

    def reward(self, prompt: Prompt, messages: list[dict[str, Any]]) -> float:
        replies = [m for m in messages if m.get("role") == "assistant"]
        if replies and (replies[-1].get("content") or "").strip() == prompt.answer:
            return 1.0
        results = [m for m in messages if m.get("role") == "tool" and not m.get("is_error")]
        return min(0.5, 0.1 * len(results))

    def demonstrations(self, rng: random.Random, n: int) -> list[TraceExample]:
        """Correct episodes of the prompts `sample_prompts` draws from the same rng state."""
        demos = []
        for prompt in self.sample_prompts(rng, n):
            turns = [Turn(role=m["role"], content=m["content"]) for m in prompt.messages]
            for i, ticket in enumerate(prompt.info["tickets"]):
                call = ToolCall(id=f"call_{i}", name=POLL, arguments={"ticket": ticket})
                turns.append(Turn(role="assistant", tool_calls=[call]))
                result = self.call_tool(prompt, POLL, call.arguments)
                turns.append(Turn(role="tool", content=result.content, tool_call_id=call.id))
            turns.append(Turn(role="assistant", content=prompt.answer))
            demos.append(TraceExample(trace_id=prompt.prompt_id, source="meshrl.tasks.poll", turns=turns,
                                      final_reward=1.0))  # fmt: skip
        return demos

    def oracle_action(self, prompt: Prompt, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """Poll the ticket the last result named (the first one at the start); answer once done."""
        last = messages[-1].get("content") or "" if messages else ""
        if last.startswith("done: "):
            return {"role": "assistant", "content": prompt.answer}
        ticket = last.rsplit('"', 2)[1] if last.count('"') >= 2 else prompt.info["tickets"][0]
        calls = sum(len(m.get("tool_calls") or []) for m in messages)
        call = {"id": f"call_{calls}", "type": "function", "function": {"name": POLL, "arguments": {"ticket": ticket}}}
        return {"role": "assistant", "content": "", "tool_calls": [call]}
