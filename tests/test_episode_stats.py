"""What a step's record says about its episodes' turns: turns and tool calls, tool errors by the
turn they answered, length end to end (elided results at full size), version spread, and success
by the task's horizon. Hand-built rollouts with exact figures, and one episode played through the
chat format past its budget, whose length must be the unelided context's."""

from __future__ import annotations

import json
import random

from meshrl.inference.completion import Completion
from meshrl.models.tiny import build_tokenizer
from meshrl.rollouts.episode_stats import episode_stats, episode_tokens, turn_bin
from meshrl.rollouts.episodes import EpisodeFormat, EpisodeLimits, Rollout, Segment
from meshrl.tasks.base import Prompt, ToolResult
from meshrl.tasks.poll import PollTask

USER = {"role": "user", "content": "go"}


def _call(n: int) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"id": f"c{i}"} for i in range(n)]}


def _result(error: bool = False) -> dict:
    return {"role": "tool", "content": "r", "is_error": error}


def _rollout(messages: list[dict], runs: list[tuple[bool, int]], versions: list[int], reward: float = 0.0,
             info: dict | None = None, earlier: list[Segment] | None = None) -> Rollout:  # fmt: skip
    """`runs`: the current context as (sampled, length) runs of its loss mask."""
    mask = [sampled for sampled, n in runs for _ in range(n)]
    prompt = Prompt("p", [USER], info=info or {})
    turns = sum(m["role"] == "assistant" for m in messages)
    return Rollout(prompt, [USER, *messages], list(range(len(mask))), mask, [0.0] * len(mask), versions,
                   reward=reward, turns=turns, earlier=earlier or [])  # fmt: skip


def _three_turns() -> Rollout:
    """Turn 1 calls once (fine), turn 2 twice (the first errs), turn 3 answers; versions 3 and 4."""
    messages = [_call(1), _result(), _call(2), _result(error=True), _result(), {"role": "assistant", "content": "x"}]
    runs = [(False, 2), (True, 3), (False, 2), (True, 4), (False, 3), (True, 2)]  # 16 tokens, 9 sampled
    return _rollout(messages, runs, [3, 3, 3, 4, 4, 4, 4, 4, 4], reward=1.0, info={"horizon": 2})


def _elided() -> Rollout:
    """Four turns, three calling once (turn 3's result errs), past its budget once: a 20-token context
    left behind, the current one opening with the 8 tokens elision left of it; versions 5 to 7."""
    messages = [_call(1), _result(), _call(1), _result(), _call(1), _result(error=True), {"role": "assistant"}]
    left = Segment(list(range(20)), [False] * 4 + [True] * 6 + [False] * 10, [0.0] * 20)
    runs = [(False, 8), (True, 3), (False, 2)]  # 13 tokens: 12 fewer than without elision
    return _rollout(messages, runs, [5, 5, 6, 7], reward=0.5, info={"horizon": 2}, earlier=[left])


def _single_turn() -> Rollout:
    return _rollout([{"role": "assistant", "content": "x"}], [(False, 2), (True, 2)], [5, 5], reward=1.0)


def test_a_step_s_episodes_in_exact_figures():
    stats = episode_stats([_three_turns(), _elided(), _single_turn()])
    assert stats == {
        "episode/turns": 8 / 3,
        "episode/tool_calls": 2.0,  # 3 + 3 + 0
        "episode/tokens": 15.0,  # 16, 13 + 12 elided, 4
        "episode/tokens_max": 25,
        "episode/elided_tokens": 4.0,
        "episode/version_spread": 1.0,  # 1, 2, 0
        "episode/version_spread_max": 2,
        # turns 1 and 2 called tools in both episodes, turn 3 in the elided one; none past turn 4
        "tool_errors/turn_1": 0,
        "tool_errors/turn_2": 1,
        "tool_errors/turn_3-4": 1,
        "success/horizon_2": 0.5,  # the single-turn episode's prompt has no horizon
        "rollouts/horizon_2": 2,
    }


def test_success_by_horizon_comes_only_from_an_int_horizon():
    rollouts = [
        _rollout([], [(False, 1)], [0], reward=1.0, info={"horizon": 8}),
        _rollout([], [(False, 1)], [0], reward=0.99, info={"horizon": 8}),
        _rollout([], [(False, 1)], [0], reward=1.0, info={"horizon": 16}),
        _rollout([], [(False, 1)], [0], reward=None, info={"horizon": 16}),  # unscored: not a success
        _rollout([], [(False, 1)], [0], reward=1.0, info={"horizon": True}),
        _rollout([], [(False, 1)], [0], reward=1.0, info={"horizon": "8"}),
    ]
    stats = episode_stats(rollouts)
    horizon = {k: v for k, v in stats.items() if "horizon" in k}
    assert horizon == {"success/horizon_8": 0.5, "success/horizon_16": 0.5, "rollouts/horizon_8": 2,
                       "rollouts/horizon_16": 2}  # fmt: skip
    assert list(horizon)[:2] == ["success/horizon_8", "success/horizon_16"]  # numeric order
    # episodes without tool calls and a task without a horizon: none of those families
    assert not [k for k in episode_stats([_single_turn()]) if k.startswith(("tool_errors/", "success/", "rollouts/"))]
    assert episode_stats([]) == {}


def test_turn_bins_are_log2_past_the_second_turn():
    bins = [turn_bin(t) for t in range(1, 41)]
    assert bins[:2] == ["1", "2"] and bins[2:4] == ["3-4"] * 2 and bins[4:8] == ["5-8"] * 4
    assert bins[8:16] == ["9-16"] * 8 and bins[16:32] == ["17-32"] * 16 and bins[32:] == ["33+"] * 8


class FloodingPollTask(PollTask):
    """PollTask whose every result carries 100 more words: three of them outgrow a 400-token budget."""

    def call_tool(self, prompt: Prompt, name: str, arguments: dict) -> ToolResult:
        result = super().call_tool(prompt, name, arguments)
        return ToolResult(result.content + "\n" + " ".join(["file"] * 100), result.is_error)


def _scripted(task: PollTask, budget: int) -> tuple[EpisodeFormat, Rollout]:
    """An episode played through the chat format with scripted turns (a poll of each ticket in
    turn) under `budget` tokens, eliding where it must."""
    tokenizer = build_tokenizer(512, "chatml")
    prompt = task.sample_prompts(random.Random(0), 1)[0]
    episodes = EpisodeFormat(tokenizer, task, limits=EpisodeLimits(budget, 40, 128, elide=True))
    rollout = episodes.start(prompt)
    for version, ticket in enumerate(prompt.info["tickets"]):
        call = json.dumps({"name": "poll", "arguments": {"ticket": ticket}})
        text = f"<tool_call>\n{call}\n</tool_call>"
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + episodes.stop_ids[:1]
        calls = episodes.add_turn(rollout, Completion(rollout.token_ids, ids, [0.0] * len(ids), "stop",
                                                      [version] * len(ids)))  # fmt: skip
        episodes.add_tool_results(rollout, calls, [episodes.call_tool(rollout, c) for c in calls])
        if not episodes.goes_on(rollout, calls):
            break
    return episodes, rollout


class TersePollTask(FloodingPollTask):
    """Its first result is `ok` (shorter than the marker eliding it would leave), the others flood."""

    def call_tool(self, prompt: Prompt, name: str, arguments: dict) -> ToolResult:
        first = arguments.get("ticket") == prompt.info["tickets"][0]
        return ToolResult("ok", False) if first else super().call_tool(prompt, name, arguments)


def test_a_result_no_longer_than_the_marker_is_never_elided():
    """Eliding a short result would lengthen the context: the episode goes on by eliding the long
    ones alone, oldest first, past the short one."""
    episodes, rollout = _scripted(TersePollTask(6, 6), 400)
    tools = [i for i, m in enumerate(rollout.messages) if m["role"] == "tool"]
    assert rollout.messages[tools[0]]["content"] == "ok" and len(rollout.earlier) >= 2
    assert tools[0] not in rollout.elided and tools[1] in rollout.elided


def test_an_elided_episode_s_length_is_its_context_without_elision():
    """An episode of long results elides twice to go on; its length counts each elided result
    whole: the ids of its context rebuilt with nothing elided."""
    episodes, rollout = _scripted(FloodingPollTask(6, 6), 400)
    assert len(rollout.earlier) >= 2, "the script no longer elides twice"
    full, removed = episode_tokens(rollout)
    assert full == len(episodes.context_ids(rollout, set())) and removed == full - len(rollout.token_ids) > 0
    stats = episode_stats([rollout])
    assert (stats["episode/tokens"], stats["episode/elided_tokens"]) == (full, removed)
    assert stats["episode/turns"] == stats["episode/tool_calls"] == rollout.turns
    assert stats["episode/version_spread"] == rollout.turns - 1
