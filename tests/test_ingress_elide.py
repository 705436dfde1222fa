"""An outside worker's episode that elided tool results (`generator.context_policy = "elide"`):
the protocol carries every context it was sampled in, and the verifier rebuilds them with the
run's own `EpisodeFormat`. An honest one is accepted as the contexts the mesh would train on;
a forged context, a context dropped or added, another elided set, an elision the budget did not
make or one it did that the worker skipped, and shifted logprobs in an earlier context are each
rejected. Unit level: the verifier and the protocol, no mesh and no sockets."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoTokenizer

from meshrl.configs.schema import TinyModelConfig
from meshrl.inference.completion import Completion
from meshrl.inference.hf_engine import HFEngine
from meshrl.inference.weights import save_weights_file
from meshrl.ingress.client import to_episode
from meshrl.ingress.protocol import MAX_CONTEXTS, Context, Episode, GroupResult, Spec
from meshrl.ingress.server import REQUESTS
from meshrl.ingress.verify import Rejected, Scorer, Verifier
from meshrl.ingress.worker import spec_limits
from meshrl.loss_adapters.logprobs import sequence_token_logprobs
from meshrl.models.tiny import ensure_tiny
from meshrl.rollouts.batches import rl_shards
from meshrl.rollouts.episodes import EpisodeFormat, EpisodeLimits, Rollout
from meshrl.tasks.base import Prompt, ToolResult
from meshrl.tasks.toy import ToolTask

MAX_NEW = 40
# Each lookup's tool turn is capped at 64 tokens and elides to ~20: a 320-token budget elides the
# first two results after the third lookup, the next two after the fourth, and the answer fits after.
LIMITS = EpisodeLimits(max_tokens=320, max_new_tokens=MAX_NEW, max_tool_tokens=64, elide=True)
LOOKUPS = 4


class FloodingToolTask(ToolTask):
    """The toy lookup task whose tool answers with a long log after the value (the cap keeps the value)."""

    def call_tool(self, prompt: Prompt, name: str, arguments: dict[str, Any]) -> ToolResult:
        result = super().call_tool(prompt, name, arguments)
        return ToolResult(result.content + "\n" + "log line " * 400, result.is_error)


@dataclass
class Setup:
    worker: EpisodeFormat  # the worker's episodes, under the limits the spec carries
    verifier: Verifier  # the controller's, with the run's limits
    policy: torch.nn.Module  # policy version 0
    prompt: Prompt  # as the controller holds it (with its answer)

    @property
    def leased(self) -> Prompt:
        return Prompt(self.prompt.prompt_id, self.prompt.messages, None, self.prompt.info)


def spec(context_policy: str) -> Spec:
    """A spec carrying `LIMITS` (the fields the episode limits come from; the rest unused here)."""
    return Spec(
        task_import_path="", task_kwargs={}, temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW, dtype="float32",
        renderer="template", tool_parser="hermes", chat_template_kwargs={}, model_files={},
        max_episode_tokens=LIMITS.max_tokens, max_tool_result_tokens=LIMITS.max_tool_tokens,
        context_policy=context_policy,
    )  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    root = tmp_path_factory.mktemp("ingress-elide")
    model = ensure_tiny(root / "model", TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2))
    engine = HFEngine.from_pretrained(str(model), dtype="float32")
    save_weights_file(engine.model.state_dict(), root / "step_0.safetensors")
    scorer = Scorer(str(model), "float32", 1.0, lambda v: root / "step_0.safetensors" if v == 0 else None)
    task, tokenizer = FloodingToolTask(n_keys=3, max_turns=8), AutoTokenizer.from_pretrained(str(model))
    verifier = Verifier(EpisodeFormat(tokenizer, task, limits=LIMITS), scorer, max_new_tokens=MAX_NEW,
                        fraction=1.0, tolerance=0.05)  # fmt: skip
    worker = EpisodeFormat(tokenizer, task, limits=spec_limits(spec("elide")))
    return Setup(worker, verifier, engine.model, task.sample_prompts(random.Random(0), 1)[0])


def forced(s: Setup, texts: list[str], episodes: EpisodeFormat | None = None) -> Rollout:
    """A worker's episode whose assistant turns are `texts`, each with the logprobs the policy gives
    it in the context it is sampled in (an honest worker forcing text), eliding as `episodes` (the
    worker's own by default) has the budget elide, and scored on the prompt as leased."""
    episodes = episodes or s.worker
    rollout = episodes.start(s.leased)
    for text in texts:
        ids = episodes.tokenizer(text + episodes.footer, add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            scored = sequence_token_logprobs(s.policy, torch.tensor([rollout.token_ids + ids]))[0, -len(ids) :]
        calls = episodes.add_turn(rollout, Completion([], ids, scored.tolist(), "stop", [0] * len(ids)))
        if calls:
            episodes.add_tool_results(rollout, calls, [episodes.call_tool(rollout, call) for call in calls])
        if not episodes.goes_on(rollout, calls):
            break
    episodes.end(rollout)
    episodes.score(rollout)
    return rollout


def lookups(s: Setup) -> list[str]:
    """`LOOKUPS` lookups of the asked key (the first with a word before it), then the right answer."""
    call = json.dumps({"name": "lookup", "arguments": {"key": s.prompt.info["key"]}})
    return (
        [f"I look it up.\n<tool_call>{call}</tool_call>"]
        + [f"<tool_call>{call}</tool_call>"] * (LOOKUPS - 1)
        + [s.prompt.answer]
    )


@pytest.fixture(scope="module")
def honest(setup) -> Rollout:
    rollout = forced(setup, lookups(setup))
    assert len(rollout.earlier) == 2 and rollout.stop_condition == "agent_completed", "the budget elided otherwise"
    return rollout


def wire(episode: Episode) -> Episode:
    """The episode as the controller parses it from a submit request."""
    payload = {"op": "submit", "groups": [GroupResult(lease_id="l", episodes=[episode]).model_dump()]}
    return REQUESTS.validate_json(json.dumps(payload)).groups[0].episodes[0]


def verdict(s: Setup, episode: Episode) -> str:
    """The verifier's verdict on the episode: accepted, or the reason it rejects it."""
    try:
        s.verifier.check_group(s.prompt, 1, 0, 0, [wire(episode)])
    except Rejected as exc:
        return exc.reason
    return "accepted"


def test_the_worker_runs_the_runs_context_policy():
    assert spec_limits(spec("elide")) == LIMITS
    assert not spec_limits(spec("cut")).elide and spec("cut").model_dump()["context_policy"] == "cut"


def test_an_honest_elided_episode_is_accepted_as_the_contexts_the_mesh_trains_on(setup, honest):
    """The verifier's rebuilt rollout holds the worker's contexts, token for token, with its logprobs,
    elided set and turns; it trains as one row per context, and every context's every sampled token
    was re-scored."""
    checked = setup.verifier.stats.checked_tokens
    (rebuilt,) = setup.verifier.check_group(setup.prompt, 1, 0, 0, [wire(to_episode(honest))])
    assert rebuilt.segments() == honest.segments() and len(rebuilt.earlier) == 2
    assert rebuilt.elided == honest.elided == {3, 5, 7}
    assert rebuilt.turn_ids == honest.turn_ids and rebuilt.versions == honest.versions
    assert rebuilt.reward == 1.0 and honest.reward == 0.4  # trained on the hidden answer, claimed without it
    assert all(max(i for i, m in enumerate(s.loss_mask) if m) < LIMITS.max_tokens for s in rebuilt.segments())
    assert len(rl_shards([rebuilt], [1.0], 4096, 0, 1).shards[0][0]["input_ids"]) == 3
    assert setup.verifier.stats.checked_tokens - checked == len(honest.versions)


def forge(honest: Rollout, how: str) -> Episode:
    """The honest episode with one context forged (its versions kept one per sampled token)."""
    episode = to_episode(honest)
    first, middle = episode.earlier
    if how == "earlier sampled id":  # the word before the first call, in the context it was sampled in alone
        first.token_ids[first.loss_mask.index(True) + 1] = first.token_ids[first.loss_mask.index(True) + 3]
    elif how == "earlier tool turn":  # one token of the first tool result, as the first context holds it
        first.token_ids[first.loss_mask.index(False, first.loss_mask.index(True)) + 8] += 1
    elif how == "context dropped":
        episode.earlier = [first]
    elif how == "context added":
        episode.earlier = [first, middle, Context(**episode.model_dump(include={"token_ids", "loss_mask", "logprobs"}))]
    elif how == "context repeated":
        episode.earlier = [first, first, middle]
    elif how == "elided set":
        episode.elided = episode.elided[:-1]
    elif how == "earlier logprobs":  # the first context's alone: the others' honest tokens must not dilute them
        first.logprobs = [lp - 0.5 if m else lp for lp, m in zip(first.logprobs, first.loss_mask)]
    episode.versions = [0] * sum(sum(c.loss_mask) for c in episode.contexts())  # one per sampled token, as checked
    return episode


@pytest.mark.parametrize(
    "how,reason",
    [
        ("earlier sampled id", "elision_mismatch"),  # the next context shows the turn as sampled
        ("earlier tool turn", "tool_mismatch"),
        ("context dropped", "elision_mismatch"),
        ("context added", "elision_mismatch"),
        ("context repeated", "elision_mismatch"),
        ("elided set", "elision_mismatch"),
        ("earlier logprobs", "logprob_mismatch"),
    ],
)
def test_a_forged_context_is_rejected(setup, honest, how, reason):
    assert verdict(setup, forge(honest, how)) == reason


@pytest.mark.parametrize(
    "budget,elide,turns,contexts",
    [(4096, False, 5, 1), (260, True, 4, 3), (280, True, 4, 2)],
    ids=["past-the-budget", "sooner", "more-results"],
)
def test_a_worker_elides_where_the_budget_does_and_only_that(setup, budget, elide, turns, contexts):
    """A worker that ignores the budget (one context past it), elides a turn before the budget makes
    it, or elides more results than it needs (a smaller budget) sends contexts the run's rule does not give."""
    episodes = EpisodeFormat(
        setup.worker.tokenizer, setup.worker.task, limits=EpisodeLimits(budget, MAX_NEW, 64, elide)
    )
    rollout = forced(setup, lookups(setup)[: turns - 1] + lookups(setup)[-1:], episodes)
    assert rollout.stop_condition == "agent_completed" and len(rollout.segments()) == contexts
    assert verdict(setup, to_episode(rollout)) == "elision_mismatch"


def test_contexts_are_bounded_before_they_are_replayed(setup, honest):
    """Counts and sizes: the protocol caps the earlier contexts and takes no negative index; the
    verifier takes no more contexts than the task has turns, nor a malformed or out-of-vocabulary one."""
    episode = to_episode(honest)
    with pytest.raises(ValidationError, match="at most 256"):
        wire(episode.model_copy(update={"earlier": episode.earlier * (MAX_CONTEXTS // 2 + 1)}))
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        wire(episode.model_copy(update={"elided": [-1]}))
    assert verdict(setup, episode.model_copy(update={"earlier": episode.earlier * 4})) == "bad_tokens"  # 9 > 8 turns
    cut = episode.model_copy(deep=True)
    cut.earlier[1].logprobs.pop()
    assert verdict(setup, cut) == "bad_tokens"
    foreign = episode.model_copy(deep=True)
    foreign.earlier[0].token_ids[0] = len(setup.worker.tokenizer)
    assert verdict(setup, foreign) == "bad_tokens"


def test_a_one_context_episode_reads_as_before(setup):
    """An episode that elided nothing sends no earlier contexts: the wire and the checks are as they were."""
    rollout = forced(setup, lookups(setup)[-1:])
    episode = to_episode(rollout)
    assert "earlier" not in episode.model_dump(exclude_defaults=True) and verdict(setup, episode) == "accepted"


def test_no_episode_is_elided_where_the_run_cuts(setup, honest):
    """With `context_policy = "cut"` on the controller, an elided episode is one the run would have ended."""
    cutting = Verifier(
        EpisodeFormat(setup.worker.tokenizer, setup.worker.task, limits=EpisodeLimits(320, MAX_NEW, 64)),
        setup.verifier.scorer, max_new_tokens=MAX_NEW, fraction=0.0, tolerance=0.05,
    )  # fmt: skip
    with pytest.raises(Rejected, match="elision_mismatch"):
        cutting.replay(setup.prompt, to_episode(honest), 0, 0)
