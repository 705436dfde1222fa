"""The messages between the controller's ingress and rollout workers.

Every request is one JSON frame, validated against these models before anything else looks at
it (unknown keys, wrong types and out-of-range numbers are malformed). Every reply is a JSON
`Reply` frame, followed by one raw frame for a weight chunk. Token ids, logprobs and messages
are what the worker claims; `ingress.verify` decides what of it is true.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

MAX_GROUPS = 64  # per lease or submit request
MAX_CONTEXTS = (
    256  # earlier contexts per episode; each holds a sampled turn, so the verifier bounds them by the task's max_turns
)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------- requests


class SpecRequest(Message):
    op: Literal["spec"]


class WeightsRequest(Message):
    """A chunk of a policy version's file; `base`: of the base model's (LoRA runs: a version's file
    holds the adapters alone, the base model is fetched once)."""

    op: Literal["weights"]
    version: int = Field(ge=0)
    offset: int = Field(0, ge=0)
    base: bool = False


class LeaseRequest(Message):
    """Up to n groups; n = 0 only asks for the newest policy version (a worker whose leases wait
    for a version not yet published polls with it)."""

    op: Literal["lease"]
    n: int = Field(ge=0, le=MAX_GROUPS)


class Context(Message):
    """A context an episode was sampled in (`rollouts.episodes.Segment`): its ids, which of them
    were sampled in it, and their logprobs."""

    token_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]  # the sampler's, 0 off the mask
    routing: str | None = None  # a mixture of experts' routed experts of its first ids (`models.routing.encode_record`)


class Episode(Context):
    """One sampled episode as the worker's `Rollout` holds it, plus the reward it claims: the task's
    reward on the prompt as leased (without the hidden answer, which the controller alone holds).
    Its own ids are the context it ended in; an episode that elided tool results
    (`generator.context_policy = "elide"`) also sends the contexts it left behind and which messages
    it elided, each of which the verifier rebuilds."""

    versions: list[int]  # one per sampled token, over every context in order
    messages: list[dict[str, Any]]  # as sampled and answered: none elided
    finish_reason: Literal["stop", "length"]
    reward: float
    earlier: list[Context] = Field(default_factory=list, max_length=MAX_CONTEXTS)  # oldest first
    elided: list[NonNegativeInt] = Field(default_factory=list)  # indices in `messages`, ascending

    def contexts(self) -> list[Context]:
        """Every context the episode was sampled in, oldest first: the earlier ones, then its own."""
        return [*self.earlier, self]


class GroupResult(Message):
    lease_id: str = Field(max_length=64)
    episodes: list[Episode]


class SubmitRequest(Message):
    op: Literal["submit"]
    groups: list[GroupResult] = Field(max_length=MAX_GROUPS)


Request = Annotated[SpecRequest | WeightsRequest | LeaseRequest | SubmitRequest, Field(discriminator="op")]


# --------------------------------------------------------------------------- replies


class Spec(Message):
    """What a worker needs to generate like a mesh generator: the task (imported on the worker),
    the sampling parameters, and the model's non-weight files (config, tokenizer, chat template)."""

    task_import_path: str
    task_kwargs: dict[str, Any]
    temperature: float
    top_p: float
    max_new_tokens: int
    dtype: str
    renderer: str  # resolved: "template", "hermes" or a `renderers` name
    tool_parser: str
    chat_template_kwargs: dict[str, Any]
    model_files: dict[str, str]  # file name -> base64 content
    max_episode_tokens: int  # an episode's token budget (`rollouts.episodes.EpisodeLimits`)
    max_tool_result_tokens: int  # a tool turn's
    context_policy: Literal["cut", "elide"] = "cut"  # generator.context_policy: an episode past its budget
    lora: dict[str, Any] | None = None  # model.lora's settings: versions are adapters on the base model
    vllm_log_level: Literal["debug", "info", "warning", "error", "critical"] = "warning"  # a vLLM worker's
    record_routing: bool = False  # a mixture of experts' episodes carry their routed experts (trainer.routing_replay)


class Lease(Message):
    """A group to sample: `samples` episodes of the prompt, starting on policy `min_version` or newer,
    submitted within `expires_in_s`. The prompt's answer is never sent."""

    lease_id: str
    prompt_id: str
    messages: list[dict[str, Any]]
    info: dict[str, Any]
    samples: int
    seed: int
    min_version: int
    expires_in_s: float


class WeightsChunk(Message):
    """Bytes [offset, offset + length) of the version's safetensors file (the next frame)."""

    version: int
    size: int
    sha256: str
    offset: int


Status = Literal["accepted", "rejected", "late", "duplicate"]


class Verdict(Message):
    lease_id: str
    status: Status
    reason: str = ""


class Reply(Message):
    """Every reply names the server's epoch (it changes when the controller restarts: earlier leases
    are void) and the newest policy version workers should run."""

    epoch: str
    version: int  # -1 until the first version is published
    error: str = ""
    refused: bool = False  # the error is final for this key (banned)
    spec: Spec | None = None
    chunk: WeightsChunk | None = None
    leases: list[Lease] = Field(default_factory=list)
    verdicts: list[Verdict] = Field(default_factory=list)
