"""How an episode's messages and sampled ids convert under the policy's chat format.

Two paths, chosen once per run (`model.renderer`):

- a `renderers` renderer (Prime Intellect's message <-> token package, one object per template
  family): it parses a completion into content, reasoning and tool calls, and extends a rollout by
  a tool turn's tokens without re-rendering what was sampled (`bridge_to_next_turn`), so it serves
  templates that are not prefix-preserving (Qwen3 renders reasoning only after the last user query);
- the model's own chat template, with meshrl's tool-call parsers, for the families `renderers`
  lacks: accepted only when it renders a tool cycle as an extension of the conversation, checked
  on a probe at start-up, so a template that is not prefix-preserving is refused before any
  rollout, never mid-run;
- "hermes": the template path with meshrl's Hermes template (`models/templates/hermes.jinja`) in
  place of the model's own, over the tokenizer's ChatML tokens, for ChatML-family models whose
  template renders no tool calls (SmolLM2-135M-Instruct): the template text is passed to every
  rendering, the tokenizer is left as loaded.

Either way a rollout's ids are the exact sampled ids plus the scaffolding between turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import renderers
from jinja2 import TemplateError
from renderers import ToolCallParseStatus
from renderers.base import MODEL_RENDERER_MAP
from transformers import PreTrainedTokenizerBase

from meshrl.configs.schema import ModelConfig
from meshrl.inference.toolcalls import decode_turn, split_reasoning, tool_call
from meshrl.models.chat_templates import HERMES, hermes_refusal, is_chatml, renderer_template
from meshrl.traces.collator import TraceCollator

TEMPLATE = "template"
_PROBE_TOOL = "meshrl_probe"


@dataclass(frozen=True)
class ChatSettings:
    """A run's chat format, resolved: `renderer` is "template", "hermes" or a `renderers` name."""

    renderer: str = TEMPLATE
    tool_parser: str = "hermes"  # the template path's tool-call form
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. enable_thinking

    @classmethod
    def of(cls, model: ModelConfig) -> ChatSettings:
        """`model.renderer = "auto"`: the renderer `renderers` maps `model.path` (a hub id) to, else
        the template. Resolved from the config, not from a tokenizer's name, so every process of a
        run (and `meshrl eval` on a checkpoint directory) resolves it alike. "hermes" reads its own
        form: `model.tool_parser` is for the model's template."""
        renderer = model.renderer
        if renderer == "auto":
            renderer = MODEL_RENDERER_MAP.get(model.path, TEMPLATE)
        parser = "hermes" if renderer == HERMES else model.tool_parser
        return cls(renderer, parser, dict(model.chat_template_kwargs))

    @property
    def chat_template(self) -> str | None:
        """The template text rendered in place of the tokenizer's own (None: its own)."""
        return renderer_template(self.renderer)


def _assistant(content: str, reasoning: str | None, calls: list[dict[str, Any]]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


_PROBE_RESULT = {"role": "tool", "content": "probe result", "tool_call_id": "call_0"}


def _probe_turn(tool_name: str, reasoning: str | None = None) -> dict[str, Any]:
    call = {"id": "call_0", "type": "function", "function": {"name": tool_name, "arguments": {"x": 1}}}
    return _assistant("", reasoning, [call])


class RendererChat:
    """A `renderers` renderer, built to extend a sampled turn by what follows it and never re-render
    it (thinking retention "all"): what the policy samples is what it sees next, reasoning and all.
    Within an episode only tool turns follow a sampled turn; SDPO's hinted teacher also sees a hint
    after them, and a re-render there would drop the earlier turns' reasoning (Qwen3 keeps reasoning
    only after the last user message), so the teacher would reason less than the student did."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, settings: ChatSettings,
                 tools: list[dict[str, Any]] | None) -> None:  # fmt: skip
        config = renderers.config_from_name(settings.renderer).model_copy(update={"thinking_retention": "all"})
        try:
            self.renderer = renderers.create_renderer(tokenizer, config, chat_template_kwargs=settings.template_kwargs)
        except (AssertionError, ValueError) as error:  # renderers asserts its special tokens exist
            kwargs = f" with model.chat_template_kwargs {settings.template_kwargs}" if settings.template_kwargs else ""
            raise ValueError(
                f"model.renderer {settings.renderer!r}{kwargs} does not fit this tokenizer: {error}"
            ) from error
        self.tokenizer, self.name, self.tools = tokenizer, settings.renderer, tools
        self.stop_ids = list(self.renderer.get_stop_token_ids())

    def check(self, tool_name: str) -> None:
        """Refuse a renderer that cannot extend a probe turn by a tool result (one that always
        re-renders), or whose rendered answers do not parse back: the first tool turn or the first
        replay pair of a run would fail. The probe turn is plain text, or reasoning closed before
        it where the prompt opens a think block (DeepSeek-R1)."""
        opening = [{"role": "user", "content": "probe"}]
        prompt = self.prompt_ids(opening)
        answer = self.parse(prompt, self.reply_ids(opening, {"role": "assistant", "content": "probe answer"}))
        if answer["content"] != "probe answer" or answer.get("reasoning_content"):
            raise ValueError(f"model.renderer {self.name!r} renders an answer that parses back as {answer}")
        for text in ("probe", "probe reasoning\n</think>\n\nprobe"):
            completion = [*self.tokenizer.encode(text, add_special_tokens=False), self.stop_ids[0]]
            try:
                self.tool_turn_ids(prompt, completion, [], [_PROBE_RESULT])
                return
            except ValueError:
                continue
        raise ValueError(f"model.renderer {self.name!r} cannot extend a turn by its tool results without re-rendering")

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return list(self.renderer.render_ids(messages, tools=self.tools, add_generation_prompt=True))

    def parse(self, prompt_ids: list[int], completion_ids: list[int]) -> dict[str, Any]:
        parsed = self.renderer.parse_response(completion_ids, tools=self.tools, prompt_ids=prompt_ids)
        readable = (ToolCallParseStatus.OK, ToolCallParseStatus.UNKNOWN_TOOL)  # an unknown tool is the task's to answer
        calls = [
            tool_call(i, {"name": c.name, "arguments": c.arguments} if c.status in readable else None)
            for i, c in enumerate(parsed.tool_calls)
        ]
        content, reasoning = parsed.content, parsed.reasoning_content or None
        if reasoning is None and "</think>" in content:  # a think block opened where the parser did not look
            # (DeepSeek-R1's prompt after tool outputs opens one without an assistant header)
            reasoning, content = split_reasoning(content, opened=True)
        return _assistant(content, reasoning, calls)

    def reply_ids(self, messages: list[dict[str, Any]], action: dict[str, Any]) -> list[int]:
        """`action` (a teacher's answer) as the policy would sample it after `prompt_ids(messages)`,
        through its stop id: the renderer's rendering of it, after the prompt. A prompt that opens
        a think block the rendered answer lacks (DeepSeek-R1 prefills `<think>`) has it closed
        empty first, as Qwen3 renders an answer without reasoning."""
        prompt = self.prompt_ids(messages)
        full = list(self.renderer.render_ids([*messages, action], tools=self.tools))
        shared = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
        opened = self.tokenizer.decode(prompt[shared:])
        if opened.strip() == "<think>":
            reply = self.tokenizer.encode("\n</think>\n\n" if opened.endswith("\n") else "</think>\n\n",
                                          add_special_tokens=False) + full[shared:]  # fmt: skip
        elif not opened:
            reply = full[shared:]
        else:
            raise ValueError(f"renderer {self.name!r} renders an answer that does not continue its prompt {opened!r}")
        ends = [i for i, t in enumerate(reply) if t in self.stop_ids]
        return reply[: ends[-1] + 1] if ends else [*reply, self.stop_ids[0]]

    def tool_turn_ids(self, prompt_ids: list[int], completion_ids: list[int],
                      messages: list[dict[str, Any]], tool_messages: list[dict[str, Any]]) -> list[int]:  # fmt: skip
        bridged = self.renderer.bridge_to_next_turn(prompt_ids, completion_ids, tool_messages, tools=self.tools)
        before = len(prompt_ids) + len(completion_ids)
        if bridged is None or bridged.token_ids[:before] != [*prompt_ids, *completion_ids]:
            raise ValueError(f"renderer {self.name!r} cannot extend this episode by its tool turn without re-rendering")
        return list(bridged.token_ids[before:])


class TemplateChat:
    """A chat template (the tokenizer's own, or meshrl's Hermes for `renderer = "hermes"`) and
    meshrl's tool-call parser `settings.tool_parser`."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, settings: ChatSettings,
                 tools: list[dict[str, Any]] | None) -> None:  # fmt: skip
        if settings.renderer == HERMES and not is_chatml(tokenizer):
            raise ValueError(hermes_refusal("model.renderer", tokenizer))
        self.tokenizer, self.tool_parser, self.renderer = tokenizer, settings.tool_parser, settings.renderer
        self.collator = TraceCollator(tokenizer, tools=tools, template_kwargs=settings.template_kwargs,
                                      chat_template=settings.chat_template)  # fmt: skip
        try:
            self.footer = self.collator.footer  # the end-of-turn marker the engine stops on
        except ValueError:
            raise _refusal(tokenizer, "its generation prompt is not where its rendered replies start",
                           settings.renderer) from None  # fmt: skip
        self.stop_ids = [tokenizer.convert_tokens_to_ids(self.footer)] if self.footer else []

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return self._ids(self.collator.render(messages, generation_prompt=True))

    def parse(self, prompt_ids: list[int], completion_ids: list[int]) -> dict[str, Any]:
        """The content stays as sampled, think block and all: this template renders it back to the
        sampled text (it is prefix-preserving), and drops `reasoning_content`, which is only a copy
        for rubrics."""
        content, calls = decode_turn(self.tokenizer, completion_ids, self.tool_parser)
        return _assistant(content, split_reasoning(content)[0], calls)

    def reply_ids(self, messages: list[dict[str, Any]], action: dict[str, Any]) -> list[int]:
        return self.collator.template_reply_ids(messages, action).tolist()

    def tool_turn_ids(self, prompt_ids: list[int], completion_ids: list[int],
                      messages: list[dict[str, Any]], tool_messages: list[dict[str, Any]]) -> list[int]:  # fmt: skip
        before = self.collator.render(messages)
        after = self.collator.render(messages + tool_messages, generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("the chat template does not render tool turns as an extension of the conversation")
        tail = before[before.rfind(self.footer) + len(self.footer) :] if self.footer else ""
        return self._ids(tail + after[len(before) :])

    def check(self, tool_name: str) -> None:
        """Refuse a template that drops tool calls (when the task declares tools), or re-renders an
        assistant turn once a tool result follows it, with reasoning or without (Qwen3 adds an
        empty think block to the last turn only): the first such turn of a run would fail."""
        opening = [{"role": "user", "content": "probe"}]
        if self.collator.tools and tool_name not in self.collator.render([*opening, _probe_turn(tool_name)]):
            hint = "use a model whose template renders tools"
            if is_chatml(self.tokenizer):  # meshrl's Hermes template writes its turns
                hint = "set model.renderer = 'hermes' (meshrl's Hermes tool format over its ChatML tokens), or " + hint
            raise ValueError(
                f"model.renderer {self.renderer!r}: the chat template of {self.tokenizer.name_or_path or 'the tokenizer'} "
                "renders no tool calls of assistant turns, so the task's tool calls would vanish from every "
                f"rendered turn (the teachers' chosen answers among them): {hint}"
            )
        for reasoning in (None, "probe reasoning"):
            turn = "an assistant tool-call turn " + ("with" if reasoning else "without") + " reasoning"
            try:
                self.tool_turn_ids([], [], [*opening, _probe_turn(tool_name, reasoning)], [_PROBE_RESULT])
                continue
            except ValueError:
                reason = f"it is not prefix-preserving: {turn} renders differently once its tool result follows"
            except TemplateError as error:
                reason = f"it fails to render {turn} and its tool result ({error})"
            raise _refusal(self.tokenizer, reason, self.renderer)


def _refusal(tokenizer: PreTrainedTokenizerBase, reason: str, renderer: str = TEMPLATE) -> ValueError:
    return ValueError(
        f"model.renderer {renderer!r}: the chat template of {tokenizer.name_or_path or 'the tokenizer'} cannot "
        f"carry a multi-turn tool episode: {reason}. Set model.renderer to the `renderers` renderer of its "
        f"family ({', '.join(sorted(set(MODEL_RENDERER_MAP.values())))}), or use a template that renders "
        "conversations prefix by prefix"
    )


def make_chat(tokenizer: PreTrainedTokenizerBase, settings: ChatSettings,
              tools: list[dict[str, Any]] | None) -> RendererChat | TemplateChat:  # fmt: skip
    """The run's chat format; a template that would fail mid-run is refused here."""
    chat = (
        TemplateChat(tokenizer, settings, tools)
        if settings.renderer in (TEMPLATE, HERMES)
        else RendererChat(tokenizer, settings, tools)
    )
    chat.check(tools[0]["function"]["name"] if tools else _PROBE_TOOL)
    return chat
