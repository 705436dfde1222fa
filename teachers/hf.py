"""A local HF model as a teacher, answering greedily through its own chat template."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from transformers import AutoTokenizer

from meshrl.configs.schema import HfTeacher as HfTeacherConfig
from meshrl.inference.hf_engine import HFEngine
from meshrl.inference.toolcalls import decode_turn
from meshrl.models.chat_templates import HERMES, hermes_refusal, is_chatml, renderer_template
from meshrl.teachers.base import Message, TeacherStats, chat_messages, parse_action

log = logging.getLogger(__name__)


class HFTeacher:
    """A local HF model; `generate_fn(messages) -> assistant message | None` is the engine the
    teacher actor hosts. Exceptions from it are left to replay. It answers one state at a time,
    however many replay asks at once: concurrent generations on one model would only compete
    for its device and memory."""

    def __init__(self, cfg: HfTeacherConfig, generate_fn: Callable[[list[Message]], Message | None]) -> None:
        self.name = cfg.name
        self.identity = f"hf:{cfg.path}"
        self.stats = TeacherStats()
        self._generate = generate_fn
        self._lock = threading.Lock()

    def act(self, state_messages: list[Message], context: dict[str, Any] | None = None) -> Message | None:
        self.stats.add(calls=1)
        try:
            with self._lock:
                answer = self._generate(chat_messages(state_messages))
            return parse_action(answer)
        except ValueError as error:
            log.warning("teacher %s: unusable answer (%s)", self.name, error)
            self.stats.add(failures=1)
            return None


def hf_generate_fn(
    path: str,
    device: str = "cpu",
    max_new_tokens: int = 128,
    *,
    tools: list[dict[str, Any]] | None = None,
    tool_parser: str = "hermes",
    renderer: str = "template",
) -> Callable[[list[Message]], Message | None]:
    """Greedy next assistant turn, at most `max_new_tokens` (a run's teachers: the policy's own turn
    budget, `generator.max_new_tokens`), from a local HF model through its own chat template (with
    the task's tool schemas) and tool-call form, or through meshrl's Hermes template (`renderer =
    "hermes"`, as a policy of its family renders with `model.renderer = "hermes"`)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    if renderer == HERMES and not is_chatml(tokenizer):
        raise ValueError(hermes_refusal(f"teacher {path!r}: renderer", tokenizer))
    template, tool_parser = renderer_template(renderer), "hermes" if renderer == HERMES else tool_parser
    engine = HFEngine.from_pretrained(path, device=device)

    def generate(messages: list[Message]) -> Message | None:
        ids = tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=template, add_generation_prompt=True, return_dict=False
        )
        (completion,) = engine.generate([list(ids)], temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens)
        content, calls = decode_turn(tokenizer, completion.completion_ids, tool_parser)
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}

    return generate
