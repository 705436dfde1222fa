"""A `verifiers` (0.4, `verifiers.v1`) taskset as a meshrl task: its data, tools, stops and rubric.

meshrl's generators run the episodes, so the sampled token ids and logprobs are the policy's own,
exactly as for any task; the environment supplies what v1 puts in a `Taskset`:

- prompts: each `Task`'s `system_prompt` and `prompt` (the taskset loaded once, bounded by
  `max_tasks` when it is infinite; the last `eval_tasks` of them held out for `meshrl eval`);
- tools: the task's and the taskset's `Toolset`s, registered on in-process MCP servers (the
  `mcp` package verifiers serves them with), so schemas and argument checks are MCP's; a tool is
  named `<server>_<tool>` as verifiers' harnesses name it, and a failed call is a tool error;
- stops: the task's `@vf.stop` hooks on the trace end an episode before `max_turns`;
- rewards: `Task.score` on a `vf.Trace` of the episode as verifiers would have recorded it (tool
  results the episode's last turn asked for are not in it, its stop condition and each turn's
  finish reason are): the weighted sum is the reward, each `@vf.reward` component and `@vf.metric`
  is kept (logged as `rubric/*`, `task_metric/*`).

v1's own rollout path (`Env.run_episode`: a harness program and MCP servers as subprocesses per
episode, provisioned with `uv`, a remote sandbox by default) is not used. What needs it is refused
at load, naming the reason: a custom `Env`, container tasks, lifecycle hooks (setup, finalize,
intercepts, request/response stops), signals that need the runtime unless `sandbox` is set (then
they get a runtime over meshrl's sandbox, `tasks/verifiers_runtime.py`), toolsets with per-task
state, another runtime, colocation with the agent's runtime, or a remote URL.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import random
import threading
from collections.abc import Coroutine
from types import ModuleType
from typing import Any, TypeVar

from pydantic import ValidationError

from meshrl.configs.schema import SandboxConfig
from meshrl.sandbox import make_sandbox
from meshrl.tasks.base import Ending, Prompt, Score, ToolResult
from meshrl.tasks.verifiers_runtime import SandboxRuntime

try:
    import verifiers.v1 as vf
    from mcp.server.mcpserver import MCPServer
    from verifiers.v1.mcp.server import ServerBase
    from verifiers.v1.session import call_hook, hook_boundary
    from verifiers.v1.state import State, state_cls
    from verifiers.v1.types import content_text
    from verifiers.v1.utils.decorators import discover_decorated
    from verifiers.v1.utils.generic import concrete_type
    from verifiers.v1.utils.loaders import import_taskset
except ImportError as exc:  # the optional extra
    raise ImportError(
        f"task 'meshrl.tasks.verifiers_env' needs the verifiers extra: pip install 'meshrl[verifiers]' ({exc})"
    ) from None

T = TypeVar("T")


class _Loop:
    """One event loop on a daemon thread: verifiers' scoring and MCP tools are async, while the
    scheduler calls a task from worker threads. Synchronous tools run on it one at a time."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="verifiers-task", daemon=True).start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


def _vf_message(message: dict[str, Any]) -> vf.Message:
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


def _chat(message: vf.Message) -> dict[str, Any]:
    """A verifiers message (of a task's prompt) as the chat dict meshrl renders."""
    text = content_text(message.content)
    if isinstance(message, vf.AssistantMessage):
        out: dict[str, Any] = {"role": "assistant", "content": text}
        if message.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                for c in message.tool_calls
            ]
        return out
    if isinstance(message, vf.ToolMessage):
        return {"role": "tool", "content": text, "tool_call_id": message.tool_call_id}
    return {"role": message.role, "content": text}


def _opening(data: vf.TaskData) -> list[dict[str, Any]]:
    """A task's opening messages as chat dicts: its system prompt, then its prompt."""
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return [*messages, {"role": "user", "content": data.prompt}]
    return [*messages, *(_chat(m) for m in data.prompt or [])]


def _module(env: str) -> ModuleType:
    """The taskset's module: verifiers' resolution for a taskset id (an installed package, one
    built into verifiers, `owner/name@version`), else a dotted module path imported as it is."""
    if "." in env and "/" not in env and "@" not in env:
        return importlib.import_module(env)
    return import_taskset(env)


def _exported(module: ModuleType, base: type) -> list[type]:
    return [o for n in getattr(module, "__all__", []) if isinstance(o := getattr(module, n, None), type) and issubclass(o, base) and o is not base]  # fmt: skip


def _needs_runtime(fn: Any) -> bool:
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def _refusals(task: vf.Task, sandboxed: bool) -> list[str]:
    """What of a v1 task's class and config needs verifiers' own rollout path (empty: it runs here).
    Signals that take a runtime run in meshrl's sandbox when the task has one (`sandboxed`)."""
    kind = type(task)
    reasons = [f"{kind.__name__}.{hook} is overridden" for hook in ("setup", "finalize", "stage_verifier")
               if getattr(kind, hook) is not getattr(vf.Task, hook)]  # fmt: skip
    if kind.NEEDS_CONTAINER:
        reasons.append(f"{kind.__name__} needs a container")
    if discover_decorated(task, "intercept"):
        reasons.append("it has @vf.intercept hooks")
    reasons += [f"@vf.stop {fn.__name__} reads a request or response" for fn in task.hooks("stop")
                if hook_boundary(fn, allow_trace=True) is not vf.Trace]  # fmt: skip
    signals = [*task.hooks("metric"), *task.hooks("reward"), *(j.score for j in task.plugged_judges())]
    reasons += [f"{getattr(fn, '__name__', fn)} needs the task's runtime (set task.kwargs.sandbox)"
                for fn in signals if _needs_runtime(fn) and not sandboxed]  # fmt: skip
    return reasons


class VerifiersTask:
    """`task.import_path = "meshrl.tasks.verifiers_env:VerifiersTask"`, `task.kwargs = {env = ..., args = {...}}`.

    `env` is a verifiers taskset id or a dotted module path (nothing is fetched); `args` are the
    fields of its taskset config."""

    def __init__(
        self, env: str, args: dict[str, Any] | None = None, max_turns: int = 4, max_tasks: int = 10_000,
        eval_tasks: int = 0, sandbox: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        self.env, self.max_turns = env, max_turns
        # Signals that take a runtime get a SandboxRuntime over this (each of its runs a sandbox call).
        self.sandbox = make_sandbox(SandboxConfig(**sandbox)) if sandbox is not None else None
        module = _module(env)
        (envs, tasksets) = (_exported(module, vf.Env), _exported(module, vf.Taskset))
        if envs:
            raise ValueError(
                f"task.kwargs.env {env!r} exports its own verifiers Env ({envs[0].__name__}): not run here"
            )
        if len(tasksets) != 1:
            raise ValueError(f"task.kwargs.env {env!r} must export one verifiers Taskset in __all__ (found {tasksets})")
        cls = tasksets[0]
        config_type = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        if "id" in (args or {}):
            raise ValueError("task.kwargs.args.id: the taskset id is task.kwargs.env")
        try:
            taskset = cls(config_type.model_validate({**(args or {}), "id": env}))
        except ValidationError as exc:
            raise ValueError(f"task.kwargs.args for {env!r} ({config_type.__name__}): {exc}") from None
        tasks = list(taskset if taskset.bounded else taskset.take(max_tasks))
        if not tasks:
            raise ValueError(f"task.kwargs.env {env!r}: the taskset yields no tasks")
        if not 0 <= eval_tasks < len(tasks):
            raise ValueError(f"task.kwargs.eval_tasks {eval_tasks}: the taskset {env!r} has {len(tasks)} tasks")
        checked: set[tuple[type, int]] = set()  # hooks belong to a task's class and config: check each pair once
        for task in tasks:
            kind = (type(task), id(task.config))
            reasons = [] if kind in checked else _refusals(task, self.sandbox is not None)
            checked.add(kind)
            if task.data.prompt is None:
                reasons.append("its prompt is unset (a user simulator opens the conversation)")
            if reasons:
                raise ValueError(f"task.kwargs.env {env!r} needs verifiers' own rollouts: {'; '.join(reasons)}")
        self.train_tasks, self.eval_tasks = tasks[: len(tasks) - eval_tasks], tasks[len(tasks) - eval_tasks :]
        self.by_key = {task.key: task for task in tasks}
        self._loop = _Loop()
        self._servers: dict[str, MCPServer] = {}
        self._dispatch: dict[str, tuple[str, str]] = {}
        self.tools: list[dict[str, Any]] = []
        # One instance of each toolset serves every episode (verifiers starts task toolsets per rollout).
        toolsets = [*type(tasks[0]).toolsets(tasks[0].config), *cls.toolsets(taskset.config)]
        self._loop.run(self._serve(toolsets))

    async def _serve(self, toolsets: list[ServerBase]) -> None:
        for toolset in toolsets:
            name, kind = toolset.server_name, type(toolset).__name__
            if type(toolset).setup_task is not ServerBase.setup_task or state_cls(type(toolset)) is not State:
                raise ValueError(
                    f"task.kwargs.env {self.env!r}: toolset {kind} keeps per-task state "
                    "(setup_task or a State), which needs verifiers' per-episode tool servers"
                )
            if getattr(toolset.config, "url", None) or not isinstance(toolset.config.runtime, vf.SubprocessConfig):
                raise ValueError(f"task.kwargs.env {self.env!r}: toolset {kind} runs remotely or in a sandbox")
            if getattr(toolset.config, "colocated", False):  # it expects the agent's box, which meshrl has not
                raise ValueError(f"task.kwargs.env {self.env!r}: toolset {kind} is colocated with the agent's runtime")
            if name in self._servers:
                raise ValueError(f"task.kwargs.env {self.env!r}: two toolsets are named {name!r} (TOOL_PREFIX)")
            await toolset.setup()
            server = MCPServer(name or kind)
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

    def _prompt(self, rng: random.Random, pool: list[vf.Task]) -> Prompt:
        """A draw of a task: its own prompt id (a group is one draw); the task is found again by
        its key, or rebuilt from its data where this process's taskset lacks it."""
        task = rng.choice(pool)
        info = {"taskset": self.env, "task_key": task.key, "task": task.data.model_dump(mode="json")}
        return Prompt(f"{self.env}/{task.data.idx}-{rng.getrandbits(32):08x}", _opening(task.data), info=info)

    def _task(self, prompt: Prompt) -> vf.Task:
        task = self.by_key.get(prompt.info["task_key"])
        if task is not None:
            return task
        kind = type(self.train_tasks[0])
        return kind(kind.data_type().model_validate(prompt.info["task"]), self.train_tasks[0].config)

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
            text = "\n".join(block.text if block.type == "text" else str(block) for block in result.content)
        except Exception as exc:  # noqa: BLE001 - bad arguments or a failing tool are the model's error to see
            return ToolResult(f"{type(exc).__name__}: {exc}", is_error=True)
        return ToolResult(text, is_error=bool(result.is_error))

    def _trace(self, prompt: Prompt, messages: list[dict[str, Any]], ending: Ending | None = None) -> vf.Trace:
        """The episode as verifiers records one: results of tools the last turn called are not in it
        (its stops and scoring run before they would be committed)."""
        task, opening = self._task(prompt), len(prompt.messages)
        last = max(
            (i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= opening), default=opening - 1
        )
        kept = messages[: last + 1]
        nodes = [
            vf.MessageNode(parent=i - 1 if i else None, message=_vf_message(m),
                           sampled=i >= opening and m["role"] == "assistant")
            for i, m in enumerate(kept)
        ]  # fmt: skip
        calls = [
            vf.ModelCall(node=i, finish_reason="tool_calls" if kept[i].get("tool_calls") else "stop")
            for i, node in enumerate(nodes)
            if node.sampled
        ]
        if calls and ending is not None and ending.finish_reason == "length":
            calls[-1].finish_reason = "length"
        trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=vf.AgentInfo(config=vf.AgentConfig()), tools=[vf.Tool(**t["function"]) for t in self.tools],
            nodes=nodes, calls=calls,
        )  # fmt: skip
        trace.state = state_cls(type(task))()
        if ending is not None:
            trace.stop(ending.stop_condition)
            trace.ok = True
        return trace

    def stops(self, prompt: Prompt, messages: list[dict[str, Any]]) -> str | None:
        """The name of the task's `@vf.stop` hook that ends the episode here, if one does."""
        task, trace = self._task(prompt), self._trace(prompt, messages)

        async def fired() -> str | None:
            for fn in task.hooks("stop"):
                result = await call_hook(fn, {vf.Trace: trace})
                if not isinstance(result, bool):
                    raise TypeError(f"{self.env}: @stop {fn.__name__} returned {type(result).__name__}, not bool")
                if result:
                    return fn.__name__
            return None

        return self._loop.run(fired())

    def score(self, prompt: Prompt, messages: list[dict[str, Any]], ending: Ending) -> Score:
        task, trace = self._task(prompt), self._trace(prompt, messages, ending)
        # A failing or timed-out signal raises (vf.TaskError, TimeoutError): the generator fails loudly.
        runtime = SandboxRuntime(self.sandbox) if self.sandbox is not None else None
        self._loop.run(asyncio.wait_for(task.score(trace, runtime), task.data.timeout.scoring))
        components = {name: r.score for name, r in trace.rewards.items() if r is not None}
        metrics = {name: v for name, v in trace.metrics.items() if v is not None}
        return Score(trace.reward, components, metrics)

    def reward(self, prompt: Prompt, messages: list[dict[str, Any]]) -> float:
        return self.score(prompt, messages, Ending("agent_completed", "stop")).reward
