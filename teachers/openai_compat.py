"""An OpenAI-compatible chat-completions endpoint as a teacher.

The API key is read from its env var at each request: it is never stored on an object,
logged, cached or counted.
"""

from __future__ import annotations

import email.utils
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import httpx

from meshrl.configs.schema import OpenAITeacher as OpenAITeacherConfig
from meshrl.teachers.base import Message, TeacherStats, chat_messages, parse_action
from meshrl.teachers.cost import CostMeter

log = logging.getLogger(__name__)


def _tokens(usage: Mapping[str, Any], field: str) -> int:
    value = usage.get(field)
    return value if isinstance(value, int) and value > 0 else 0


def retry_after_s(value: str | None, now: datetime | None = None) -> float | None:
    """The wait a `Retry-After` header asks for (RFC 9110: delay seconds or an HTTP-date; a
    date already past asks for none), or None when it is absent or unparseable."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except ValueError:
            return None
        when = when if when.tzinfo else when.replace(tzinfo=UTC)  # an HTTP-date is always GMT
        return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())
    return seconds if 0 <= seconds < math.inf else None


class OpenAITeacher:
    """A chat-completions endpoint answering greedily (temperature 0), with the task's `tools`
    (OpenAI function schemas) in each request when it declares any.

    Timeouts, connection errors, 429 and 5xx are retried `cfg.max_retries` times with
    exponential backoff (`backoff_s`, doubling); a 429 or 503 with a `Retry-After` header waits
    what it asks instead, at most `cfg.timeout_s` (rate limits clear on the server's clock, not
    ours). Other 4xx answers are final. A teacher with a price is paid: once `meter` is
    exhausted it answers None without a request. Without a meter there is no ceiling.
    """

    def __init__(
        self,
        cfg: OpenAITeacherConfig,
        client: httpx.Client | None = None,
        *,
        meter: CostMeter | None = None,
        tools: list[dict[str, Any]] | None = None,
        backoff_s: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if cfg.api_key_env and cfg.api_key_env not in os.environ:
            raise ValueError(f"teacher {cfg.name!r}: env var {cfg.api_key_env} (its API key) is not set")
        self.cfg = cfg
        self.name = cfg.name
        self.identity = f"openai:{cfg.base_url.rstrip('/')}:{cfg.model}"
        if tools:  # answers depend on the tools offered: cached apart
            self.identity += ":tools=" + hashlib.sha256(json.dumps(tools, sort_keys=True).encode()).hexdigest()[:16]
        self.stats = TeacherStats()
        self.meter = meter or CostMeter(math.inf)
        self.tools = tools
        self.backoff_s = backoff_s
        self.sleep = sleep
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
            self.stats.add(skipped_budget=1)
            return None
        self.stats.add(calls=1)
        payload = {"model": self.cfg.model, "messages": _wire(state_messages), "temperature": 0}
        if self.tools:  # the endpoint then answers with native tool_calls
            payload["tools"] = self.tools
        response = self._post(payload)
        if response is None or not response.is_success:
            self.stats.add(failures=1)
            return None
        try:
            body = response.json()
            if isinstance(body, dict) and isinstance(body.get("usage"), Mapping):
                self._charge(body["usage"])
            return parse_action(body["choices"][0]["message"])
        except (ValueError, LookupError, TypeError) as error:
            log.warning("teacher %s: unusable answer (%s: %s)", self.name, type(error).__name__, error)
            self.stats.add(failures=1)
            return None

    def check_tools(self) -> None:
        """At start-up, for an unpaid teacher (a server of the user's own) given tools: an endpoint
        that refuses requests with tools (vLLM without `--enable-auto-tool-choice
        --tool-call-parser`) is refused now, naming what to change, instead of counted as a failure
        on every call of the run. One request of one token; an endpoint down or busy now is left to
        the calls, which retry. A paid API is not asked: it takes tools, and nothing is spent
        outside the run's ceiling."""
        if not self.tools or self._paid:
            return
        probe = {"model": self.cfg.model, "messages": [{"role": "user", "content": "Hello."}], "tools": self.tools,
                 "temperature": 0, "max_tokens": 1}  # fmt: skip
        try:
            response = self._client.post(self._url, json=probe, headers=self._headers(), timeout=self.cfg.timeout_s)
        except httpx.TransportError:
            return
        if response.status_code == 400 and "tool" in response.text.lower():
            raise ValueError(
                f"teacher {self.name!r}: {self.cfg.base_url} refuses requests with tools (HTTP 400: "
                f"{_error_message(response)}). The task declares tools, so the teacher must take them: a vLLM server "
                "needs --enable-auto-tool-choice and the --tool-call-parser of its model (hermes for Qwen2.5/Qwen3)"
            )

    def _charge(self, usage: Mapping[str, Any]) -> None:
        """Bill the tokens even when the answer then turns out unusable: they were paid for."""
        usd = (
            _tokens(usage, "prompt_tokens") * self.cfg.usd_per_mtok_in
            + _tokens(usage, "completion_tokens") * self.cfg.usd_per_mtok_out
        ) / 1e6
        self.stats.add(usd_spent=usd)
        self.meter.charge(usd)

    def _headers(self) -> dict[str, str]:
        key = os.environ.get(self.cfg.api_key_env) if self.cfg.api_key_env else None
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _post(self, payload: dict[str, Any]) -> httpx.Response | None:
        """The final response, or None when every attempt failed in transport, 429 or 5xx."""
        attempts = self.cfg.max_retries + 1
        for attempt in range(1, attempts + 1):
            try:
                response = self._client.post(
                    self._url, json=payload, headers=self._headers(), timeout=self.cfg.timeout_s
                )
            except httpx.TransportError as error:  # timeouts included
                log.warning("teacher %s: %s (attempt %d/%d)", self.name, type(error).__name__, attempt, attempts)
                response = None
            else:
                status = response.status_code
                if status != 429 and status < 500:
                    if not response.is_success:  # the body is not logged: auth errors may echo part of the key
                        log.warning("teacher %s: HTTP %d, not retried", self.name, status)
                    return response
                log.warning("teacher %s: HTTP %d (attempt %d/%d)", self.name, status, attempt, attempts)
            if attempt < attempts:
                self.sleep(self._wait_s(attempt, response))
        return None

    def _wait_s(self, attempt: int, response: httpx.Response | None) -> float:
        """Seconds to wait after failed `attempt` (1-based): a 429's or 503's `Retry-After`,
        capped at `cfg.timeout_s`, else the exponential backoff."""
        backoff = self.backoff_s * 2 ** (attempt - 1)
        if response is None or response.status_code not in (429, 503):
            return backoff
        asked = retry_after_s(response.headers.get("Retry-After"))
        if asked is None:
            return backoff
        if asked > self.cfg.timeout_s:
            log.warning(
                "teacher %s: HTTP %d asks to retry after %.1f s; waiting timeout_s = %.1f s instead",
                self.name,
                response.status_code,
                asked,
                self.cfg.timeout_s,
            )
            return self.cfg.timeout_s
        return asked


def _error_message(response: httpx.Response) -> str:
    """The error's message from an OpenAI-style error body (vLLM's too), at most 300 characters."""
    try:
        body = response.json()
        error = body.get("error", body) if isinstance(body, dict) else {}
        message = error.get("message") if isinstance(error, dict) else error
    except ValueError:
        message = response.text
    return str(message)[:300]


def _wire(messages: Sequence[Mapping[str, Any]]) -> list[Message]:
    """Chat messages as the endpoint takes them: tool-call arguments as JSON strings."""
    wire = chat_messages(messages)
    for message in wire:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"], ensure_ascii=False)
    return wire
