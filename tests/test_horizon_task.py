"""The horizon task: chains of lookups, its reward against cheats, its curriculum, and exact resumes."""

from __future__ import annotations

import random
from string import ascii_letters
from typing import Any

import pytest

from meshrl.configs.schema import RunConfig
from meshrl.rollouts.episodes import Rollout
from meshrl.run.streams import GroupStreams
from meshrl.tasks.base import Curriculum, Demonstrating, Hinting, Prompt, Stopping, Task
from meshrl.tasks.horizon import ANSWER_REWARD, HOP_BUDGET, HorizonTask
from meshrl.tasks.toy import LOOKUP
from meshrl.traces.collator import to_message
from tests.episode_play import play

Message = dict[str, Any]


def _prompt(hops: int, seed: int = 0, **kwargs: Any) -> tuple[HorizonTask, Prompt]:
    task = HorizonTask(hops=hops, **kwargs)
    return task, task.sample_prompts(random.Random(seed), 1)[0]


def _turn(*keys: Any, name: str = LOOKUP) -> Message:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": {"key": k}}}
        for i, k in enumerate(keys)]}  # fmt: skip


def test_implements_the_protocols():
    task = HorizonTask(hops=8, start_hops=2)
    for protocol in (Task, Demonstrating, Hinting, Stopping, Curriculum):
        assert isinstance(task, protocol)
    assert task.max_turns == 8 + 1 + 2


@pytest.mark.parametrize("hops", [1, 2, 5, 16, 32])
def test_the_oracle_follows_every_chain_to_its_value(hops):
    task = HorizonTask(hops=hops)
    for prompt in task.sample_prompts(random.Random(hops), 20):
        chain, store = prompt.info["chain"], prompt.info["store"]
        assert prompt.info["horizon"] == hops and len(set(chain)) == hops == len(store)
        messages = play(task, prompt, lambda m, p=prompt: task.oracle_action(p, m))
        assert sum(m["role"] == "assistant" for m in messages) == hops + 1
        assert messages[-1]["content"] == prompt.answer and task.reward(prompt, messages) == ANSWER_REWARD


def test_each_result_names_the_next_key_among_decoys_in_no_fixed_place():
    task = HorizonTask(hops=6, decoys=3, shuffle=True, filler_words=5)
    places = set()
    for prompt in task.sample_prompts(random.Random(0), 30):
        chain, store = prompt.info["chain"], prompt.info["store"]
        for i, key in enumerate(chain):
            entries = store[key].split("; ")[0].split(", ")
            right = f'use "{chain[i + 1]}"' if i + 1 < len(chain) else f'value "{prompt.answer}"'
            assert len(entries) == 4 and right in entries and len(store[key].split("; ")[1].split()) == 5
            assert all(e == right or (e.startswith("not ") and e[5] not in store) for e in entries)
            places.add(entries.index(right))
    assert places == {0, 1, 2, 3}


def test_without_shuffle_the_next_key_comes_first():
    task = HorizonTask(hops=3, decoys=2)
    for prompt in task.sample_prompts(random.Random(0), 10):
        chain, store = prompt.info["chain"], prompt.info["store"]
        assert [store[key].split(", ")[0] for key in chain] == [f'use "{chain[1]}"', f'use "{chain[2]}"',
                                                                 f'value "{prompt.answer}"']  # fmt: skip


def test_a_wrong_key_is_an_error_naming_the_keys_offered_beside_it():
    task, prompt = _prompt(4, decoys=2)
    chain, store = prompt.info["chain"], prompt.info["store"]
    decoy = next(e.split('"')[1] for e in store[chain[1]].split(", ") if e.startswith("not "))
    error = task.call_tool(prompt, LOOKUP, {"key": decoy})
    assert error.is_error and f'"{chain[2]}"' in error.content and f'"{decoy}"' in error.content
    assert error.content.endswith(store[chain[1]])  # the result it sat in, the marked key with it
    assert task.hint("tool_error", {"excerpt": error.content}) == f'use "{chain[2]}"'  # SDPO's hint: that entry
    last = next(e.split('"')[1] for e in store[chain[-1]].split(", ") if e.startswith("not "))
    beside_value = task.call_tool(prompt, LOOKUP, {"key": last}).content
    assert task.hint("tool_error", {"excerpt": beside_value}) is None  # no key is marked beside the value
    stray = next(c for c in ascii_letters if c not in store and f'"{c}"' not in "".join(store.values()))
    assert task.call_tool(prompt, LOOKUP, {"key": stray}).content.endswith(f'start from "{chain[0]}"')
    assert task.call_tool(prompt, "bash", {"cmd": "ls"}).is_error
    assert task.call_tool(prompt, LOOKUP, {"key": 3}).is_error


def test_partial_credit_counts_chain_keys_followed_in_order():
    task, prompt = _prompt(4)
    chain = prompt.info["chain"]
    followed = play(task, prompt, lambda m: _turn(chain[sum(x["role"] == "assistant" for x in m)])
                     if sum(x["role"] == "assistant" for x in m) < 3 else {"role": "assistant", "content": "12"})  # fmt: skip
    assert task.reward(prompt, followed) == pytest.approx(0.5 * 3 / 4)
    assert task.reward(prompt, [*prompt.messages, {"role": "assistant", "content": prompt.answer}]) == 0.0


def test_a_recovery_after_a_wrong_call_still_earns_the_answer():
    task, prompt = _prompt(3, decoys=2)
    chain, store = prompt.info["chain"], prompt.info["store"]
    decoy = next(e.split('"')[1] for e in store[chain[0]].split(", ") if e.startswith("not "))
    script = iter([_turn(chain[0]), _turn(decoy), _turn(chain[1]), _turn(chain[2])])
    messages = play(task, prompt, lambda m: next(script, {"role": "assistant", "content": prompt.answer}))
    assert task.reward(prompt, messages) == 1.0


# ---------------------------------------------------------------------- red team: cheats score nothing


def _cheat(task: HorizonTask, prompt: Prompt, turns: list[Message]) -> float:
    script = iter(turns)
    return task.reward(prompt, play(task, prompt, lambda m: next(script, {"role": "assistant", "content": "0"})))


@pytest.mark.parametrize("seed", range(5))
def test_red_team_cheats_earn_no_more_than_the_keys_they_followed(seed):
    task, prompt = _prompt(6, seed=seed)
    chain, letters = prompt.info["chain"], list(ascii_letters)
    # every letter in one turn, every turn: a brute force of the chain
    assert _cheat(task, prompt, [_turn(*letters)] * task.max_turns) == 0.0
    # the question's key and a guess in one turn, every turn: nothing counts from a shared turn
    assert _cheat(task, prompt, [_turn(chain[0], letter) for letter in letters]) == 0.0
    # the first key again and again: one key reached, however often it is called
    assert _cheat(task, prompt, [_turn(chain[0])] * task.max_turns) == pytest.approx(0.5 / 6)
    # one guess a turn: only chance (a letter in 52) reaches the next key, and the turn budget stops it
    rng = random.Random(1000 + seed)  # not the prompt's own stream, which would replay the chain
    guessed = _cheat(task, prompt, [_turn(chain[0])] + [_turn(rng.choice(letters)) for _ in range(20)])
    assert guessed <= 0.5 * 2 / 6
    # the answer hidden in a call's arguments, or with other text around it, or every digit at once
    assert _cheat(task, prompt, [_turn(prompt.answer)]) == 0.0
    assert _cheat(task, prompt, [{"role": "assistant", "content": f"{prompt.answer} or 13"}]) == 0.0
    digits = " ".join(str(n) for n in range(10))
    assert _cheat(task, prompt, [{"role": "assistant", "content": digits}]) == 0.0
    # a guessed digit with no chain followed: the value is one of ten, and a guess pays nothing
    assert all(_cheat(task, prompt, [{"role": "assistant", "content": str(n)}]) == 0.0 for n in range(10))
    # a lucky guess of the last key (or a later one, then onward), and the value it shows answered:
    # the answer pays only after the whole chain was followed (a 16-hop policy that guessed at random
    # found the last key and answered in 2 of 32 held-out episodes before this rule)
    answer = {"role": "assistant", "content": prompt.answer}
    assert _cheat(task, prompt, [_turn(chain[0]), _turn(chain[-1]), answer]) == pytest.approx(0.5 / 6)
    skipped = [_turn(chain[0]), _turn(chain[3]), _turn(chain[4]), _turn(chain[5]), answer]
    assert _cheat(task, prompt, skipped) == pytest.approx(0.5 / 6)
    assert _cheat(task, prompt, [_turn(c) for c in chain] + [answer]) == ANSWER_REWARD
    # the answer with a call in the same turn: the episode is not over, so it is no answer
    answer_and_call = {**_turn(chain[0]), "content": prompt.answer}
    assert _cheat(task, prompt, [answer_and_call]) < ANSWER_REWARD


def test_the_turn_budget_is_the_prompts_own_whatever_the_horizon():
    task = HorizonTask(hops=16, start_hops=2, retries=1)
    prompt = task.sample_prompts(random.Random(0), 1)[0]
    assert prompt.info["horizon"] == 2
    messages = play(task, prompt, lambda m: _turn(prompt.info["chain"][0]))
    assert sum(m["role"] == "assistant" for m in messages) == 2 + 1 + 1
    assert task.stops(prompt, messages) == HOP_BUDGET


# ---------------------------------------------------------------------- splits, demonstrations, hints


def test_the_held_out_split_never_meets_training():
    task = HorizonTask(hops=2, eval_hops=2, decoys=0, recovery_rate=0)
    train = {p.info["problem"] for p in task.sample_prompts(random.Random(0), 3000)}
    held = task.eval_prompts(random.Random(1), 300)
    assert {p.info["horizon"] for p in held} == {2} and not train & {p.info["problem"] for p in held}
    assert HorizonTask(hops=8, eval_hops=5).eval_prompts(random.Random(0), 1)[0].info["horizon"] == 5


def test_demonstrations_are_correct_episodes_with_recoveries_at_error_sites():
    task = HorizonTask(hops=8, demo_hops=4, recovery_rate=0.5)
    demos = task.demonstrations(random.Random(0), 60)
    assert {sum(t.role == "assistant" for t in d.turns) - 1 for d in demos} == {1, 2, 3, 4, 5}
    recovered = 0
    for demo in demos:
        turns = demo.turns
        errors = [i for i, t in enumerate(turns) if t.role == "tool" and t.is_error]
        recovered += bool(errors)
        assert demo.final_reward == 1.0 and len(errors) <= 1
        assert all(turns[i + 1].tool_error and turns[i + 1].error_meta for i in errors)  # the SDPO site
        prompt = Prompt(demo.trace_id, [to_message(t) for t in turns[:2]], turns[-1].content)
        chain = [t.tool_calls[0].arguments["key"] for i, t in enumerate(turns) if t.tool_calls and i + 1 not in errors]
        assert turns[-1].content.isdigit() and prompt.messages[1]["content"] == f'Follow "{chain[0]}".'
    assert 15 <= recovered <= 45
    assert task.hint("tool_error", {"excerpt": 'error: no such key "x"; start from "k"'}) is None


def test_the_oracle_labels_only_states_on_the_chain_it_can_still_finish():
    """Off the chain, the oracle's next key is no longer in view, and labelling the state would push
    down the locally right action (the key the last result marks): it abstains, so no pair is mined."""
    task, prompt = _prompt(4, decoys=2)
    chain, store = prompt.info["chain"], prompt.info["store"]

    def state(*turns: Message) -> list[Message]:
        script = iter(turns)
        return play(task, prompt, lambda m: next(script, None) or {"role": "assistant", "content": "stop"})[:-1]

    decoy = next(e.split('"')[1] for e in store[chain[0]].split(", ") if e.startswith("not "))
    assert task.oracle_action(prompt, state(_turn(chain[0])))["tool_calls"][0]["function"]["arguments"] == {
        "key": chain[1]}  # fmt: skip
    recovering = state(_turn(chain[0]), _turn(decoy))  # an error keeps the episode on the chain
    assert task.oracle_action(prompt, recovering)["tool_calls"][0]["function"]["arguments"] == {"key": chain[1]}
    assert task.oracle_action(prompt, state(*[_turn(k) for k in chain]))["content"] == prompt.answer
    assert task.oracle_action(prompt, state(_turn(chain[0]), _turn(chain[2]))) is None  # jumped ahead
    assert task.oracle_action(prompt, state(_turn(chain[1]))) is None  # started mid-chain
    assert task.oracle_action(prompt, state(_turn(chain[0], chain[1]))) is None  # two keys in one turn
    # 7 turns (4 hops + answer + 2 retries): after 3, the 4 left finish the chain; after 4, they cannot
    assert task.oracle_action(prompt, state(_turn(chain[0]), _turn(decoy), _turn(decoy))) is not None
    assert task.oracle_action(prompt, state(_turn(chain[0]), _turn(decoy), _turn(decoy), _turn(decoy))) is None


# ---------------------------------------------------------------------- the curriculum


def _summary(horizon: int, successes: int, episodes: int) -> dict[str, list[int]]:
    return {str(horizon): [successes, episodes]}


def test_the_horizon_grows_when_the_recent_success_rate_passes_the_bar():
    task = HorizonTask(hops=16, start_hops=2, promote_at=0.8, window=64, grow_by=2)
    assert task.stage([]) == {"curriculum/horizon": 2.0}
    good, bad = _summary(2, 30, 32), _summary(2, 10, 32)
    assert task.stage([good]) == {"curriculum/horizon": 2.0}  # 32 episodes: the window is not full
    assert task.stage([good, good])["curriculum/horizon"] == 4.0
    assert task.stage([bad, good, good])["curriculum/horizon"] == 4.0  # the window holds the recent steps
    assert task.stage([good, bad, good])["curriculum/horizon"] == 2.0
    assert task.stage([good, good, _summary(2, 32, 32), _summary(4, 30, 32)])["curriculum/horizon"] == 4.0
    climb = [good, good, *[_summary(h, 26, 32) for h in (4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14)]]
    assert task.stage(climb)["curriculum/horizon"] == 16.0
    assert task.stage([*climb, bad, bad])["curriculum/horizon"] == 16.0  # it never shrinks
    assert {p.info["horizon"] for p in task.sample_prompts(random.Random(0), 10)} == {16}
    assert HorizonTask(hops=16).stage([good, good]) == {}  # no start_hops: no curriculum


def test_summaries_count_successes_by_horizon():
    task = HorizonTask(hops=8, start_hops=2)
    prompts = [p for h in (2, 2, 4) for p in HorizonTask(hops=h).sample_prompts(random.Random(h), 1)]
    assert task.summarize(prompts, [1.0, 0.25, 1.0]) == {"2": [1, 2], "4": [1, 1]}


def _draws(config: RunConfig, stop_at: int | None) -> list[list[tuple[str, int]]]:
    """Each step's prompts (id, horizon) as the rollout feed draws them: steps drawn
    max_async_level + 1 ahead of the step collected, each step observed once collected; with
    `stop_at`, the run stops after that many steps and resumes from what a checkpoint keeps (the
    streams as the oldest step in flight found them, the summaries of the steps done)."""
    level, steps = config.generator.max_async_level, config.max_steps

    def fresh() -> GroupStreams:
        return GroupStreams(config, HorizonTask(**config.task.kwargs))

    def scored(prompts: list[Prompt]) -> list[Rollout]:
        rollouts = [Rollout(prompt, [], [], [], [], [0]) for prompt in prompts]
        for rollout in rollouts:  # most succeed: the horizon grows
            rollout.reward = 1.0 if int(rollout.prompt.prompt_id[-1], 16) % 4 else 0.2
        return rollouts

    streams, drawn, before = fresh(), {}, {}
    for step in range(steps):
        for ahead in range(step, min(steps, step + level + 2)):
            if ahead not in drawn:
                before[ahead] = streams.state()
                drawn[ahead] = streams.step_groups(ahead, [])
        streams.observe(step, scored([g.prompt for g in drawn[step]]))
        if step + 1 == stop_at:
            summaries, state = list(streams.summaries), before[stop_at]
            streams = fresh()
            streams.restore(state)
            streams.summaries = summaries
            drawn = {s: groups for s, groups in drawn.items() if s < stop_at}
    return [[(g.prompt.prompt_id, g.prompt.info["horizon"]) for g in drawn[s]] for s in range(steps)]


def test_a_resumed_curriculum_draws_what_the_uninterrupted_run_drew():
    config = RunConfig.model_validate({
        "max_steps": 20, "generator": {"max_async_level": 1},
        "task": {"import_path": "meshrl.tasks.horizon:HorizonTask", "prompts_per_step": 8,
                 "kwargs": {"hops": 16, "start_hops": 1, "window": 8, "promote_at": 0.7, "grow_by": 5}}})  # fmt: skip
    whole = _draws(config, None)
    assert [draw[0][1] for draw in whole] == sorted(draw[0][1] for draw in whole)
    assert whole[0][0][1] == 1 and whole[-1][0][1] == 16  # it climbed, so a resume has something to get right
    for stop_at in (2, 5, 9):
        assert _draws(config, stop_at) == whole
