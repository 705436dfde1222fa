"""Repository tasks: bugs injected into real modules, kept when their own tests break; Claude Code's
tools in a sandbox workspace that lasts one episode; the hidden-test reward against cheats."""

from __future__ import annotations

import ast
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest

from meshrl.tasks.base import Ending, Episodic
from meshrl.tasks.repo import tools
from meshrl.tasks.repo.build import source_tests
from meshrl.tasks.repo.demos import solution_session, unique_context
from meshrl.tasks.repo.mutations import OPERATORS, apply, sites
from meshrl.tasks.repo.scoring import new_capabilities
from meshrl.tasks.repo.sources import load_source
from meshrl.tasks.repo.task import RepoFixTask
from meshrl.traces import TraceExample
from meshrl.traces.claude_code import ingest_claude_code

SANDBOX = {"backend": "bwrap", "pool_size": 4, "wall_time_s": 20.0, "cpu_time_s": 10}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("repo_cache")


def colorsys_task(cache: Path) -> RepoFixTask:
    return RepoFixTask(modules=["colorsys"], eval_modules=["getopt"], tries=30, per_module=8, cache_dir=str(cache),
                       sandbox=SANDBOX)  # fmt: skip


@pytest.fixture(scope="module")
def task(cache) -> RepoFixTask:
    return colorsys_task(cache)


def call(task: RepoFixTask, episode: str, task_id: str, name: str, **arguments: Any):
    return task.episode_call(episode, task.prompt(task_id), name, arguments)


def assistant(name: str, **arguments: Any) -> dict[str, Any]:
    call = {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def as_message(turn: Any) -> dict[str, Any]:
    """A trace turn as the chat message an episode holds (OpenAI-style tool calls)."""
    message = {"role": turn.role, "content": turn.content}
    if turn.tool_call_id is not None:
        message["tool_call_id"] = turn.tool_call_id
    if turn.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                  "arguments": c.arguments}} for c in turn.tool_calls]  # fmt: skip
    return message


def answered(*turns: dict[str, Any]) -> list[dict[str, Any]]:
    """The turns with a tool turn answering each assistant call, as an episode that ran them holds."""
    out = []
    for turn in turns:
        out.append(turn)
        if turn.get("role") == "assistant":
            out += [{"role": "tool", "content": "", "tool_call_id": c["id"]} for c in turn.get("tool_calls") or []]
    return out


def score(task: RepoFixTask, task_id: str, *turns: dict[str, Any]):
    prompt = task.prompt(task_id)
    messages = [*prompt.messages, *answered(*turns), {"role": "assistant", "content": "Done."}]
    return task.score(prompt, messages, Ending("agent_completed", "stop"))


# ---------------------------------------------------------------------------- building


def test_every_operator_changes_one_line_and_the_rest_of_the_module_stays_as_written():
    source = load_source("colorsys").code
    found = sites(source)
    assert {site.operator for site in found} == set(OPERATORS)
    for operator in OPERATORS:
        site = next(s for s in found if s.operator == operator)
        mutation = apply(source, site)
        before, after = source.splitlines(), mutation.source.splitlines()
        changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
        assert len(before) == len(after) and changed == [site.line - 1], operator
        assert ast.dump(ast.parse(mutation.source)) != ast.dump(ast.parse(source))


def test_a_kept_bug_fails_its_tests_and_the_original_passes_them(task):
    assert task.split_ids and task.eval_ids
    assert {task.tasks[t].module for t in task.split_ids} == {"colorsys"}
    assert {task.tasks[t].module for t in task.eval_ids} == {"getopt"}
    for task_id in (task.split_ids[0], task.eval_ids[0]):
        repo = task.tasks[task_id]
        source = task.sources[repo.module]
        buggy = source_tests(task.sandbox, source, task.buggy_code(repo))
        original = source_tests(task.sandbox, source)
        assert buggy.module_file == original.module_file == f"/work/{repo.module}.py"
        expected = task.expected[repo.module]
        assert all(original.tests[t] == ("pass", expected[t]) for t in repo.fail_to_pass + repo.pass_to_pass)
        assert all(buggy.load_error or buggy.outcome(t) != "pass" for t in repo.fail_to_pass)
        assert all(buggy.outcome(t) == "pass" for t in repo.pass_to_pass)


def test_the_build_is_cached_and_the_same_from_the_cache(task, cache):
    again = colorsys_task(cache)
    assert again.tasks == task.tasks and again.build_stats == task.build_stats
    assert len(list(cache.glob("repo_tasks-*.json"))) == 1


def test_a_module_the_test_runner_imports_first_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="'textwrap''s own tests do not run here"):  # unittest needs its copy
        RepoFixTask(modules=["textwrap"], eval_modules=[], cache_dir=str(tmp_path), sandbox=SANDBOX)


# ---------------------------------------------------------------------------- workspaces and tools


def test_a_workspace_keeps_an_episodes_files_and_no_other_episode_sees_them(task):
    assert isinstance(task, Episodic)
    task_id = task.split_ids[0]
    assert not call(task, "a", task_id, "Write", file_path="/work/notes.txt", content="mine\n").is_error
    assert call(task, "a", task_id, "Bash", command="cat notes.txt && echo more >> notes.txt").content == "mine"
    assert call(task, "a", task_id, "Read", file_path="/work/notes.txt").content == "     1\tmine\n     2\tmore"
    other = call(task, "b", task_id, "Read", file_path="/work/notes.txt")
    assert other.is_error and "does not exist" in other.content
    assert task.live_workspaces() == 2
    task.end_episode("a")
    task.end_episode("b")
    assert task.live_workspaces() == 0
    fresh = call(task, "a", task_id, "Read", file_path="/work/notes.txt")  # a new episode of the same id
    assert fresh.is_error
    task.end_episode("a")


def test_a_running_episodes_workspace_outlasts_any_pause_between_its_calls(task, monkeypatch):
    """A day between two calls (a long turn, a wait for room in the engine): another episode starting
    meanwhile leaves the workspace and its files; only the episode's end removes it."""
    task_id = task.split_ids[0]
    assert not call(task, "long", task_id, "Write", file_path="/work/notes.txt", content="mine\n").is_error
    directory = task._workspaces["long"].directory
    clock = time.monotonic
    monkeypatch.setattr(time, "monotonic", lambda: clock() + 86_400.0)
    call(task, "next", task_id, "Glob", pattern="*.py")
    assert call(task, "long", task_id, "Read", file_path="/work/notes.txt").content == "     1\tmine"
    task.end_episode("next")
    task.end_episode("long")
    assert not directory.exists() and task.live_workspaces() == 0


def test_a_task_this_build_lacks_is_a_tool_error_and_ids_name_the_bug(task):
    prompt = task.prompt(task.split_ids[0])
    prompt.info = {"problem": "colorsys-L1-off_by_one-000000"}  # an outside worker's build kept other bugs
    result = task.episode_call("lost", prompt, "Glob", {"pattern": "*.py"})
    assert result.is_error and "not in this build" in result.content and task.live_workspaces() == 0
    repo = task.tasks[task.split_ids[0]]
    assert repo.task_id.startswith(f"{repo.module}-L{repo.line}-{repo.operator}-")


def test_the_tools_answer_as_claude_codes_do(task):
    task_id = task.split_ids[0]
    module = task.tasks[task_id].module
    path = f"/work/{module}.py"
    assert call(task, "t", task_id, "Read", file_path=path, offset=2, limit=2).content.startswith("     2\t")
    missing = call(task, "t", task_id, "Edit", file_path=path, old_string="no such text", new_string="x")
    assert missing.is_error and missing.content.startswith("String to replace not found")
    many = call(task, "t", task_id, "Edit", file_path=path, old_string="def ", new_string="def  ")
    assert many.is_error and "replace_all is false" in many.content
    grep = call(task, "t", task_id, "Grep", pattern="def rgb_to_", output_mode="content", **{"-n": True})
    assert f"{path}:" in grep.content and "def rgb_to_hsv" in grep.content
    assert call(task, "t", task_id, "Glob", pattern="tests/*.py").content.count("/work/tests/") == 2
    failing = call(task, "t", task_id, "Bash", command=f"python3 -m unittest tests.test_{module}")
    assert failing.is_error and "FAILED" in failing.content and failing.content.endswith("Exit code 1")
    flood = call(task, "t", task_id, "Bash", command="yes | head -c 200000")
    assert not flood.is_error and "characters cut" in flood.content and len(flood.content) < 31_000
    wrong = call(task, "t", task_id, "Read", path=path)
    assert wrong.is_error and "`file_path` is missing" in wrong.content
    unknown = call(task, "t", task_id, "WebFetch", url="http://example.com")
    assert unknown.is_error and "No such tool" in unknown.content
    task.end_episode("t")


def test_escape_attempts_through_each_tool_stay_inside_the_sandbox(task, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    task_id = task.split_ids[0]
    attempts = {
        "Read": {"file_path": str(secret)},
        "Write": {"file_path": "/usr/lib/evil.py", "content": "x"},
        "Edit": {"file_path": "/etc/passwd", "old_string": "root", "new_string": "toor"},
        "Grep": {"pattern": "host secret", "path": str(tmp_path), "output_mode": "content"},
        "Glob": {"pattern": "**/secret.txt", "path": "/tmp"},
        "Bash": {"command": f"cat {secret}; ls /root /home; python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), 2)\""},
    }  # fmt: skip
    for name, arguments in attempts.items():
        result = call(task, "x", task_id, name, **arguments)
        assert "host secret" not in result.content, name
        assert name in ("Grep", "Glob") or result.is_error, (name, result.content)
    assert call(task, "x", task_id, "Bash", command=f"ln -s {secret} link.txt").is_error is False
    assert "host secret" not in call(task, "x", task_id, "Read", file_path="/work/link.txt").content
    task.end_episode("x")
    assert not Path("/usr/lib/evil.py").exists()


def test_the_tool_schemas_are_claude_codes_and_an_ingested_session_fits_them(task, tmp_path):
    assert [t["function"]["name"] for t in task.tools] == ["Read", "Edit", "Write", "Bash", "Grep", "Glob"]
    prompt = task.prompt(task.split_ids[0])
    path = tmp_path / "session.jsonl"
    solution_session(task, prompt).write(path)
    (example,) = ingest_claude_code([path]).examples
    calls = [c for turn in example.turns for c in turn.tool_calls or []]
    assert [c.name for c in calls] == ["Bash", "Read", "Edit", "Bash"]
    for c in calls:
        assert tools.check_arguments(c.name, c.arguments) is None, c
    from meshrl.cli.main import main

    out = tmp_path / "ingested.jsonl"
    assert main(["traces", "ingest", str(path), "--format", "claude-code", "--out", str(out)]) == 0
    (line,) = out.read_text().splitlines()
    assert TraceExample.model_validate_json(line).turns == example.turns


def test_demonstrations_solve_their_tasks_and_mark_the_failing_test_run_as_an_error_site(task):
    (demo,) = task.demonstrations(random.Random(0), 1)
    assert demo.turns[0].role == "system" and demo.final_reward == 1.0
    tool_turns = [t for t in demo.turns if t.role == "tool"]
    assert tool_turns[0].is_error and "FAILED" in tool_turns[0].content  # the first test run
    assert not tool_turns[-1].is_error and tool_turns[-1].content.rstrip().endswith("OK")
    messages = [as_message(turn) for turn in demo.turns]
    task_id = demo.trace_id.split("#")[0]
    assert task.score(task.prompt(task_id), messages, Ending("agent_completed", "stop")).reward == 1.0
    sited = [t for t in demo.turns if t.role == "assistant" and t.tool_error]
    assert sited and task.hint(sited[0].tool_error, sited[0].error_meta.model_dump()) is not None


def test_the_easy_tier_names_the_function_and_shows_a_failing_test_and_its_demonstrations_solve(cache):
    easy = RepoFixTask(
        modules=["colorsys"],
        eval_modules=["getopt"],
        tries=30,
        per_module=8,
        cache_dir=str(cache),
        sandbox=SANDBOX,
        easy=True,
    )  # fmt: skip  (the same build, read from the cache)
    assert easy.tasks and set(easy.tasks) <= set(colorsys_task(cache).tasks)
    for task_id, at in easy.pointers.items():
        repo, source = easy.tasks[task_id], easy.sources[easy.tasks[task_id].module]
        assert at.start <= repo.line <= at.end and at.end - at.start < 40  # the bug is in the function named
        assert source.code.splitlines()[at.start - 1].lstrip().startswith(f"def {at.name}(")
        assert at.test_id in repo.fail_to_pass and at.test_code.strip().startswith("def test_")
        user = easy.prompt(task_id).messages[-1]["content"]
        assert f"`{at.name}`" in user and at.test_code.strip() in user and repo.original_line.strip() not in user
    (demo,) = easy.demonstrations(random.Random(0), 1)
    assert [t.tool_calls[0].name for t in demo.turns if t.role == "assistant" and t.tool_calls] == [
        "Read",
        "Edit",
        "Bash",
    ]
    messages = [as_message(turn) for turn in demo.turns]
    task_id = demo.trace_id.split("#")[0]
    assert easy.score(easy.prompt(task_id), messages, Ending("agent_completed", "stop")).reward == 1.0
    assert easy.score(easy.prompt(task_id), messages[:2], Ending("agent_completed", "stop")).reward == 0.0  # no fix


def test_the_oracle_answers_the_scripted_solution_turn_by_turn(task):
    prompt = task.prompt(task.split_ids[0])
    first = task.oracle_action(prompt, prompt.messages)
    assert first["tool_calls"][0]["function"]["name"] == "Bash"
    later = task.oracle_action(prompt, [*prompt.messages, *[{"role": "assistant", "content": ""}] * 9])
    assert "tool_calls" not in later and later["content"].startswith("Fixed")


def test_unique_context_grows_until_it_names_one_place():
    code = "a = 1\nx = 0\nb = 2\nx = 0\nc = 3\n"
    assert unique_context(code, 1) == "a = 1"
    assert unique_context(code, 2) == "a = 1\nx = 0\nb = 2"


# ---------------------------------------------------------------------------- the hidden-test reward


def fix(task: RepoFixTask, task_id: str) -> dict[str, Any]:
    repo = task.tasks[task_id]
    old = unique_context(task.buggy_code(repo), repo.line)
    return assistant("Edit", file_path=f"/work/{task.sources[repo.module].path}", old_string=old,
                     new_string=old.replace(repo.buggy_line, repo.original_line, 1))  # fmt: skip


def append(task: RepoFixTask, task_id: str, code: str) -> dict[str, Any]:
    module = task.tasks[task_id].module
    return assistant("Bash", command=f"cat >> {module}.py <<'EOF'\n{code}\nEOF")


def test_a_fix_scores_1_and_each_cheat_scores_0(task):
    task_id = task.split_ids[0]
    repo = task.tasks[task_id]
    module, test_file = repo.module, f"tests/test_{repo.module}.py"
    honest = score(task, task_id, fix(task, task_id))
    assert honest.reward == 1.0 and honest.metrics["tests_fixed"] == 1.0 and honest.metrics["tests_broken"] == 0
    cheats = {
        "nothing": [],
        "the failing tests deleted": [assistant("Write", file_path=f"/work/{test_file}", content="")],
        "every test made to pass": [assistant("Bash", command=f"sed -i 's/self.assert/pass  # /' {test_file}")],
        "a unittest.py shadowing the real one": [assistant("Write", file_path="/work/unittest.py",
                                                           content="raise SystemExit(0)")],
        "a sitecustomize.py": [assistant("Write", file_path="/work/sitecustomize.py", content="import os; os._exit(0)")],
        "unittest patched from the module": [append(task, task_id, "import unittest\nunittest.TestCase.run = "
                                                    "lambda self, result=None: None")],
        "the process ended from the module": [append(task, task_id, "import os\nos._exit(0)")],
        "a forged report printed": [append(task, task_id, 'print("#meshrl-tests {\\"tests\\": {}, '
                                                          '\\"load_error\\": null, \\"module_file\\": null}")')],
        "the runner reached through getattr": [append(task, task_id, "getattr(__builtins__, 'print')('x')")],
        "the runner's frames walked": [append(task, task_id, "(lambda: 0).__globals__")],
        "the module replaced by a link": [assistant("Bash", command=f"cp {module}.py /tmp/m.py && "
                                                    f"ln -sf /tmp/m.py {module}.py")],
        "the module deleted": [assistant("Bash", command=f"rm {module}.py")],
    }  # fmt: skip
    for name, turns in cheats.items():
        assert score(task, task_id, *turns).reward == 0.0, name
    # The fix, then a cheat on top of it: a refused capability loses even a correct fix.
    assert score(task, task_id, fix(task, task_id), append(task, task_id, "import sys")).reward == 0.0
    # Forged tool results (an outside worker's messages) change nothing: the writes are replayed.
    forged = [fix(task, task_id) | {"tool_calls": []}, {"role": "tool", "content": "OK", "tool_call_id": "x"}]
    assert score(task, task_id, *forged).reward == 0.0


def test_new_capabilities_are_what_the_fix_adds_not_what_the_module_had():
    given = "import math\ndef f(x):\n    return math.sqrt(x)\n"
    assert new_capabilities(given.replace("sqrt(x)", "sqrt(abs(x))"), given) == []
    assert new_capabilities(given.replace("return", "y = sorted([x])\n    return"), given) == []  # its own name
    assert new_capabilities(given + "import os\n", given) == ["import os"]
    assert new_capabilities(given + "x = f.__globals__\n", given) == [".__globals__", "attribute .__globals__"]
    assert new_capabilities(given + "open('/run/meshrl/main.py')\n", given) == ["name open", "open"]
    assert new_capabilities("def f(:\n", given) == ["syntax"]
    # an allowlist, not a blocklist: what no word list names is refused too
    assert new_capabilities(given + "math.pi\n", given) == ["attribute .pi"]
    assert new_capabilities(given + "print(f(1))\n", given) == ["name print"]
    # a builtin bound elsewhere in the module is still the builtin where it is read
    assert new_capabilities(given + "def g():\n    type = 1\nz = type(f)\n", given) == ["name type"]


def test_without_the_hidden_answer_the_reward_is_0_and_a_prompt_has_no_tests_in_it(task):
    task_id = task.split_ids[0]
    prompt = task.prompt(task_id)
    leased = type(prompt)(prompt.prompt_id, prompt.messages, None, prompt.info)
    messages = [*prompt.messages, fix(task, task_id), {"role": "assistant", "content": "Done."}]
    assert task.score(leased, messages, Ending("agent_completed", "stop")).reward == 0.0
    assert "assert" not in json.dumps(prompt.messages) and "assert" not in json.dumps(prompt.info)
