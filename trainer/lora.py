"""LoRA adapters on the policy through peft: injected into the HF model in place (its modules keep
their names), so the loss functions read the trunk and the head as they do without adapters.

The policy's weights as generators and checkpoints' `model/` need them are the merged ones (each
adapted layer's base weight plus its adapter's delta, under the model's own names); the adapters
alone are what trains and what a checkpoint resumes from (`adapter/`, peft's format). Everything
here reads full state dicts, so it serves a sharded model (FSDP2, gathered) as a whole one.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file
from torch import nn

from meshrl.configs.schema import LoraConfig, RunConfig

if TYPE_CHECKING:
    from peft import PeftModel

ADAPTER = "default"  # peft's name for a model's one adapter
# peft (the [lora] extra) is imported where adapters are made or read: runs without adapters need it not.


def lora_generators(config: RunConfig) -> bool:
    """Whether the generators hold the adapters themselves, so that a weight sync sends them alone:
    HF engines (injected like the trainer's model, `add_lora`). vLLM engines get the merged weights."""
    return config.model.lora is not None and config.generator.backend == "hf"


def add_lora(model: nn.Module, config: LoraConfig) -> PeftModel:
    """Adapters injected into `model` (which then holds them: train through `model` itself); the
    PeftModel returned turns them off (`disable_adapter()`) and saves them in peft's format. The
    adapters start as the identity (B = 0): an engine given them holds the base model until loaded."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    settings = PeftLoraConfig(
        r=config.r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
        target_modules=config.target_modules, task_type="CAUSAL_LM",
    )  # fmt: skip
    return get_peft_model(model, settings)


def adapter_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters' tensors of an adapted model's state dict, under its own names: what an engine
    with the same adapters injected (`add_lora`) loads."""
    return {key: value for key, value in state.items() if ".lora_" in key}


def merged_state(state: dict[str, torch.Tensor], config: LoraConfig) -> dict[str, torch.Tensor]:
    """An adapted model's state dict as the plain model's: the base model's names, each adapted
    layer's weight merged with its adapter's delta (`merge_adapters`)."""
    base = {key.replace(".base_layer.", "."): value for key, value in state.items() if ".lora_" not in key}
    return merge_adapters(base, adapter_tensors(state), config)


def merge_adapters(
    base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], config: LoraConfig
) -> dict[str, torch.Tensor]:
    """The base weights with each adapted layer's merged: its base weight plus lora_alpha / r × B A
    from adapters under the adapted model's names (`adapter_tensors`). For an engine that cannot
    hold adapters itself (vLLM): the adapters travel, the base stays where it is."""
    suffix = f".lora_A.{ADAPTER}.weight"
    merged = dict(base)
    for key, a in adapters.items():
        if not key.endswith(suffix):
            continue
        prefix = key[: -len(suffix)]
        b = adapters[f"{prefix}.lora_B.{ADAPTER}.weight"]
        weight = base[f"{prefix}.weight"]
        delta = (config.lora_alpha / config.r) * (b.float() @ a.float())
        merged[f"{prefix}.weight"] = (weight.float() + delta).to(weight.dtype)
    return merged


def peft_names(adapters: PeftModel, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters' tensors of the adapted model's state dict (`add_lora`'s model, its own names),
    named as peft saves them (`adapter_model.safetensors`)."""
    from peft import get_peft_model_state_dict

    prefixed = {f"base_model.model.{key}": value for key, value in adapter_tensors(state).items()}
    return get_peft_model_state_dict(adapters, state_dict=prefixed)


def saved_adapters(model: nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's adapters (`adapter/adapter_model.safetensors`, peft's names) under the adapted
    `model`'s names, checked to be exactly the adapters `model.lora` made."""
    saved = load_file(directory / "adapter_model.safetensors")
    own = {f"{key.removeprefix('base_model.model.').removesuffix('.weight')}.{ADAPTER}.weight": value
           for key, value in saved.items()}  # fmt: skip
    expected = set(adapter_tensors(model.state_dict()))
    if set(own) != expected:
        raise ValueError(f"{directory}: the adapters do not fit model.lora (missing {sorted(expected - set(own))[:3]}, "
                         f"unexpected {sorted(set(own) - expected)[:3]})")  # fmt: skip
    return own
