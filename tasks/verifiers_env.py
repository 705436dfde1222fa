"""A `verifiers` (0.4, `verifiers.v1`) taskset as a meshrl task: its data, tools, stops and rubric.

meshrl's generators run the episodes, so the sampled token ids and logprobs are the policy's own,
exactly as for any task; the environment supplies what v1 puts in a `Taskset`:

- prompts: each `Task`'s `system_prompt` and `prompt` (the taskset loaded once, bounded by
  `max_tasks` when it is infinite; the last `eval_tasks` of them held out for `meshrl eval`);
- tools: the task's and the taskset's `Toolset`s, registered on in-process MCP servers (the
  `mcp` package verifiers serves them with), so schemas and argument checks are MCP's; a tool is
  named `<server>_<tool>` as verifiers' harnesses name it, and a failed call is a tool error;
- stops: the task's `@vf.stop` hooks that read the trace end an episode before `max_turns`;
- rewards: `Task.score` on a `vf.Trace` of the episode's messages: the weighted sum is the
  reward, each `@vf.reward` component and `@vf.metric` is kept (logged as `rubric/*`, `task_metric/*`).

v1's own rollout path (`Env.run_episode`: a harness program and MCP servers as subprocesses per
episode, provisioned with `uv`, a remote sandbox by default) is not used; tasks that need it
(`NEEDS_CONTAINER`, a runtime in setup/finalize or scoring, tool state kept between calls) are
refused at load with the reason, or score without their runtime-only signals (verifiers skips those).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import random
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from pydantic import ValidationError

from meshrl.tasks.base import Prompt, Score, ToolResult

try:
    import verifiers.v1 as vf
    from mcp.server.mcpserver import MCPServer
    from verifiers.v1.mcp.server import ServerBase
    from verifiers.v1.session import call_hook, hook_boundary
    from verifiers.v1.state import State, state_cls
    from verifiers.v1.utils.generic import concrete_type
    from verifiers.v1.utils.loaders import _plugin_class, taskset_class
except ImportError as exc:  # the optional extra
    raise ImportError(
        f"task 'meshrl.tasks.verifiers_env' needs the verifiers extra: pip install 'meshrl[verifiers]' ({exc})"
    ) from None

T = TypeVar("T")


class _Loop:
    """One event loop on a daemon thread: verifiers' scoring and MCP tools are async, while the
    scheduler calls a task from worker threads (some already inside a running loop)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="verifiers-task", daemon=True).start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


def _vf_message(message: dict[str, Any]) -> Any:
    """A meshrl chat dict as the verifiers message model it stands for."""
    role, content = message["role"], message.get("content")
    if role == "assistant":
        calls = [
            vf.ToolCall(id=c["id"], name=c["function"]["name"], arguments=json.dumps(c["function"]["arguments"]))
            for c in message.get("tool_calls") or []
        ]
        return vf.AssistantMessage(content=content, tool_calls=calls or None)
    if role == "tool":
        return vf.ToolMessage(tool_call_id=message["tool_call_id"], content=content or "")
    return (vf.SystemMessage if role == "system" else vf.UserMessage)(content=content or "")


def _taskset_class(env: str) -> type:
    """verifiers' resolution for a taskset id (an installed package, or one built into verifiers);
    a dotted module path (which verifiers' loader cannot take) is imported as it is."""
    if "." not in env:
        return taskset_class(env)
    return _plugin_class(importlib.import_module(env), vf.Taskset, "taskset")


def _opening(data: Any) -> list[dict[str, Any]]:
    """A task's opening messages as chat dicts: its system prompt, then its prompt."""
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return [*messages, {"role": "user", "content": data.prompt}]
    return [*messages, *(m.model_dump(mode="json", exclude_none=True) for m in data.prompt or [])]


def _result_text(result: Any) -> str:
    return "\n".join(block.text if block.type == "text" else str(block) for block in result.content)


class VerifiersTask:
    """`task.import_path = "meshrl.tasks.verifiers_env:VerifiersTask"`, `task.kwargs = {env = ..., args = {...}}`.

    `env` is an installed taskset package or module (a verifiers taskset id: nothing is fetched);
    `args` are its taskset config's fields."""

    def __init__(
        self, env: str, args: dict[str, Any] | None = None, max_turns: int = 4, max_tasks: int = 10_000,
        eval_tasks: int = 0,
    ) -> None:  # fmt: skip
        self.env, self.max_turns = env, max_turns
        cls = _taskset_class(env)
        config_type = concrete_type(cls, vf.TasksetConfig) or vf.TasksetConfig
        try:
            taskset = cls(config_type(id=env, **(args or {})))
        except ValidationError as exc:
            raise ValueError(f"task.kwargs.args for {env!r} ({config_type.__name__}): {exc}") from None
        tasks = list(taskset if taskset.bounded else taskset.take(max_tasks))
        if not tasks:
            raise ValueError(f"task.kwargs.env {env!r}: the taskset yields no tasks")
        if not 0 <= eval_tasks < len(tasks):
            raise ValueError(f"task.kwargs.eval_tasks {eval_tasks}: the taskset {env!r} has {len(tasks)} tasks")
        if type(tasks[0]).NEEDS_CONTAINER:
            raise ValueError(f"task.kwargs.env {env!r}: {type(tasks[0]).__name__} needs a container runtime")
        self.train_tasks, self.eval_tasks = tasks[: len(tasks) - eval_tasks], tasks[len(tasks) - eval_tasks :]
        self.by_key = {task.key: task for task in tasks}
        self._loop = _Loop()
        self._servers: dict[str, MCPServer] = {}
        self._dispatch: dict[str, tuple[str, str]] = {}
        self.tools: list[dict[str, Any]] = []
        toolsets = [*type(tasks[0]).toolsets(tasks[0].config), *cls.toolsets(taskset.config)]
        self._loop.run(self._serve(toolsets))

    async def _serve(self, toolsets: list[ServerBase]) -> None:
        for toolset in toolsets:
            name = toolset.server_name
            if type(toolset).setup_task is not ServerBase.setup_task or state_cls(type(toolset)) is not State:
                raise ValueError(
                    f"task.kwargs.env {self.env!r}: toolset {type(toolset).__name__} keeps per-task state "
                    "(setup_task or a State), which needs verifiers' per-episode tool servers"
                )
            await toolset.setup()
            server = MCPServer(name or type(toolset).__name__)
            toolset.register(server)
            self._servers[name] = server
            for tool in await server.list_tools():
                full = f"{name}_{tool.name}" if name else tool.name
                if full in self._dispatch:
                    raise ValueError(f"task.kwargs.env {self.env!r}: two tools are named {full!r}")
                self._dispatch[full] = (name, tool.name)
                function = {"name": full, "description": tool.description or "", "parameters": tool.input_schema}
                self.tools.append({"type": "function", "function": function})

    # -- the task protocol

    def _prompt(self, rng: random.Random, pool: list[Any]) -> Prompt:
        """A draw of a task: its own prompt id (a group is one draw), the task found again by its key."""
        task = rng.choice(pool)
        info = {"taskset": self.env, "task_key": task.key, "idx": task.data.idx}
        return Prompt(f"{self.env}/{task.data.idx}-{rng.getrandbits(32):08x}", _opening(task.data), info=info)

    def _task(self, prompt: Prompt) -> Any:
        return self.by_key[prompt.info["task_key"]]

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        return [self._prompt(rng, self.train_tasks) for _ in range(n)]

    def eval_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """The held-out tasks (`eval_tasks`), else a draw from the training ones."""
        return [self._prompt(rng, self.eval_tasks or self.train_tasks) for _ in range(n)]

    def call_tool(self, prompt: Prompt, name: str, arguments: dict[str, Any]) -> ToolResult:
        if name not in self._dispatch:
            return ToolResult(f"unknown tool {name!r}; tools: {', '.join(self._dispatch)}", is_error=True)
        server, tool = self._dispatch[name]
        try:
            result = self._loop.run(self._servers[server].call_tool(tool, arguments))
        except Exception as exc:  # noqa: BLE001 - bad arguments or a failing tool are the model's error to see
            return ToolResult(f"{type(exc).__name__}: {exc}", is_error=True)
        return ToolResult(_result_text(result), is_error=bool(result.is_error))

    def _trace(self, prompt: Prompt, messages: list[dict[str, Any]]) -> Any:
        task = self._task(prompt)
        opening = len(prompt.messages)
        nodes = [
            vf.MessageNode(
                parent=i - 1 if i else None, message=_vf_message(m), sampled=i >= opening and m["role"] == "assistant"
            )
            for i, m in enumerate(messages)
        ]
        tools = [vf.Tool(**t["function"]) for t in self.tools]
        trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=vf.AgentInfo(config=vf.AgentConfig()), tools=tools, nodes=nodes,
        )  # fmt: skip
        trace.state = state_cls(type(task))()
        return trace

    def stops(self, prompt: Prompt, messages: list[dict[str, Any]]) -> bool:
        """Whether one of the task's trace `@vf.stop` hooks ends the episode here."""
        task, trace = self._task(prompt), self._trace(prompt, messages)
        hooks = [fn for fn in task.hooks("stop") if hook_boundary(fn, allow_trace=True) is vf.Trace]

        async def fired() -> bool:
            for fn in hooks:
                result = await call_hook(fn, {vf.Trace: trace})
                if not isinstance(result, bool):
                    raise TypeError(f"{self.env}: @stop {fn.__name__} returned {type(result).__name__}, not bool")
                if result:
                    return True
            return False

        return self._loop.run(fired())

    def score(self, prompt: Prompt, messages: list[dict[str, Any]]) -> Score:
        task, trace = self._task(prompt), self._trace(prompt, messages)
        self._loop.run(task.score(trace))  # a failing reward raises (vf.TaskError): the generator fails loudly
        components = {name: r.score for name, r in trace.rewards.items() if r is not None}
        metrics = {name: v for name, v in trace.metrics.items() if v is not None}
        return Score(trace.reward, components, metrics)

    def reward(self, prompt: Prompt, messages: list[dict[str, Any]]) -> float:
        return self.score(prompt, messages).reward
