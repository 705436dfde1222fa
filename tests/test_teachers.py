"""Teacher backends against a real OpenAI-compatible server on 127.0.0.1 (scripted per request),
the on-disk cache across a resumed run, the oracle, and replay with a failing teacher."""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from monarch.actor import this_host

from meshrl.actors.teacher import TeacherActor
from meshrl.configs import load_config
from meshrl.configs.schema import HfTeacher as HfTeacherConfig
from meshrl.configs.schema import OpenAITeacher as OpenAITeacherConfig
from meshrl.tasks.base import Prompt, ToolResult, task_tools
from meshrl.tasks.horizon import HorizonTask
from meshrl.tasks.toy import ToolTask
from meshrl.teachers.base import TeacherStats, chat_messages
from meshrl.teachers.cache import TeacherCache, cache_key
from meshrl.teachers.cost import CostMeter
from meshrl.teachers.hf import HFTeacher
from meshrl.teachers.openai_compat import OpenAITeacher, retry_after_s
from meshrl.teachers.oracle import OracleTeacher
from meshrl.teachers.replay import make_teachers, replay_states
from meshrl.traces.pairs import ReplayState, mine_pairs
from meshrl.traces.schema import ToolCall, TraceExample, Turn

pytestmark = pytest.mark.network  # OpenAI-compatible endpoints served on loopback

SECRET = "sk-test-9f8e7d6c5b4a-never-leak"
KEY_ENV = "MESHRL_TEST_TEACHER_KEY"

# The trace schema's flat form, as `trace_states` dumps a state.
STATE = [
    {"role": "user", "content": "list the files"},
    {
        "role": "assistant",
        "content": "Looking.",
        "tool_calls": [{"id": "toolu_1", "name": "bash", "arguments": {"cmd": "pwd"}}],
        "logprobs": [-0.5, -0.1],
    },
    {"role": "tool", "content": "/work", "tool_call_id": "toolu_1", "is_error": False},
]
LS_CALL = {"id": "call_ls", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}
CUT_CALL = {**LS_CALL, "function": {"name": "bash", "arguments": '{"cmd": "ls"'}}  # arguments cut mid-JSON
LS_ACTION = {
    "role": "assistant",
    "content": "Listing.",
    "tool_calls": [{"id": "call_ls", "type": "function", "function": {"name": "bash", "arguments": {"cmd": "ls"}}}],
}


def completion(message: dict[str, Any], prompt_tokens: int = 1000, completion_tokens: int = 500) -> bytes:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    return json.dumps({"choices": [{"index": 0, "message": message}], "usage": usage}).encode()


# behaviour -> (status, body); "hang" answers nothing until the test ends, "echo" answers with
# the last message's content, and a behaviour ending in " retry-after=VALUE" sends that header.
RESPONSES: dict[str, tuple[int, bytes]] = {
    "ok": (200, completion({"role": "assistant", "content": "Listing.", "tool_calls": [LS_CALL]})),
    "500": (500, b'{"error": "overloaded"}'),
    "429": (429, b'{"error": "rate limited"}'),
    "503": (503, b'{"error": "unavailable"}'),
    "401": (401, json.dumps({"error": f"Incorrect API key provided: {SECRET}"}).encode()),
    "garbage": (200, b"<html>502 Bad Gateway</html>"),
    "no_choices": (200, json.dumps({"id": "x", "choices": []}).encode()),
    "bad_arguments": (200, completion({"role": "assistant", "content": "", "tool_calls": [CUT_CALL]})),
    # vLLM's answer to tools when started without --enable-auto-tool-choice / --tool-call-parser
    "no_tools": (
        400,
        json.dumps(
            {
                "error": {
                    "message": '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                    "type": "BadRequestError",
                    "code": 400,
                }
            }
        ).encode(),
    ),
}


class Endpoint:
    """An OpenAI-compatible /v1/chat/completions on 127.0.0.1; each request takes the next
    scripted behaviour (`default` once the script runs out) and is recorded. With a `barrier`
    set, every request waits on it before answering; `max_in_flight` is the most requests it
    held at once."""

    def __init__(self) -> None:
        self.script: list[str] = []
        self.default = "ok"
        self.requests: list[dict[str, Any]] = []
        self.released = threading.Event()
        self.barrier: threading.Barrier | None = None
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                with endpoint.lock:
                    endpoint.in_flight += 1
                    endpoint.max_in_flight = max(endpoint.max_in_flight, endpoint.in_flight)
                self.held = True
                try:
                    self.answer()
                finally:
                    self.release()

            def release(self) -> None:
                """Held no more once its answer starts: the client may send its next request as soon
                as it reads the answer, before this handler returns (counted then, 4 were "held")."""
                if self.held:
                    self.held = False
                    with endpoint.lock:
                        endpoint.in_flight -= 1

            def answer(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with endpoint.lock:
                    endpoint.requests.append(
                        {"path": self.path, "authorization": self.headers.get("Authorization"), "body": body}
                    )
                    behaviour = endpoint.script.pop(0) if endpoint.script else endpoint.default
                if endpoint.barrier is not None:
                    endpoint.barrier.wait(5)
                behaviour, _, retry_after = behaviour.partition(" retry-after=")
                if self.path != "/v1/chat/completions":
                    behaviour = "404"
                if behaviour == "hang":
                    endpoint.released.wait(5)
                    return
                if behaviour == "echo":
                    status, payload = 200, completion({"role": "assistant", "content": body["messages"][-1]["content"]})
                else:
                    status, payload = RESPONSES.get(behaviour, (404, b"{}"))
                self.release()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                if retry_after:
                    self.send_header("Retry-After", retry_after)
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    server = Endpoint()
    yield server
    server.close()


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    """No proxies from the environment: every request stays on loopback (shared: SSL set-up is slow)."""
    with httpx.Client(trust_env=False) as http:
        yield http


@pytest.fixture(autouse=True)
def api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)


def make_teacher(
    endpoint: Endpoint, client: httpx.Client, name: str = "gpt", meter: CostMeter | None = None, **fields: Any
) -> OpenAITeacher:
    cfg = OpenAITeacherConfig(
        **{
            "name": name,
            "base_url": endpoint.base_url,
            "model": "teacher-model",
            "api_key_env": KEY_ENV,
            "timeout_s": 0.3,
            "max_retries": 2,
            **fields,
        }
    )
    return OpenAITeacher(cfg, client, meter=meter, backoff_s=0.01)


# --- OpenAI-compatible teacher ------------------------------------------------------------


def test_answer_is_parsed_and_the_request_is_greedy_authorised_and_in_wire_form(endpoint, client):
    teacher = make_teacher(endpoint, client)
    assert teacher.act(STATE, None) == LS_ACTION
    (request,) = endpoint.requests
    assert request["path"] == "/v1/chat/completions"
    assert request["authorization"] == f"Bearer {SECRET}"
    body = request["body"]
    assert body["model"] == "teacher-model" and body["temperature"] == 0
    assert body["messages"] == [
        {"role": "user", "content": "list the files"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "pwd"}'}}
            ],
        },
        {"role": "tool", "content": "/work", "tool_call_id": "toolu_1"},
    ]
    assert teacher.stats == TeacherStats(calls=1, usd_spent=0.0)


def test_the_tasks_tool_schemas_are_sent_and_native_calls_read(endpoint, client):
    tools = task_tools(ToolTask())
    cfg = make_teacher(endpoint, client).cfg
    teacher = OpenAITeacher(cfg, client, tools=tools)
    assert teacher.act(STATE, None) == LS_ACTION  # native tool_calls, arguments a JSON string
    assert endpoint.requests[0]["body"]["tools"] == tools
    make_teacher(endpoint, client).act(STATE, None)
    assert "tools" not in endpoint.requests[1]["body"]  # a task without tools sends none
    assert OpenAITeacher(cfg, client).identity != teacher.identity  # answers with and without tools cached apart


def test_a_run_refuses_at_start_up_an_endpoint_that_cannot_take_the_tasks_tools(endpoint):
    """make_teachers (the teacher mesh's start-up) probes an unpaid teacher given tools once: a 400
    about tools stops the run there, naming the server flags; an endpoint down at start-up is left
    to the calls (which retry and count failures); a paid API is never probed (nothing is spent
    outside the run's ceiling)."""
    member = {"backend": "openai", "name": "gpt", "base_url": endpoint.base_url, "model": "m", "api_key_env": KEY_ENV,
              "max_retries": 0}  # fmt: skip
    config = load_config([]).model_copy(deep=True)  # the toy task: its `lookup` tool
    config.teachers.min_agree = 1
    config.teachers.members = [OpenAITeacherConfig(**member)]
    endpoint.script = ["no_tools"]
    with pytest.raises(ValueError, match="refuses requests with tools .*--enable-auto-tool-choice"):
        make_teachers(config, CostMeter(10.0))
    assert (
        endpoint.requests[0]["body"]["tools"] == task_tools(ToolTask())
        and endpoint.requests[0]["body"]["max_tokens"] == 1
    )
    endpoint.script = ["500"]
    (down,) = make_teachers(config, CostMeter(10.0))
    assert down.stats.failures == 0
    (up,) = make_teachers(config, CostMeter(10.0))
    assert up.stats == TeacherStats() and len(endpoint.requests) == 3
    config.teachers.members = [OpenAITeacherConfig(**member, usd_per_mtok_in=1.0)]
    endpoint.script = ["no_tools"]
    make_teachers(config, CostMeter(10.0))
    assert len(endpoint.requests) == 3  # a paid API: not asked


def test_no_key_env_sends_no_authorization(endpoint, client):
    teacher = make_teacher(endpoint, client, api_key_env=None)
    assert teacher.act(STATE, None) == LS_ACTION
    assert endpoint.requests[0]["authorization"] is None


def test_an_unset_key_env_is_refused_at_construction(endpoint, client, monkeypatch):
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ValueError, match=KEY_ENV):
        make_teacher(endpoint, client)


@pytest.mark.parametrize("first", ["500", "429", "hang"])
def test_transient_failures_are_retried(endpoint, client, first):
    endpoint.script = [first, "ok"]
    teacher = make_teacher(endpoint, client)
    start = time.monotonic()
    assert teacher.act(STATE, None) == LS_ACTION
    assert len(endpoint.requests) == 2
    assert teacher.stats.failures == 0
    if first == "hang":
        assert time.monotonic() - start >= 0.3


def test_retries_are_bounded_and_back_off_exponentially(endpoint, client):
    endpoint.script = ["500"] * 10
    teacher = make_teacher(endpoint, client, max_retries=3)
    teacher.backoff_s, teacher.sleep = 0.05, (sleeps := []).append
    assert teacher.act(STATE, None) is None
    assert len(endpoint.requests) == 4
    assert sleeps == [0.05, 0.1, 0.2]
    assert teacher.stats.calls == 1 and teacher.stats.failures == 1


PAST = format_datetime(datetime(2020, 1, 1, tzinfo=UTC), usegmt=True)
FUTURE = format_datetime(datetime(2100, 1, 1, tzinfo=UTC), usegmt=True)  # fixed: xdist workers collect the same ids


@pytest.mark.parametrize(
    ("answer", "slept"),
    [
        ("429 retry-after=2", 2.0),
        ("503 retry-after=0.25", 0.25),
        ("429 retry-after=3600", 30.0),  # longer than timeout_s: waits timeout_s
        (f"503 retry-after={FUTURE}", 30.0),
        (f"429 retry-after={PAST}", 0.0),
        ("429 retry-after=soon", 0.01),  # unparseable: the backoff
        ("429 retry-after=-3", 0.01),
        ("500 retry-after=2", 0.01),  # honoured on 429 and 503 only
        ("429", 0.01),
    ],
)
def test_retry_after_on_429_and_503_replaces_the_backoff_up_to_the_timeout(endpoint, client, answer, slept):
    endpoint.script = [answer, "ok"]
    teacher = make_teacher(endpoint, client, timeout_s=30.0)
    teacher.sleep = (sleeps := []).append
    assert teacher.act(STATE, None) == LS_ACTION
    assert sleeps == [slept] and len(endpoint.requests) == 2


def test_a_retry_after_past_the_timeout_is_logged(endpoint, client, caplog):
    endpoint.script = ["429 retry-after=3600"]
    teacher = make_teacher(endpoint, client, timeout_s=30.0)
    teacher.sleep = (sleeps := []).append
    teacher.act(STATE, None)
    assert sleeps == [30.0]
    assert "asks to retry after 3600.0 s; waiting timeout_s = 30.0 s" in caplog.text


def test_retry_after_reads_delay_seconds_and_http_dates():
    now = datetime(2015, 10, 21, 7, 28, tzinfo=UTC)
    assert retry_after_s("120", now) == 120.0
    assert retry_after_s("1.5", now) == 1.5
    assert retry_after_s("Wed, 21 Oct 2015 07:28:45 GMT", now) == 45.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:45 -0000", now) == 45.0  # no zone: GMT
    assert retry_after_s("Wed, 21 Oct 2015 07:00:00 GMT", now) == 0.0  # already past
    for unusable in [None, "", "soon", "-1", "nan", "inf", "Wed, 32 Oct 2015 07:28:00 GMT"]:
        assert retry_after_s(unusable, now) is None


def test_a_hang_past_every_retry_times_out_as_a_failure(endpoint, client):
    endpoint.script = ["hang", "hang"]
    teacher = make_teacher(endpoint, client, max_retries=1)
    start = time.monotonic()
    assert teacher.act(STATE, None) is None
    assert 0.6 <= time.monotonic() - start < 2.0
    assert len(endpoint.requests) == 2 and teacher.stats.failures == 1


def test_unauthorised_is_final(endpoint, client):
    endpoint.script = ["401", "ok"]
    teacher = make_teacher(endpoint, client)
    assert teacher.act(STATE, None) is None
    assert len(endpoint.requests) == 1
    assert teacher.stats.failures == 1


@pytest.mark.parametrize("behaviour", ["garbage", "no_choices", "bad_arguments"])
def test_garbage_answers_are_counted_failures_not_exceptions(endpoint, client, behaviour):
    endpoint.script = [behaviour]
    teacher = make_teacher(endpoint, client)
    assert teacher.act(STATE, None) is None
    assert len(endpoint.requests) == 1
    assert teacher.stats.calls == 1 and teacher.stats.failures == 1


def test_the_key_appears_nowhere_but_the_header(endpoint, client, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    meter = CostMeter(1.0)
    teacher = make_teacher(endpoint, client, meter=meter, usd_per_mtok_in=1.0)
    cache = TeacherCache(tmp_path / "cache.jsonl")
    endpoint.script = ["401", "ok"]
    replay_state([teacher], cache, STATE)  # the 401 body echoes the key
    replay_state([teacher], cache, STATE)
    assert endpoint.requests[-1]["authorization"] == f"Bearer {SECRET}"
    shown = [repr(teacher), repr(vars(teacher)), repr(teacher.stats), repr(meter), repr(vars(cache)), caplog.text]
    assert not any(SECRET in text for text in shown)
    assert SECRET not in (tmp_path / "cache.jsonl").read_text()
    assert "HTTP 401" in caplog.text


# --- cost ---------------------------------------------------------------------------------


def test_cost_is_priced_per_million_tokens(endpoint, client):
    teacher = make_teacher(endpoint, client, usd_per_mtok_in=2.0, usd_per_mtok_out=8.0)
    teacher.act(STATE, None)
    teacher.act(STATE, None)
    assert teacher.stats.usd_spent == pytest.approx(2 * (1000 * 2.0 + 500 * 8.0) / 1e6)
    assert teacher.meter.spent_usd == pytest.approx(teacher.stats.usd_spent)


def test_unusable_answers_are_still_billed(endpoint, client):
    endpoint.script = ["bad_arguments"]
    teacher = make_teacher(endpoint, client, usd_per_mtok_in=2.0, usd_per_mtok_out=8.0)
    assert teacher.act(STATE, None) is None
    assert teacher.stats.usd_spent == pytest.approx(0.006)


def test_the_ceiling_is_shared_and_stops_paid_teachers_without_a_request(endpoint, client):
    meter = CostMeter(0.01)  # each answer costs 0.006
    first = make_teacher(endpoint, client, "a", meter, usd_per_mtok_in=2.0, usd_per_mtok_out=8.0)
    second = make_teacher(endpoint, client, "b", meter, usd_per_mtok_in=2.0, usd_per_mtok_out=8.0)
    free = make_teacher(endpoint, client, "local", meter)
    assert first.act(STATE, None) == LS_ACTION
    assert second.act(STATE, None) == LS_ACTION  # 0.006 < 0.01: still allowed, ends at 0.012
    assert meter.exhausted()
    requests = len(endpoint.requests)
    assert first.act(STATE, None) is None and second.act(STATE, None) is None
    assert len(endpoint.requests) == requests
    assert (first.stats.skipped_budget, second.stats.skipped_budget) == (1, 1)
    assert (first.stats.failures, second.stats.failures) == (0, 0)
    assert free.act(STATE, None) == LS_ACTION  # an unpriced endpoint is never stopped
    assert meter.spent_usd == pytest.approx(0.012)


@pytest.mark.mesh
def test_a_teacher_actor_counts_the_runs_other_spend_against_the_ceiling(endpoint, tmp_path):
    """Other teacher actors, a replaced one, the run before a resume: the controller passes what
    they spent with every round, and the ceiling counts it."""
    member = {"backend": "openai", "name": "gpt", "base_url": endpoint.base_url, "model": "m",
              "api_key_env": KEY_ENV, "usd_per_mtok_in": 2.0, "usd_per_mtok_out": 8.0}  # fmt: skip
    config = load_config(["--teachers.members", json.dumps([member]), "--teachers.min_agree", "1",
                          "--teachers.usd_ceiling", "0.01"])  # fmt: skip
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        actor = procs.spawn("teacher", TeacherActor, config, "unused", str(tmp_path / "cache.jsonl"))
        answers = actor.replay.call_one([STATE], [{}], 0.012).get()  # spent elsewhere in the run
    finally:
        procs.stop().get()
    assert answers.actions == [{"gpt": None}]
    assert answers.totals["skipped_budget"] == 1
    assert endpoint.requests == []  # the ceiling held: nothing was paid for


def replay_state(teachers, cache, state, context=None):
    """One state's answers, its teachers asked one after another."""
    return replay_states(teachers, cache, [state], [context], max_concurrent=1)[0]


# --- cache --------------------------------------------------------------------------------


def test_a_resumed_run_answers_cached_states_without_requests(endpoint, client, tmp_path):
    path = tmp_path / "teachers" / "cache.jsonl"
    first = make_teacher(endpoint, client)
    assert replay_state([first], TeacherCache(path), STATE) == {"gpt": LS_ACTION}
    assert len(endpoint.requests) == 1

    resumed = make_teacher(endpoint, client)
    assert replay_state([resumed], TeacherCache(path), STATE) == {"gpt": LS_ACTION}
    assert len(endpoint.requests) == 1
    assert resumed.stats == TeacherStats(cache_hits=1)

    other_state = [*STATE, {"role": "user", "content": "and now?"}]
    replay_state([resumed], TeacherCache(path), other_state)
    assert len(endpoint.requests) == 2


def test_the_key_is_the_state_shown_not_its_annotations_or_form():
    openai_form = chat_messages(STATE)
    annotated = [dict(m, logprobs=[-1.0]) if m["role"] == "assistant" else m for m in STATE]
    key = cache_key("gpt", "openai:x:m", chat_messages(STATE))
    assert key == cache_key("gpt", "openai:x:m", chat_messages(openai_form))
    assert key == cache_key("gpt", "openai:x:m", chat_messages(annotated))
    assert key != cache_key("gpt", "openai:x:other-model", chat_messages(STATE))
    assert key != cache_key("claude", "openai:x:m", chat_messages(STATE))


def test_failures_are_not_cached(endpoint, client, tmp_path):
    path = tmp_path / "cache.jsonl"
    endpoint.script = ["401"]
    assert replay_state([make_teacher(endpoint, client)], TeacherCache(path), STATE) == {"gpt": None}
    assert len(TeacherCache(path)) == 0
    assert replay_state([make_teacher(endpoint, client)], TeacherCache(path), STATE) == {"gpt": LS_ACTION}
    assert len(endpoint.requests) == 2


def test_a_truncated_last_line_is_dropped_and_appends_stay_readable(tmp_path):
    path = tmp_path / "cache.jsonl"
    cache = TeacherCache(path)
    cache.put("a", LS_ACTION)
    cache.put("b", {"role": "assistant", "content": "done"})
    with path.open("ab") as f:  # a crash in the middle of a third write
        f.write(b'{"key": "c", "action": {"role": "assis')
    resumed = TeacherCache(path)
    assert (resumed.get("a"), resumed.get("c")) == (LS_ACTION, None)
    resumed.put("c", {"role": "assistant", "content": "again"})
    reloaded = TeacherCache(path)
    assert len(reloaded) == 3 and reloaded.get("c") == {"role": "assistant", "content": "again"}


def test_a_corrupt_line_before_the_end_raises(tmp_path):
    path = tmp_path / "cache.jsonl"
    path.write_text('{"key": "a", "action": {"role": "assistant", "content": "x"}}\nnot json\n{"key": "b"}\n')
    with pytest.raises(ValueError, match=":2: corrupt"):
        TeacherCache(path)


def test_cached_actions_are_copies(tmp_path):
    cache = TeacherCache(tmp_path / "cache.jsonl")
    cache.put("a", {"role": "assistant", "content": "x"})
    cache.get("a")["content"] = "changed"
    assert cache.get("a") == {"role": "assistant", "content": "x"}


# --- oracle and HF ------------------------------------------------------------------------


class CountdownTask:
    """A stand-in task whose oracle always calls `answer` with the prompt's expected answer."""

    max_turns = 4

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        return [self.prompt(str(rng.randint(0, 9))) for _ in range(n)]

    def prompt(self, answer: str) -> Prompt:
        return Prompt(prompt_id=f"p{answer}", messages=[{"role": "user", "content": "count down"}], answer=answer)

    def call_tool(self, prompt: Prompt, name: str, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult("ok")

    def reward(self, prompt: Prompt, messages: list[dict[str, Any]]) -> float:
        return 1.0

    def demonstrations(self, rng: random.Random, n: int) -> list[TraceExample]:
        return []

    def oracle_action(self, prompt: Prompt, messages: list[dict[str, Any]]) -> dict[str, Any]:
        self.seen = messages
        call = {"id": "o1", "type": "function", "function": {"name": "answer", "arguments": {"value": prompt.answer}}}
        return {"role": "assistant", "content": "", "tool_calls": [call]}


def test_the_oracle_answers_from_the_prompt_in_context():
    task = CountdownTask()
    oracle = OracleTeacher(task)
    action = oracle.act(STATE, {"prompt": task.prompt("3")})
    assert action["tool_calls"][0]["function"] == {"name": "answer", "arguments": {"value": "3"}}
    assert task.seen == chat_messages(STATE)


def test_the_oracle_without_a_prompt_fails():
    oracle = OracleTeacher(CountdownTask(), name="truth")
    assert oracle.act(STATE, None) is None and oracle.act(STATE, {}) is None
    assert oracle.stats.failures == 2


def test_an_abstaining_oracle_gives_no_action_and_no_pair_and_is_no_failure():
    task = HorizonTask(hops=3)
    prompt = task.sample_prompts(random.Random(0), 1)[0]
    mid = prompt.info["chain"][1]  # started mid-chain: off the chain, where the oracle abstains
    call = ToolCall(id="call_0", name="lookup", arguments={"key": mid})
    turns = [Turn(role=m["role"], content=m["content"]) for m in prompt.messages]
    turns += [
        Turn(role="assistant", tool_calls=[call]),
        Turn(role="tool", content=prompt.info["store"][mid], tool_call_id="call_0"),
    ]
    state = [t.model_dump(exclude_none=True) for t in turns]
    oracles = [OracleTeacher(task, name=f"oracle_{i}") for i in range(2)]
    actions = replay_states(oracles, None, [state], [{"prompt": prompt}], max_concurrent=2)[0]
    assert actions == {"oracle_0": None, "oracle_1": None} and all(o.stats.failures == 0 for o in oracles)
    student = ReplayState(
        trace_id="t",
        turn_index=len(turns),
        state_messages=state,
        student_action=Turn(
            role="assistant",
            tool_calls=[ToolCall(id="call_1", name="lookup", arguments={"key": prompt.info["chain"][2]})],
        ),
    )
    assert mine_pairs(student, actions, min_agree=2) is None


def test_the_oracle_needs_a_demonstrating_task():
    with pytest.raises(TypeError, match="Demonstrating"):
        OracleTeacher(object())


def test_hf_teacher_parses_the_engine_answer_and_counts_empty_ones():
    shown: list[list[dict[str, Any]]] = []

    def generate(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
        shown.append(messages)
        return {"role": "assistant", "content": "Listing.", "tool_calls": [LS_CALL]} if len(shown) == 1 else None

    teacher = HFTeacher(HfTeacherConfig(name="qwen", path="/models/qwen"), generate)
    assert teacher.act(STATE, None) == LS_ACTION
    assert shown[0] == chat_messages(STATE)
    assert teacher.act(STATE, None) is None
    assert teacher.stats == TeacherStats(calls=2, failures=1)


# --- replay -------------------------------------------------------------------------------


def test_replay_asks_every_teacher_and_one_failing_does_not_block_the_others(endpoint, client, tmp_path):
    def broken(messages: list[dict[str, Any]]) -> dict[str, Any]:
        raise RuntimeError("CUDA out of memory")

    task = CountdownTask()
    hf = HFTeacher(HfTeacherConfig(name="local", path="/models/broken"), broken)
    gpt = make_teacher(endpoint, client)
    oracle = OracleTeacher(task)
    cache = TeacherCache(tmp_path / "cache.jsonl")
    actions = replay_state([hf, gpt, oracle], cache, STATE, {"prompt": task.prompt("7")})
    assert list(actions) == ["local", "gpt", "oracle"]
    assert actions["local"] is None and actions["gpt"] == LS_ACTION
    assert actions["oracle"]["tool_calls"][0]["function"]["arguments"] == {"value": "7"}
    assert hf.stats == TeacherStats(calls=1, failures=1)
    assert len(cache) == 1  # the oracle's answers depend on the prompt: never cached

    replay_state([hf, gpt, oracle], cache, STATE, {"prompt": task.prompt("7")})
    assert (hf.stats.calls, gpt.stats.cache_hits, oracle.stats.calls) == (2, 1, 2)


def test_replay_refuses_teachers_sharing_a_name(endpoint, client):
    with pytest.raises(ValueError, match="distinct"):
        replay_state([make_teacher(endpoint, client), make_teacher(endpoint, client)], None, STATE)


def test_replay_without_a_cache_always_asks(endpoint, client):
    teacher = make_teacher(endpoint, client)
    replay_state([teacher], None, STATE)
    replay_state([teacher], None, STATE)
    assert len(endpoint.requests) == 2


def test_a_trace_state_replays_in_the_flat_form_trace_states_produce(endpoint, client):
    turn = Turn(role="assistant", content="x", tool_calls=[ToolCall(id="t", name="bash", arguments={"cmd": "ls"})])
    state = [Turn(role="user", content="go").model_dump(exclude_none=True), turn.model_dump(exclude_none=True)]
    assert replay_state([make_teacher(endpoint, client)], None, state) == {"gpt": LS_ACTION}
    sent = endpoint.requests[0]["body"]["messages"][1]["tool_calls"][0]["function"]
    assert sent == {"name": "bash", "arguments": '{"cmd": "ls"}'}


def test_replay_of_many_states_runs_up_to_the_bound_at_once_and_keeps_their_order(endpoint, client):
    bound, states = 3, [[{"role": "user", "content": f"state {i}"}] for i in range(9)]
    endpoint.default = "echo"
    endpoint.barrier = threading.Barrier(bound)  # a request answers only once `bound` are in flight
    # one request per answer, and none timed out while it waits: only concurrency fills the barrier
    teachers = [make_teacher(endpoint, client, name, max_retries=0, timeout_s=10.0) for name in "ab"]
    actions = replay_states(teachers, None, states, [None] * len(states), max_concurrent=bound)
    assert endpoint.max_in_flight == bound
    assert len(endpoint.requests) == 2 * len(states)
    assert [{name: a["content"] for name, a in row.items()} for row in actions] == [
        {"a": f"state {i}", "b": f"state {i}"} for i in range(len(states))
    ]
    assert [t.stats for t in teachers] == [TeacherStats(calls=len(states))] * 2


def test_replay_of_many_states_counts_and_caches_as_one_at_a_time_would(endpoint, client, tmp_path):
    def broken(messages: list[dict[str, Any]]) -> dict[str, Any]:
        raise RuntimeError("CUDA out of memory")

    gpt, hf = make_teacher(endpoint, client), HFTeacher(HfTeacherConfig(name="local", path="/m"), broken)
    cache = TeacherCache(tmp_path / "cache.jsonl")
    other = [{"role": "user", "content": "other"}]
    states = [STATE, STATE, other, STATE]  # a state repeated within the round is asked once
    actions = replay_states([hf, gpt], cache, states, [{}] * len(states), max_concurrent=4)
    assert [row["local"] for row in actions] == [None] * 4
    assert [row["gpt"] for row in actions] == [LS_ACTION] * 4
    assert len(endpoint.requests) == 2 and len(cache) == 2
    assert gpt.stats == TeacherStats(calls=2, cache_hits=2)
    assert hf.stats == TeacherStats(calls=4, failures=4)


def test_replay_of_many_states_needs_a_context_per_state(endpoint, client):
    with pytest.raises(ValueError, match="2 states but 1 contexts"):
        replay_states([make_teacher(endpoint, client)], None, [STATE, STATE], [None], max_concurrent=2)
