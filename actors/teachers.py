"""Teacher backends for trace replay: each answers one state (the chat messages before an
assistant turn) with one action, or None when it could not.

An action is an assistant message in the task protocol's form:

    {"role": "assistant", "content": str,
     "tool_calls"?: [{"id", "type": "function", "function": {"name", "arguments": dict}}]}

Backends: an OpenAI-compatible endpoint (retries, a shared USD ceiling), a local HF model
(through a generate function the teacher actor plugs in) and the task's own oracle.
`replay_state` asks every teacher through an on-disk cache, so a resumed run never pays
twice for a state, and one failing teacher never blocks the others.

The API key of an endpoint is read from its env var at each request: it is never stored
on an object, logged, cached or counted.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
from monarch.actor import Actor, current_rank, endpoint

from meshrl.configs.schema import HfTeacher as HfTeacherConfig
from meshrl.configs.schema import OpenAITeacher as OpenAITeacherConfig
from meshrl.tasks.base import Demonstrating, Prompt

log = logging.getLogger(__name__)

Message = dict[str, Any]


@dataclass
class TeacherStats:
    """One teacher's counters. `calls` are answers asked of the backend (cache misses within
    budget); `failures` are calls that gave no action, exceptions included."""

    calls: int = 0
    cache_hits: int = 0
    failures: int = 0
    skipped_budget: int = 0
    usd_spent: float = 0.0


class Teacher(Protocol):
    name: str
    identity: str | None  # what answers depend on besides the state (cache key); None: never cached
    stats: TeacherStats

    def act(self, state_messages: list[Message], context: dict[str, Any] | None) -> Message | None: ...


# --------------------------------------------------------------------------- message forms


def _chat_call(call: Any, index: int) -> Message:
    """A tool call in OpenAI form with dict arguments, from OpenAI form (arguments a dict or a
    JSON string) or the trace schema's flat {"id", "name", "arguments"}."""
    if not isinstance(call, Mapping):
        raise ValueError(f"tool call {index} is not an object")
    function = call.get("function", call)
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"tool call {index} has no function name")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        arguments = json.loads(arguments)  # JSONDecodeError is a ValueError
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call {index}: arguments are not an object")
    call_id = call.get("id") or f"call_{index}"
    return {"id": str(call_id), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[Message]:
    """State messages in the OpenAI chat form (dict arguments), whichever form they came in.

    Trace turns carry annotations (logprobs, error kinds) no backend should see, and flat tool
    calls chat templates cannot render; both are normalised here, so the cache key is the
    state a teacher is actually shown.
    """
    out = []
    for message in messages:
        chat: Message = {"role": message["role"], "content": message.get("content") or ""}
        if message.get("tool_calls"):
            chat["tool_calls"] = [_chat_call(call, i) for i, call in enumerate(message["tool_calls"])]
        if message.get("tool_call_id") is not None:
            chat["tool_call_id"] = message["tool_call_id"]
        out.append(chat)
    return out


def parse_action(message: Any) -> Message:
    """A backend's answer as an action; ValueError when it is malformed or empty."""
    if not isinstance(message, Mapping):
        raise ValueError("the answer is not an object")
    if message.get("role", "assistant") != "assistant":
        raise ValueError(f"the answer's role is {message.get('role')!r}, not 'assistant'")
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    if not isinstance(content, str) or not isinstance(calls, list):
        raise ValueError("the answer's content is not text or its tool_calls not a list")
    if not content.strip() and not calls:
        raise ValueError("the answer is empty")
    action: Message = {"role": "assistant", "content": content}
    if calls:
        action["tool_calls"] = [_chat_call(call, i) for i, call in enumerate(calls)]
    return action


# --------------------------------------------------------------------------- OpenAI-compatible


class CostMeter:
    """USD spent by all paid teachers together, so they stop as one at the run's ceiling."""

    def __init__(self, ceiling_usd: float) -> None:
        self.ceiling_usd = ceiling_usd
        self._spent = 0.0
        self._lock = threading.Lock()

    @property
    def spent_usd(self) -> float:
        return self._spent

    def exhausted(self) -> bool:
        return self._spent >= self.ceiling_usd

    def charge(self, usd: float) -> None:
        with self._lock:
            self._spent += usd

    def __repr__(self) -> str:
        return f"CostMeter(spent_usd={self._spent:.6f}, ceiling_usd={self.ceiling_usd})"


def _tokens(usage: Mapping[str, Any], field: str) -> int:
    value = usage.get(field)
    return value if isinstance(value, int) and value > 0 else 0


class OpenAITeacher:
    """A chat-completions endpoint answering greedily (temperature 0).

    Timeouts, connection errors, 429 and 5xx are retried `cfg.max_retries` times with
    exponential backoff (`backoff_s`, doubling); other 4xx answers are final. A teacher with a
    price is paid: once `meter` is exhausted it answers None without a request. Without a
    meter there is no ceiling.
    """

    def __init__(
        self,
        cfg: OpenAITeacherConfig,
        client: httpx.Client | None = None,
        *,
        meter: CostMeter | None = None,
        backoff_s: float = 0.5,
    ) -> None:
        if cfg.api_key_env and cfg.api_key_env not in os.environ:
            raise ValueError(f"teacher {cfg.name!r}: env var {cfg.api_key_env} (its API key) is not set")
        self.cfg = cfg
        self.name = cfg.name
        self.identity = f"openai:{cfg.base_url.rstrip('/')}:{cfg.model}"
        self.stats = TeacherStats()
        self.meter = meter or CostMeter(math.inf)
        self.backoff_s = backoff_s
        self._owns_client = client is None
        self._client = client or httpx.Client()
        self._url = cfg.base_url.rstrip("/") + "/chat/completions"
        self._paid = cfg.usd_per_mtok_in > 0 or cfg.usd_per_mtok_out > 0

    def __repr__(self) -> str:
        return f"OpenAITeacher(name={self.name!r}, model={self.cfg.model!r}, base_url={self.cfg.base_url!r})"

    def close(self) -> None:
        """Close the HTTP client when this teacher made it (a passed client is the caller's)."""
        if self._owns_client:
            self._client.close()

    def act(self, state_messages: list[Message], context: dict[str, Any] | None = None) -> Message | None:
        if self._paid and self.meter.exhausted():
            self.stats.skipped_budget += 1
            return None
        self.stats.calls += 1
        response = self._post({"model": self.cfg.model, "messages": _wire(state_messages), "temperature": 0})
        if response is None or not response.is_success:
            self.stats.failures += 1
            return None
        try:
            body = response.json()
            if isinstance(body, dict) and isinstance(body.get("usage"), Mapping):
                self._charge(body["usage"])
            return parse_action(body["choices"][0]["message"])
        except (ValueError, LookupError, TypeError) as error:
            log.warning("teacher %s: unusable answer (%s: %s)", self.name, type(error).__name__, error)
            self.stats.failures += 1
            return None

    def _charge(self, usage: Mapping[str, Any]) -> None:
        """Bill the tokens even when the answer then turns out unusable: they were paid for."""
        usd = (
            _tokens(usage, "prompt_tokens") * self.cfg.usd_per_mtok_in
            + _tokens(usage, "completion_tokens") * self.cfg.usd_per_mtok_out
        ) / 1e6
        self.stats.usd_spent += usd
        self.meter.charge(usd)

    def _headers(self) -> dict[str, str]:
        key = os.environ.get(self.cfg.api_key_env) if self.cfg.api_key_env else None
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _post(self, payload: dict[str, Any]) -> httpx.Response | None:
        """The final response, or None when every attempt failed in transport."""
        attempts = self.cfg.max_retries + 1
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = self._client.post(
                    self._url, json=payload, headers=self._headers(), timeout=self.cfg.timeout_s
                )
            except httpx.TransportError as error:  # timeouts included
                log.warning("teacher %s: %s (attempt %d/%d)", self.name, type(error).__name__, attempt + 1, attempts)
                continue
            status = response.status_code
            if status == 429 or status >= 500:
                log.warning("teacher %s: HTTP %d (attempt %d/%d)", self.name, status, attempt + 1, attempts)
                continue
            if not response.is_success:  # the body is not logged: auth errors may echo part of the key
                log.warning("teacher %s: HTTP %d, not retried", self.name, status)
            return response
        return None


def _wire(messages: Sequence[Mapping[str, Any]]) -> list[Message]:
    """Chat messages as the endpoint takes them: tool-call arguments as JSON strings."""
    wire = chat_messages(messages)
    for message in wire:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"], ensure_ascii=False)
    return wire


# --------------------------------------------------------------------------- HF and oracle


class HFTeacher:
    """A local HF model; `generate_fn(messages) -> assistant message | None` is the engine the
    teacher actor hosts. Exceptions from it are left to `replay_state`."""

    def __init__(self, cfg: HfTeacherConfig, generate_fn: Callable[[list[Message]], Message | None]) -> None:
        self.name = cfg.name
        self.identity = f"hf:{cfg.path}"
        self.stats = TeacherStats()
        self._generate = generate_fn

    def act(self, state_messages: list[Message], context: dict[str, Any] | None = None) -> Message | None:
        self.stats.calls += 1
        try:
            return parse_action(self._generate(chat_messages(state_messages)))
        except ValueError as error:
            log.warning("teacher %s: unusable answer (%s)", self.name, error)
            self.stats.failures += 1
            return None


class OracleTeacher:
    """The task's own oracle. It needs the episode's Prompt (`context["prompt"]`), which the
    cache key does not hold, so its answers are never cached (they are free anyway)."""

    identity = None

    def __init__(self, task: Any, name: str = "oracle") -> None:
        if not isinstance(task, Demonstrating):
            raise TypeError(f"{type(task).__name__} is not a Demonstrating task (no oracle_action)")
        self.name = name
        self.stats = TeacherStats()
        self._task = task

    def act(self, state_messages: list[Message], context: dict[str, Any] | None = None) -> Message | None:
        self.stats.calls += 1
        prompt = (context or {}).get("prompt")
        try:
            if not isinstance(prompt, Prompt):
                raise ValueError("no Prompt in context['prompt']")
            return parse_action(self._task.oracle_action(prompt, chat_messages(state_messages)))
        except ValueError as error:
            log.warning("teacher %s: no answer (%s)", self.name, error)
            self.stats.failures += 1
            return None


# --------------------------------------------------------------------------- cache and replay


def cache_key(name: str, identity: str, messages: Sequence[Mapping[str, Any]]) -> str:
    canonical = json.dumps([name, identity, messages], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


class TeacherCache:
    """Teachers' actions by `cache_key`, one JSON line `{"key", "action"}` per answer.

    Each put is flushed and fsynced, so a crash loses at most the line being written; loading
    drops such a partial last line (and cuts it from the file, so the next append starts on a
    line of its own). A corrupt line elsewhere is not a crash's trace and raises. One writer
    per file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._actions: dict[str, Message] = {}
        self._lock = threading.Lock()
        if self.path.exists():
            self._load()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def __len__(self) -> int:
        return len(self._actions)

    def _load(self) -> None:
        data = self.path.read_bytes()
        complete = data.rfind(b"\n") + 1
        if complete < len(data):
            log.warning("teacher cache %s: dropping a partial last line (%d bytes)", self.path, len(data) - complete)
            with self.path.open("r+b") as f:
                f.truncate(complete)
                os.fsync(f.fileno())
        for number, line in enumerate(data[:complete].splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                self._actions[record["key"]] = record["action"]
            except (ValueError, LookupError, TypeError) as error:
                raise ValueError(f"{self.path}:{number}: corrupt cache line ({error})") from error

    def get(self, key: str) -> Message | None:
        action = self._actions.get(key)
        return copy.deepcopy(action) if action is not None else None

    def put(self, key: str, action: Message) -> None:
        line = json.dumps({"key": key, "action": action}, ensure_ascii=False) + "\n"
        with self._lock:
            with self.path.open("ab") as f:
                f.write(line.encode())
                f.flush()
                os.fsync(f.fileno())
            self._actions[key] = copy.deepcopy(action)


def replay_state(
    teachers: Sequence[Teacher],
    cache: TeacherCache | None,
    state_messages: Sequence[Mapping[str, Any]],
    context: dict[str, Any] | None = None,
) -> dict[str, Message | None]:
    """Every teacher's action at this state, by teacher name (None where a teacher failed).

    Cached answers are reused; new ones are cached, failures are not (a later run retries
    them). An exception from a teacher counts as its failure and the others still answer.
    """
    names = [teacher.name for teacher in teachers]
    if len(set(names)) != len(names):
        raise ValueError(f"teacher names must be distinct, got {names}")
    messages = chat_messages(state_messages)
    actions: dict[str, Message | None] = {}
    for teacher in teachers:
        cacheable = cache is not None and teacher.identity is not None
        key = cache_key(teacher.name, teacher.identity, messages) if cacheable else None
        cached = cache.get(key) if key is not None else None
        if cached is not None:
            teacher.stats.cache_hits += 1
            actions[teacher.name] = cached
            continue
        try:
            action = teacher.act(messages, context)
        except Exception as error:  # noqa: BLE001 - any teacher bug is that teacher's failure
            log.warning("teacher %s raised %s: %s", teacher.name, type(error).__name__, error)
            teacher.stats.failures += 1
            action = None
        if action is not None and key is not None:
            cache.put(key, action)
        actions[teacher.name] = action
    return actions


def hf_generate_fn(path: str, max_new_tokens: int = 128) -> Callable[[list[Message]], Message | None]:
    """Greedy next assistant turn from a local HF model through its own chat template."""
    from transformers import AutoTokenizer

    from meshrl.actors.hf_engine import HFEngine
    from meshrl.tasks.toolcalls import parse_tool_calls

    engine = HFEngine.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)

    def generate(messages: list[Message]) -> Message | None:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        (completion,) = engine.generate([list(ids)], temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens)
        content, calls = parse_tool_calls(tokenizer.decode(completion.completion_ids, skip_special_tokens=True))
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}

    return generate


class TeacherActor(Actor):
    """The teacher-replay mesh's actor: the configured teachers, one shared cost meter and disk cache."""

    def __init__(self, config: Any, model_path: str, cache_path: str, rank: int | None = None) -> None:
        from meshrl.actors.generator import make_task

        self.rank = current_rank().rank if rank is None else rank  # a replacement keeps the rank it replaces
        meter = CostMeter(config.teachers.usd_ceiling)
        task = None
        self.teachers: list[Teacher] = []
        for spec in config.teachers.members:
            if spec.backend == "openai":
                self.teachers.append(OpenAITeacher(spec, meter=meter))
            elif spec.backend == "hf":
                self.teachers.append(HFTeacher(spec, hf_generate_fn(spec.path)))
            else:
                task = task or make_task(config)
                self.teachers.append(OracleTeacher(task, name=spec.name))
        self.cache = TeacherCache(cache_path)

    @endpoint
    def info(self) -> dict[str, Any]:
        from meshrl.actors.run_dir import process_info

        return {"role": "teacher", "rank": self.rank, **process_info(), "teachers": [t.name for t in self.teachers]}

    @endpoint
    def replay(
        self, states: list[list[Message]], contexts: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Message | None]], dict[str, float]]:
        """Every teacher's action at each state, and the cumulative counters over all teachers."""
        answers = [replay_state(self.teachers, self.cache, s, c) for s, c in zip(states, contexts)]
        totals: dict[str, float] = {}
        for teacher in self.teachers:
            for name, value in vars(teacher.stats).items():
                totals[name] = totals.get(name, 0.0) + float(value)
        return answers, totals
