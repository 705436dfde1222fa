"""The ingress lane: a run's server for outside rollout workers, set up from the run's config.

Workers get the spec of what to run (task, sampling, chat format, limits, model files) and the
policy versions the weight publisher hands the server; every submission is verified against this
run's task and those versions before the rollout feed takes it as one more source of groups.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerBase

from meshrl.configs.schema import LoraConfig, RunConfig
from meshrl.inference.weights import save_weights_file
from meshrl.ingress.protocol import Spec
from meshrl.ingress.server import IngressServer, model_files
from meshrl.ingress.verify import Scorer, Verifier
from meshrl.rollouts.chat import ChatSettings
from meshrl.rollouts.episodes import EpisodeFormat, EpisodeLimits
from meshrl.tasks.base import make_task
from meshrl.trainer.lora import add_lora


def start_ingress(
    config: RunConfig, model_path: str, tokenizer: PreTrainedTokenizerBase, chat: ChatSettings, folder: Path
) -> IngressServer:
    """Listen for rollout workers (`ingress.bind`); the files served live in `folder`. A LoRA run
    serves its base model once (the scorer's copy, before its adapters) and each version's adapters."""
    g = config.generator
    limits = EpisodeLimits.of(config)
    spec = Spec(
        task_import_path=config.task.import_path, task_kwargs=config.task.kwargs, temperature=g.temperature,
        top_p=g.top_p, max_new_tokens=g.max_new_tokens, dtype=config.model.dtype,
        renderer=chat.renderer, tool_parser=chat.tool_parser,
        chat_template_kwargs=chat.template_kwargs, model_files=model_files(model_path),
        max_episode_tokens=limits.max_tokens, max_tool_result_tokens=limits.max_tool_tokens,
        context_policy=g.context_policy,
        lora=config.model.lora.model_dump() if config.model.lora is not None else None,
        vllm_log_level=g.vllm_log_level, record_routing=config.trainer.routing_replay is not False,
    )  # fmt: skip
    holder: list[IngressServer] = []  # the scorer reads the versions the server keeps
    scorer = Scorer(model_path, config.model.dtype, g.temperature, lambda v: holder[0].weights_path(v))
    verifier = Verifier(
        EpisodeFormat(tokenizer, make_task(config.task), chat, limits), scorer,
        max_new_tokens=g.max_new_tokens,
        fraction=config.ingress.verify_fraction, tolerance=config.ingress.verify_tolerance,
        routing_tolerance=config.ingress.routing_tolerance,
    )  # fmt: skip
    holder.append(IngressServer(config.ingress, spec, verifier))
    if config.model.lora is not None:
        serve_adapters(holder[0], config.model.lora, folder)
    print(f"ingress: listening on {holder[0].address}")
    return holder[0]


def serve_adapters(server: IngressServer, lora: LoraConfig, folder: Path) -> None:
    """A LoRA run's ingress: its scorer's model (the run's base model) is written once for the
    workers to fetch, then gets the adapters, which each published version then holds alone."""
    model = server.verifier.scorer.engine.model
    save_weights_file(model.state_dict(), folder / "base.safetensors")
    add_lora(model, lora).eval()
    server.publish_base(folder / "base.safetensors")
