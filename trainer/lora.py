"""LoRA adapters on the policy through peft: injected into the HF model in place (its modules keep
their names), so the loss functions read the trunk and the head as they do without adapters.

The policy's weights as generators and checkpoints' `model/` need them are the merged ones (each
adapted layer's base weight plus its adapter's delta, under the model's own names); the adapters
alone are what trains and what a checkpoint resumes from (`adapter/`, peft's format).
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


def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapted model's weights under the base model's names, each adapted layer's weight
    merged with its adapter's delta (the model is left as it is)."""
    weights = {key.replace(".base_layer.", "."): value.detach() for key, value in model.state_dict().items()
               if ".lora_" not in key}  # fmt: skip
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
                key = f"{name}.weight"
                weights[key] = weights[key] + module.get_delta_weight(ADAPTER).to(weights[key].dtype)
    return weights


def engine_adapter_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors under the names `model` holds them by: what an engine with the same
    adapters injected (`add_lora`) loads, where peft's saved names (`adapter_weights`) differ."""
    return {key: value.detach() for key, value in model.state_dict().items() if ".lora_" in key}


def merge_adapters(
    base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], config: LoraConfig
) -> dict[str, torch.Tensor]:
    """The adapted layers' weights merged on the receiving side: each base weight plus
    lora_alpha / r × B A from engine-named adapters (`engine_adapter_weights`). For an engine
    that cannot hold adapters itself (vLLM): the adapters travel, the base stays where it is."""
    suffix = f".lora_A.{ADAPTER}.weight"
    merged = {}
    for key, a in adapters.items():
        if not key.endswith(suffix):
            continue
        prefix = key[: -len(suffix)]
        b = adapters[f"{prefix}.lora_B.{ADAPTER}.weight"]
        weight = base[f"{prefix}.weight"]
        delta = (config.lora_alpha / config.r) * (b.float() @ a.float())
        merged[f"{prefix}.weight"] = (weight.float() + delta).to(weight.dtype)
    return merged


def adapter_weights(adapters: PeftModel) -> dict[str, torch.Tensor]:
    """The adapters' tensors, as peft saves them."""
    from peft import get_peft_model_state_dict

    return {key: value.detach() for key, value in get_peft_model_state_dict(adapters).items()}


def load_adapters(adapters: PeftModel, directory: Path) -> None:
    """The adapter weights a checkpoint saved (`adapter/adapter_model.safetensors`), loaded in place."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(adapters, load_file(directory / "adapter_model.safetensors"))
    missing = [key for key in result.missing_keys if ".lora_" in key]
    if missing or result.unexpected_keys:
        raise ValueError(f"{directory}: the adapters do not fit model.lora (missing {missing[:3]}, "
                         f"unexpected {list(result.unexpected_keys)[:3]})")  # fmt: skip
