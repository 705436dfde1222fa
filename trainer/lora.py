"""LoRA adapters on the policy through peft: injected into the HF model in place (its modules keep
their names), so the loss functions read the trunk and the head as they do without adapters.

The policy's weights as generators and checkpoints' `model/` need them are the merged ones (each
adapted layer's base weight plus its adapter's delta, under the model's own names); the adapters
alone are what trains and what a checkpoint resumes from (`adapter/`, peft's format). Everything
here reads full state dicts, so it serves a sharded model (FSDP2, gathered) as a whole one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from safetensors.torch import load_file
from torch import nn

from meshrl.configs.schema import LoraConfig, RunConfig

if TYPE_CHECKING:
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel

ADAPTER = "default"  # peft's name for a model's one adapter
# peft (the [lora] extra) is imported where adapters are made or read: runs without adapters need it not.


def lora_generators(config: RunConfig) -> bool:
    """Whether the generators hold the adapters themselves, so that a weight sync sends them alone:
    HF engines (injected like the trainer's model, `add_lora`). vLLM engines get the merged weights."""
    return config.model.lora is not None and config.generator.backend == "hf"


def add_lora(model: nn.Module, config: LoraConfig | PeftLoraConfig) -> PeftModel:
    """Adapters injected into `model` (which then holds them: train through `model` itself); the
    PeftModel returned turns them off (`disable_adapter()`) and saves them in peft's format. The
    adapters start as the identity (B = 0): an engine given them holds the base model until loaded.
    `config`: `model.lora`, or peft's own config of saved adapters (`adapter/`: it also holds what
    peft derived, such as fused experts as `target_parameters`)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    settings = config if isinstance(config, PeftLoraConfig) else PeftLoraConfig(
        r=config.r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
        target_modules=config.target_modules, task_type="CAUSAL_LM",
    )  # fmt: skip
    return get_peft_model(model, settings)


def adapter_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters' tensors of an adapted model's state dict, under its own names: what an engine
    with the same adapters injected (`add_lora`) loads."""
    return {key: value for key, value in state.items() if ".lora_" in key}


def plain_name(name: str) -> str:
    """A name in the adapted model as the plain model has it: every `base_layer` level peft added
    (nested when two adapters wrap one module, as on fused experts) left out."""
    return ".".join(part for part in name.split(".") if part != "base_layer")


@dataclass(frozen=True)
class AdaptedWeight:
    """One weight of the plain model that an adapter changes, where its A and B tensors are (the
    adapted model's names) and how peft computes its delta from them."""

    weight: str
    a: str
    b: str
    kind: Literal["linear", "embedding", "experts"]
    scaling: float
    fan_in_fan_out: bool = False
    experts: int = 1
    swapped: bool = False  # fused experts stored (experts, out, in) rather than (experts, in, out)

    def delta(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The weight's update, as peft's `get_delta_weight` computes it (in float32)."""
        a, b = a.float(), b.float()
        if self.kind == "experts" and self.experts > 1:
            a = a.reshape(self.experts, -1, a.shape[-1])  # experts x r x in
            b = b.reshape(b.shape[0], -1, self.experts)  # out x r x experts
            return torch.einsum("ore,eri->eoi" if self.swapped else "ore,eri->eio", b, a) * self.scaling
        delta = (b @ a) * self.scaling
        return delta.T if self.kind == "embedding" or self.fan_in_fan_out else delta


def adapted_weights(model: nn.Module) -> list[AdaptedWeight]:
    """Every weight the adapters injected into `model` change; refuses (naming them) the adapted
    modules whose merge is not known here, and a head or embedding tied to the other, whose merged
    weights could not stay tied: a run that trains them could not save, sync or export."""
    from peft.tuners.lora.layer import Embedding, Linear, LoraLayer, ParamWrapper

    plan, refused = [], []
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    ends = (model.get_output_embeddings(), model.get_input_embeddings())
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or ADAPTER not in module.scaling:
            continue
        plain, scaling = plain_name(name), float(module.scaling[ADAPTER])
        lora = f"{name}.lora_A.{ADAPTER}.weight", f"{name}.lora_B.{ADAPTER}.weight"
        if isinstance(module, ParamWrapper):
            plan.append(AdaptedWeight(f"{plain}.{module.parameter_name}", *lora, "experts", scaling,
                                      experts=module.num_experts, swapped=module._did_swap_in_out_features))  # fmt: skip
        elif isinstance(module, Embedding):
            a, b = f"{name}.lora_embedding_A.{ADAPTER}", f"{name}.lora_embedding_B.{ADAPTER}"
            plan.append(AdaptedWeight(f"{plain}.weight", a, b, "embedding", scaling))
        elif isinstance(module, Linear):
            plan.append(AdaptedWeight(f"{plain}.weight", *lora, "linear", scaling, module.fan_in_fan_out))
        else:
            refused.append(f"{plain} ({type(module).__name__})")
        if tied and any(own is end for own in (module, module.get_base_layer()) for end in ends):
            refused.append(f"{plain} (the head and the input embedding share one tensor in this model)")
    if refused:
        raise ValueError(f"model.lora.target_modules adapts modules whose merged weights meshrl cannot build: "
                         f"{', '.join(refused)}; leave them out of target_modules")  # fmt: skip
    return plan


def lora_plan(model_path: str, config: LoraConfig | PeftLoraConfig) -> list[AdaptedWeight]:
    """`adapted_weights` of the model at `model_path` with `config`'s adapters, built on the meta
    device (no weights read): the start-up check, and the merge plan of an engine that holds only
    the base weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
        add_lora(model, config)
    return adapted_weights(model)


def merged_state(state: dict[str, torch.Tensor], plan: list[AdaptedWeight]) -> dict[str, torch.Tensor]:
    """An adapted model's state dict as the plain model's: the plain names, each adapted weight
    merged with its adapter's delta (`merge_adapters`)."""
    base = {plain_name(key): value for key, value in state.items() if ".lora_" not in key}
    return merge_adapters(base, adapter_tensors(state), plan)


def merge_adapters(
    base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], plan: list[AdaptedWeight]
) -> dict[str, torch.Tensor]:
    """The base weights with each adapted weight merged: base + its delta from the adapters (under
    the adapted model's names, `adapter_tensors`). For an engine that cannot hold adapters itself
    (vLLM): the adapters travel, the base stays where it is."""
    merged = dict(base)
    for adapted in plan:
        weight = base[adapted.weight]
        delta = adapted.delta(adapters[adapted.a], adapters[adapted.b])
        merged[adapted.weight] = (weight.float() + delta).to(weight.dtype)
    return merged


def merged_reference(model_path: str, adapter_dir: Path, frozen: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA run's reference (the base with its frozen adapters, `FrozenAdapters.state`) as a plain
    model's full weights, for a resume with `model.lora` turned off: the base at `model_path` merged
    with them, planned from the checkpoint's own adapter config (`adapter_dir`)."""
    from peft import LoraConfig as PeftLoraConfig
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
    return merge_adapters(base, frozen, lora_plan(model_path, PeftLoraConfig.from_pretrained(adapter_dir)))


def peft_names(adapters: PeftModel, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters' tensors of the adapted model's state dict (`add_lora`'s model, its own names),
    named as peft saves them (`adapter_model.safetensors`)."""
    from peft import get_peft_model_state_dict

    prefixed = {f"base_model.model.{key}": value for key, value in adapter_tensors(state).items()}
    return get_peft_model_state_dict(adapters, state_dict=prefixed)


def saved_adapters(model: nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's adapters (`adapter/adapter_model.safetensors`, peft's names: the adapter's
    name left out) under the adapted `model`'s names, checked to be exactly the adapters
    `model.lora` made."""
    saved = load_file(directory / "adapter_model.safetensors")
    expected = set(adapter_tensors(model.state_dict()))
    ours = {f"base_model.model.{key.replace(f'.{ADAPTER}', '')}": key for key in expected}
    own = {ours.get(key, key): value for key, value in saved.items()}
    if set(own) != expected:
        raise ValueError(f"{directory}: the adapters do not fit model.lora (missing {sorted(expected - set(own))[:3]}, "
                         f"unexpected {sorted(set(own) - expected)[:3]})")  # fmt: skip
    return own
