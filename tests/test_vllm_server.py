"""The OpenAI-compatible teacher against real vLLM servers (the CPU build, on loopback, started
here): one started with tool calling on, one without it.

The served model is a tiny Qwen-shaped model that memorised the Qwen2.5 family's tool episode
(tests/test_chat_families.py), so greedy decoding answers the episode's prompt with its first
tool call in Hermes form, which the server's parser turns into native `tool_calls`."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e import free_address

from meshrl.configs.schema import OpenAITeacher as OpenAITeacherConfig
from meshrl.configs.schema import TinyModelConfig
from meshrl.rollouts.episodes import EpisodeFormat
from meshrl.teachers.openai_compat import OpenAITeacher
from meshrl.teachers.replay import task_tools
from tests.test_chat_families import FAMILIES, PROMPT, TASK, family_tokenizer, memorised, scripted

pytestmark = [pytest.mark.network, pytest.mark.mesh]
TOOL_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


def _serve(model: Path, flags: list[str], log: Path) -> tuple[str, subprocess.Popen]:
    """`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script needs the GPU
    package's metadata) on a free loopback port; returns its base URL."""
    address = free_address("http")
    port = address.rsplit(":", 1)[1]
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", port, "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
            "--kv-cache-memory-bytes", str(64 << 20), *flags]  # fmt: skip
    return f"{address}/v1", subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait_up(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url.removesuffix("/v1") + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[tuple[str, str, str]]:
    """(model name, URL with tool calling, URL without), both started at once."""
    root = tmp_path_factory.mktemp("vllm_server")
    family = FAMILIES["qwen2.5"]
    tok = family_tokenizer(family)
    spec = TinyModelConfig(family="qwen3", hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=1)
    model = memorised(tok, scripted(EpisodeFormat(tok, TASK, family.settings), family), root / "model", spec)
    started = [(_serve(model, flags, root / f"{name}.log"), root / f"{name}.log")
               for name, flags in (("tools", TOOL_FLAGS), ("plain", []))]  # fmt: skip
    try:
        for (url, proc), log in started:
            _wait_up(url, proc, log)
        yield str(model), started[0][0][0], started[1][0][0]
    finally:
        for (_, proc), _ in started:
            proc.terminate()
            proc.wait(timeout=30)


def _teacher(model: str, url: str) -> OpenAITeacher:
    cfg = OpenAITeacherConfig(name="vllm", base_url=url, model=model, timeout_s=60, max_retries=0)
    return OpenAITeacher(cfg, tools=task_tools(TASK))


def test_a_teacher_sends_the_tools_and_reads_the_servers_native_tool_call(servers):
    model, with_tools, _ = servers
    teacher = _teacher(model, with_tools)
    teacher.check_tools()
    action = teacher.act(PROMPT.messages, None)
    assert action is not None and [call["function"] for call in action["tool_calls"]] == [
        {"name": "poll", "arguments": {"ticket": "zz"}}
    ]
    assert teacher.stats.calls == 1 and teacher.stats.failures == 0


def test_a_server_that_cannot_take_tools_is_refused_at_start_up_with_the_flags_to_add(servers):
    model, _, without_tools = servers
    teacher = _teacher(model, without_tools)
    with pytest.raises(
        ValueError, match="refuses requests with tools .*--enable-auto-tool-choice and the --tool-call-parser"
    ):
        teacher.check_tools()
    assert teacher.stats.failures == 0
    plain = OpenAITeacher(teacher.cfg)  # a task without tools: that server answers it
    plain.check_tools()
    assert plain.act(PROMPT.messages, None) is not None and plain.stats.failures == 0
