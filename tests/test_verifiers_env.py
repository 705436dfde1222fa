"""verifiers (v1) tasksets as meshrl tasks: two written here (tests/fixtures/vf_single.py, a rubric
with a stop hook; vf_calc.py, an MCP toolset) and the shipped example, in process and through
`meshrl train` (real meshes, the tiny model: components logged, the reward their weighted sum)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1")  # the [verifiers] extra (in [dev], so CI runs these)

from verifiers.v1.errors import SandboxError

from meshrl.inference.completion import Completion
from meshrl.models.tiny import build_tokenizer
from meshrl.rollouts.batches import rollout_trace
from meshrl.rollouts.episodes import EpisodeFormat, rubric_means
from meshrl.tasks.base import Ending
from meshrl.tasks.verifiers_env import VerifiersTask
from meshrl.tasks.verifiers_runtime import SandboxRuntime
from meshrl.traces.collator import TraceCollator
from meshrl.traces.errors import ErrorClassifier

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from e2e import MESHRL, REPO, SMALL
from e2e import records as e2e_records

ENV = {**os.environ, "PYTHONPATH": str(REPO / "tests" / "fixtures")}


@pytest.fixture(scope="module")
def single() -> VerifiersTask:
    return VerifiersTask("vf_single", {"system_prompt_text": "Digits only."}, eval_tasks=1)


@pytest.fixture(scope="module")
def calc() -> VerifiersTask:
    return VerifiersTask("vf_calc")


def _turn(episodes: EpisodeFormat, rollout, text: str) -> list[dict]:
    ids = episodes.tokenizer(text, add_special_tokens=False)["input_ids"]
    completion = Completion(rollout.token_ids, ids, [-0.5] * len(ids), "stop", [0] * len(ids))
    return episodes.add_turn(rollout, completion)


def test_prompts_args_and_the_eval_split(single):
    prompts = single.sample_prompts(random.Random(0), 20)
    assert {p.messages[0]["content"] for p in prompts} == {"Digits only."}  # the taskset config arg
    assert {p.messages[1]["content"] for p in prompts} == {"What is 2+3?", "What is 4+4?"}
    assert len({p.prompt_id for p in prompts}) == 20  # each draw is its own group
    assert {p.messages[1]["content"] for p in single.eval_prompts(random.Random(0), 5)} == {"What is 1+6?"}
    with pytest.raises(ValueError, match=r"task.kwargs.args for 'vf_single' \(QATasksetConfig\)"):
        VerifiersTask("vf_single", {"system_prompt_text": 3})
    with pytest.raises(ValueError, match="task.kwargs.eval_tasks 3"):
        VerifiersTask("vf_single", eval_tasks=3)
    with pytest.raises(ModuleNotFoundError, match="no_such_taskset"):
        VerifiersTask("no_such_taskset")
    with pytest.raises(ValueError, match=r"task.kwargs.args.id"):
        VerifiersTask("vf_single", {"id": "other"})
    refused = r"'vf_refused' needs verifiers' own rollouts: SandboxTask.setup is overridden; tests_pass needs"
    with pytest.raises(ValueError, match=refused):
        VerifiersTask("vf_refused")


def test_rubric_components_stop_hooks_and_the_episode_format(single):
    """The v1 rubric scores the episode meshrl ran: reward = weighted sum, components and metrics
    kept; the task's @vf.stop (one turn) ends an episode that still calls tools."""
    tok = build_tokenizer(512, "hermes")
    episodes = EpisodeFormat(tok, single)
    (prompt,) = single.sample_prompts(random.Random(3), 1)
    answer = {"What is 2+3?": "5", "What is 4+4?": "8"}[prompt.messages[1]["content"]]
    rollout = episodes.start(prompt)
    calls = _turn(episodes, rollout, '<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call><|im_end|>')
    assert calls and not episodes.goes_on(rollout, calls)  # the stop hook, not max_turns (4)
    assert rollout.stop_condition == "one_turn"
    episodes.score(rollout)
    assert rollout.reward == 0.5 and rollout.score.components == {"correct": 0.0, "short": 1.0}
    assert rollout.score.metrics["stopped_by_hook"] == 1.0  # the trace's stop condition reaches the rubric
    rollout = episodes.start(prompt)
    _turn(episodes, rollout, f"{answer}<|im_end|>")
    assert not episodes.goes_on(rollout, []) and rollout.stop_condition == "agent_completed"
    episodes.score(rollout)
    assert rollout.reward == 1.5
    assert rollout.score.metrics == {"reply_len": 1.0, "truncated": 0.0, "stopped_by_hook": 0.0}
    assert rubric_means([rollout, rollout])["rubric/correct"] == 1.0
    assert rubric_means([rollout])["task_metric/reply_len"] == 1.0
    # a turn cut at max_new_tokens is truncated for verifiers (`trace.is_truncated`)
    rollout = episodes.start(prompt)
    ids = tok(answer, add_special_tokens=False)["input_ids"]
    assert (
        episodes.add_turn(rollout, Completion(rollout.token_ids, ids, [-0.5] * len(ids), "length", [0] * len(ids)))
        == []
    )
    episodes.goes_on(rollout, [])
    episodes.score(rollout)
    assert rollout.score.metrics["truncated"] == 1.0


def test_mcp_tools_reach_the_template_and_run_in_an_episode(calc):
    """Hermes-templated tokenizer (real-checkpoint shape): the toolset's MCP schema is rendered,
    the parsed call runs on the in-process MCP server, bad arguments are a tool error the
    episode goes on from, and the collator renders the episode to the ids the policy saw."""
    assert calc.tools == [
        {"type": "function", "function": {"name": "calc_add", "description": "Add two integers.", "parameters": {
            "properties": {"a": {"title": "A", "type": "integer"}, "b": {"title": "B", "type": "integer"}},
            "required": ["a", "b"], "title": "addArguments", "type": "object"}}}
    ]  # fmt: skip
    tok = build_tokenizer(512, "hermes")
    episodes = EpisodeFormat(tok, calc)
    prompt = next(p for p in calc.sample_prompts(random.Random(0), 10) if "17+25" in p.messages[0]["content"])
    rollout = episodes.start(prompt)
    assert '"name": "calc_add"' in tok.decode(rollout.token_ids)
    for text, expect in [
        ('<tool_call>\n{"name": "calc_add", "arguments": {"a": "x", "b": 1}}\n</tool_call><|im_end|>', True),
        ('<tool_call>\n{"name": "calc_add", "arguments": {"a": 17, "b": 25}}\n</tool_call><|im_end|>', False),
    ]:
        calls = _turn(episodes, rollout, text)
        results = [episodes.call_tool(rollout, c) for c in calls]
        assert [r.is_error for r in results] == [expect]
        episodes.add_tool_results(rollout, calls, results)
        assert episodes.goes_on(rollout, calls)
    assert rollout.messages[-1]["content"] == "42" and rollout.tool_errors == 1
    _turn(episodes, rollout, "It is 42.<|im_end|>")
    episodes.score(rollout)
    assert rollout.reward == 1.5 and rollout.score.components == {"correct": 1.0, "used_tool": 1.0}
    batch = TraceCollator(tok, tools=calc.tools)([rollout_trace(rollout, ErrorClassifier())]).batch
    assert batch["input_ids"][0][: len(rollout.token_ids)].tolist() == rollout.token_ids


def test_results_of_the_last_turns_calls_are_not_scored():
    """meshrl answers the calls of an episode's last turn; verifiers never records those results,
    so neither does the trace its rubric scores (`used_tool` stays 0 here, as it would there)."""
    one_turn = VerifiersTask("vf_calc", max_turns=1)
    tok = build_tokenizer(512, "hermes")
    episodes = EpisodeFormat(tok, one_turn)
    prompt = next(p for p in one_turn.sample_prompts(random.Random(0), 10) if "17+25" in p.messages[0]["content"])
    rollout = episodes.start(prompt)
    call = '<tool_call>\n{"name": "calc_add", "arguments": {"a": 17, "b": 25}}\n</tool_call><|im_end|>'
    calls = _turn(episodes, rollout, call)
    episodes.add_tool_results(rollout, calls, [episodes.call_tool(rollout, c) for c in calls])
    assert not episodes.goes_on(rollout, calls) and rollout.stop_condition == "max_turns"
    assert rollout.messages[-1]["content"] == "42"
    episodes.score(rollout)
    assert rollout.score.components == {"correct": 0.0, "used_tool": 0.0}
    # another process whose taskset lacks the task (a remote worker's dataset) rebuilds it from the prompt
    one_turn.by_key.clear()
    assert one_turn.score(prompt, rollout.messages, Ending("max_turns", "stop")) == rollout.score


def test_shipped_example_scores_the_asked_letter():
    task = VerifiersTask("meshrl.tasks.vf_letters")
    (prompt,) = task.sample_prompts(random.Random(0), 1)
    letter = prompt.messages[0]["content"].split("many ")[1][0]
    reply = {"role": "assistant", "content": f"{letter}{letter}x y"}
    score = task.score(prompt, [*prompt.messages, reply], Ending("agent_completed", "stop"))
    assert score.components == {"letter_share": 0.5, "answered": 1.0} and score.reward == 0.5


@pytest.mark.mesh
def test_train_on_a_verifiers_taskset_through_real_meshes(tmp_path):
    """`meshrl train` with the single-turn taskset: every rubric part logged each step, and the
    step's reward/mean is their weighted sum (1 x correct + 0.5 x short) over the same rollouts;
    so is the final evaluation's, on the held-out task."""
    out = tmp_path / "run"
    kwargs = json.dumps({"env": "vf_single", "args": {"system_prompt_text": "Digits only."}, "eval_tasks": 1})
    args = [*MESHRL, "train", *SMALL, "--output-dir", str(out), "--max-steps", "2",
            "--task.import_path", "meshrl.tasks.verifiers_env:VerifiersTask", "--task.kwargs", kwargs,
            "--loss.replay.weight", "0", "--loss.sdpo.weight", "0", "--teachers.members", "[]",
            "--eval.interval", "2", "--eval.n", "2", "--eval.k", "2"]  # fmt: skip
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    records = e2e_records(out)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert r["reward/mean"] == pytest.approx(r["rubric/correct"] + 0.5 * r["rubric/short"])
        assert "task_metric/reply_len" in r
    # the final policy's evaluation on the held-out task: its rubric parts too
    assert records[-1]["eval/reward_sampled"] == pytest.approx(
        records[-1]["eval/rubric/correct"] + 0.5 * records[-1]["eval/rubric/short"]
    )


def test_a_reward_that_runs_code_uses_the_sandbox_as_its_runtime():
    """vf_code's reward writes the answer and a test through `runtime.write` and runs the test with
    `runtime.run`: refused without a sandbox, run in it with one (each run a fresh sandbox call)."""
    with pytest.raises(ValueError, match=r"tests_pass needs the task's runtime \(set task.kwargs.sandbox\)"):
        VerifiersTask("vf_code")
    task = VerifiersTask("vf_code", sandbox={"pool_size": 2, "wall_time_s": 3.0})
    (prompt,) = task.sample_prompts(random.Random(0), 1)

    def reward(answer: str) -> float:
        return task.score(prompt, [*prompt.messages, {"role": "assistant", "content": answer}],
                          Ending("agent_completed", "stop")).reward  # fmt: skip

    assert reward("def square(x):\n    return x * x\n") == 1.0
    assert reward("def square(x):\n    return x + x\n") == 0.0
    assert reward("def square(x):\n    return x * x\nwhile True:\n    pass\n") == 0.0  # killed at a limit
    runtime = SandboxRuntime(task.sandbox)
    with pytest.raises(SandboxError, match="only in its working directory"):
        asyncio.run(runtime.write("/etc/cron.d/x", b"owned"))
