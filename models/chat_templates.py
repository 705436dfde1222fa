"""The chat templates meshrl ships (`models/templates/*.jinja`), one file each: the tiny model's
options, and the Hermes format a run renders with in place of a tokenizer's own template.

`model.renderer = "hermes"` gives a ChatML-family model whose template renders no tool calls
(SmolLM2-135M-Instruct) Qwen2.5's tool convention over its own `<|im_start|>`/`<|im_end|>` tokens.
The template text is passed wherever the run renders a conversation (`apply_chat_template(
chat_template=...)`), never set on a tokenizer in memory; checkpoints and exports save it as the
tokenizer's chat template, so the trained model's files speak the format it was trained in.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from transformers import PreTrainedTokenizerBase

TEMPLATES = Path(__file__).parent / "templates"
HERMES = "hermes"
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")  # the turn markers meshrl's Hermes template writes


@cache
def shipped(name: str) -> str:
    """The text of `templates/<name>.jinja`."""
    return (TEMPLATES / f"{name}.jinja").read_text()


def renderer_template(renderer: str) -> str | None:
    """The template a run with `model.renderer = renderer` renders in place of the tokenizer's:
    meshrl's Hermes for "hermes", else None (the tokenizer's own, or a `renderers` renderer's
    rendering). "auto" never resolves to "hermes", so the config's name decides it in every process."""
    return shipped(HERMES) if renderer == HERMES else None


def is_chatml(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer has ChatML's turn markers, each one token: meshrl's Hermes template
    writes them, and a model reads them as turns only as the tokens it was trained on."""
    vocab = tokenizer.get_vocab()
    return all(
        marker in vocab and tokenizer.encode(marker, add_special_tokens=False) == [vocab[marker]]
        for marker in CHATML_TOKENS
    )


def hermes_refusal(key: str, tokenizer: PreTrainedTokenizerBase) -> str:
    """Why `key = "hermes"` does not fit a tokenizer without ChatML's turn markers."""
    return (
        f"{key} 'hermes': meshrl's Hermes template writes ChatML turns, but the tokenizer of "
        f"{tokenizer.name_or_path or 'the model'} has no {' and '.join(CHATML_TOKENS)} as single tokens: "
        "use its own chat template ('template') or the `renderers` renderer of its family"
    )
