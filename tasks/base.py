"""The task protocol: what a training run needs from an environment.

A task hands out prompts (the opening messages of an episode), answers the assistant's
tool calls turn by turn, and scores a finished episode with a reward in [0, 1]. Tasks are
plugged in by import path (`--task.import_path pkg.mod:Factory`, kwargs from
`task.kwargs`); the factory is called as `Factory(**kwargs)` in every process that needs it.

Messages are OpenAI-style chat dicts (`role`, `content`, `tool_calls` with
`{"id", "type": "function", "function": {"name", "arguments": dict}}`, tool turns with
`tool_call_id`), the form chat templates render.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from meshrl.configs.imports import checked_kwargs, import_object
from meshrl.configs.schema import TaskConfig
from meshrl.traces.schema import TraceExample


@dataclass
class Prompt:
    """One episode's opening: its messages and whatever the verifier needs to score it. A draw is a
    group (its samples' advantages are against each other): `prompt_id` is unique per draw, the
    underlying problem's id goes in `info` (the controller refuses a step whose draws share one)."""

    prompt_id: str
    messages: list[dict[str, Any]]
    answer: Any = None
    info: dict[str, Any] = field(default_factory=dict)


def prompt_id_of(problem: str, draw: int | None) -> str:
    """A prompt's id: the problem's own for an evaluation prompt; for a training draw, then `#` and
    the draw's 32 bits, so two draws of one problem are two groups."""
    return problem if draw is None else f"{problem}#{draw:08x}"


def problem_of(prompt_id: str) -> str:
    """The problem a `prompt_id_of` id names."""
    return prompt_id.split("#", 1)[0]


@dataclass
class ToolResult:
    """A tool turn's text, and whether the tool failed (an SDPO error site follows a failure)."""

    content: str
    is_error: bool = False


@dataclass
class Score:
    """A rubric's verdict: the reward, and the named parts it was made of (logged, not trained on)."""

    reward: float
    components: dict[str, float] = field(default_factory=dict)  # reward terms, unweighted
    metrics: dict[str, float] = field(default_factory=dict)  # observations that do not enter the reward


@runtime_checkable
class Task(Protocol):
    max_turns: int

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """n prompts drawn with `rng` (the run's data order is the rng's state)."""

    def call_tool(self, prompt: Prompt, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Run one tool call of the assistant; unknown tools and bad arguments are errors, not exceptions."""

    def reward(self, prompt: Prompt, messages: list[dict[str, Any]]) -> float:
        """Score a finished episode (the full conversation) in [0, 1]."""


@dataclass
class Ending:
    """How an episode ended: `agent_completed` (a turn without tool calls), `max_turns`, or the
    name of the task's stop that fired; and the last turn's finish reason (`length`: cut off)."""

    stop_condition: str
    finish_reason: str


@runtime_checkable
class Scoring(Protocol):
    """Tasks whose reward is a rubric of named parts: `score` is used instead of `reward`."""

    def score(self, prompt: Prompt, messages: list[dict[str, Any]], ending: Ending) -> Score: ...


@runtime_checkable
class Stopping(Protocol):
    """Tasks that can end an episode before the assistant stops calling tools or `max_turns`."""

    def stops(self, prompt: Prompt, messages: list[dict[str, Any]]) -> str | None:
        """The name of the stop that ends the episode after these messages, or None."""


@runtime_checkable
class Episodic(Protocol):
    """Tasks whose tool calls share state within one episode (a repository's working copy): each
    call names the episode (`Rollout.episode_id`), and `end_episode` frees what the episode holds,
    however it ended. Their reward must not depend on that state: it is gone when they score."""

    def episode_call(self, episode: str, prompt: Prompt, name: str, arguments: dict[str, Any]) -> ToolResult: ...

    def end_episode(self, episode: str) -> None: ...


# A task may declare its tools as `tools`: OpenAI function schemas
# ({"type": "function", "function": {"name", "description", "parameters"}}). They reach the chat
# template (`apply_chat_template(tools=...)`: Hermes/Qwen put them in the system turn) wherever an
# episode is rendered, and OpenAI-compatible teachers, which then answer with native tool calls.


def task_tools(task: Any) -> list[dict[str, Any]] | None:
    """The task's tool schemas, checked (None when it declares none)."""
    tools = getattr(task, "tools", None)
    if not tools:
        return None
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(function, dict)
            or tool.get("type") != "function"
            or not isinstance(function.get("name"), str)
        ):
            raise ValueError(
                f"{type(task).__name__}.tools[{i}] is not an OpenAI function schema "
                '{"type": "function", "function": {"name": ..., "parameters": {...}}}'
            )
    return list(tools)


# A task may set `replayable_tools = False` when its tools cannot be run twice with the same
# result (a sandbox with side effects): the ingress then takes tool turns of outside workers
# from their messages instead of replaying them (docs/guides/decentralized-rollouts.md).


@runtime_checkable
class Demonstrating(Protocol):
    """Tasks that can show a correct episode (for warm start) and answer as an oracle teacher."""

    def demonstrations(self, rng: random.Random, n: int) -> list[TraceExample]: ...

    def oracle_action(self, prompt: Prompt, messages: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The right next assistant message; None where the oracle abstains (no replay pair there)."""


@runtime_checkable
class Grading(Protocol):
    """Tasks that can say what an action does at a state (`teachers.agree_by = "outcome"`): replay's
    teachers then agree, and the student's action matches theirs, when their actions do the same,
    however they are written (two different functions that both pass the tests)."""

    def action_outcome(self, prompt: Prompt, messages: list[dict[str, Any]], action: dict[str, Any]) -> str | None:
        """A label equal for actions that do the same after `messages`; None where the task cannot
        tell (the action's text then stands for it)."""


@runtime_checkable
class Hinting(Protocol):
    """Tasks that can hint at a tool error's fix (the SDPO teacher's privileged context)."""

    def hint(self, error_kind: str, error_meta: dict[str, Any]) -> str | None:
        """The hint at an error site: `error_meta` holds the error's `tool_name` and `excerpt`, and the
        episode's `trace_id` (a run's rollout: its prompt id). None: no hint, no SDPO row there."""


@runtime_checkable
class Curriculum(Protocol):
    """Tasks whose prompts follow the run's results (a horizon that grows, say). The run keeps each
    step's `summarize` (JSON, checkpointed) and, before it draws a step's prompts, hands `stage` the
    summaries of the steps it may see: those `generator.max_async_level + 2` or more steps back, all of
    which are in by the time any later step is drawn, so a resumed run draws what the uninterrupted
    one did. `stage` sets what `sample_prompts` draws and returns the curriculum's metrics."""

    def summarize(self, prompts: list[Prompt], rewards: list[float]) -> dict[str, Any]: ...

    def stage(self, summaries: list[dict[str, Any]]) -> dict[str, float]: ...


def make_task(config: TaskConfig) -> Task:
    """The task factory named by `task.import_path`, called with `task.kwargs` as its signature takes
    them (`task_kwargs`)."""
    return task_factory(config)(**task_kwargs(config))


def task_factory(config: TaskConfig) -> Any:
    try:
        return import_object(config.import_path)
    except ValueError as exc:
        raise ValueError(f"task.import_path: {exc}") from None


def task_kwargs(config: TaskConfig) -> dict[str, Any]:
    """`task.kwargs` checked against the factory's signature and coerced to its annotations: a name
    it does not take, or a value of the wrong type, is a ValueError of one line naming the key."""
    return checked_kwargs(config.import_path, task_factory(config), config.kwargs, "task.kwargs")
