"""meshrl's tiny model and tokenizer, built and saved locally so nothing is downloaded.

The tokenizer is a byte-level BPE (any text encodes) trained on a small built-in corpus,
with ChatML-style special tokens and a chat template that renders tool calls and tool
results. The model is a small Llama, Qwen2 or Qwen3 (optionally with grouped-query attention
and tied embeddings, the shapes real checkpoints have). Both are saved in HF format and loaded
back through the same `from_pretrained` path a real model takes.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from meshrl.configs.schema import TinyModelConfig
from meshrl.models.chat_templates import shipped
from meshrl.models.saved import ensure_model_dir

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
}

SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML with tool calls as <tool_call>{json}</tool_call> lines and tool results as a `tool` role.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] %}{{ message['content'] }}{% endif -%}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{ '\\n<tool_call>' }}{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "{{ '</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)

# The shipped templates (models/chat_templates.py): hermes, the Hermes tool convention Qwen2.5 ships
# (tool schemas in the system turn, each call a <tool_call> block of its own lines, the results of
# consecutive tool messages as <tool_response> blocks inside one user turn), which
# `model.renderer = "hermes"` renders with too; qwen3, Qwen3's template as its checkpoints ship it
# (thinking, Hermes tools; not prefix-preserving, so a run with it takes the `renderers` qwen3 renderer).
CHAT_TEMPLATES = {"chatml": CHATML_TEMPLATE, "hermes": shipped("hermes"), "qwen3": shipped("qwen3")}
# Whole tokens of each template's tool scaffolding (kept by decode(skip_special_tokens=True)).
TOOL_TOKENS = {
    "chatml": ["<tool_call>", "</tool_call>"],
    "hermes": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
    "qwen3": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"],
}

_WORDS = (
    "the a an to of and in is it that for on with as this be are was you not or by from at have but can all "
    "file files error errors command run test tests python bash read write edit path line lines import def "
    "class return self print if else elif for while try except raise with open json list dict str int "
    "true false none null user assistant system tool call result output input value key name args "
    "cd ls cat grep git diff commit push pip install make pytest src main py txt md toml yaml "
    "not found no such directory permission denied syntax connection refused timeout fix fixed "
    "hint try again instead use check first let me now will should could would done ok yes"
).split()


_TOOLS = ["lookup", "bash", "read", "edit", "search"]
_ARGS = ["key", "path", "cmd", "query"]


def _corpus(lines: int = 4000) -> list[str]:
    """A deterministic mix of words, code-ish punctuation, numbers, and the chat and tool-call
    scaffolding the template writes, so that scaffolding costs a few tokens, as it does in
    real tokenizers' vocabularies."""
    out, punct = [], [".", ",", ":", "(", ")", "[", "]", "{", "}", "=", "/", "_", "-", '"', "'", "\n", "  "]
    for i in range(lines):
        words = [_WORDS[(i * 7 + j * 13) % len(_WORDS)] for j in range(3 + i % 9)]
        words.insert(i % len(words), punct[i % len(punct)])
        out.append(" ".join(words) + f" {i % 97}")
        tool, arg, word = _TOOLS[i % len(_TOOLS)], _ARGS[i % len(_ARGS)], _WORDS[i % len(_WORDS)]
        out.append(f'\n<tool_call>{{"name": "{tool}", "arguments": {{"{arg}": "{word}"}}}}</tool_call>')
        out.append(f'error: no such {arg} "{word}"; {arg}s: "{word}", "{_WORDS[(i + 1) % len(_WORDS)]}"')
    return out


def build_tokenizer(vocab_size: int, chat_template: str = "chatml") -> PreTrainedTokenizerFast:
    """Train the byte-level BPE and wrap it as an HF fast tokenizer with the chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens(TOOL_TOKENS[chat_template])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATES[chat_template],
    )


def build_model(spec: TinyModelConfig, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised causal LM of `spec.family` (Llama, Qwen2, Qwen3, Qwen3-MoE), optionally
    with grouped-query attention and tied embeddings, as real checkpoints have them."""
    import torch

    torch.manual_seed(seed)
    config_class, model_class = FAMILIES[spec.family]
    experts = {}
    if spec.family == "qwen3_moe":  # Qwen3-MoE's shape: every layer sparse, top-k weights renormalised
        experts = {"num_experts": spec.num_experts, "num_experts_per_tok": spec.experts_per_token,
                   "moe_intermediate_size": spec.hidden_size * 2, "decoder_sparse_step": 1, "norm_topk_prob": True}  # fmt: skip
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.hidden_size * 4,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads or spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **experts,
    )
    return model_class(config)


def ensure_tiny(directory: str | Path, spec: TinyModelConfig | None = None, seed: int = 0) -> Path:
    """Build and save the tiny model + tokenizer at `directory` unless a complete copy is there."""
    spec = spec or TinyModelConfig()

    def build(tmp: Path) -> None:
        tokenizer = build_tokenizer(spec.vocab_size, spec.chat_template)
        tokenizer.save_pretrained(tmp)
        build_model(spec, tokenizer, seed).save_pretrained(tmp)

    return ensure_model_dir(directory, build)


def load_tokenizer(directory: str | Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(str(directory))
