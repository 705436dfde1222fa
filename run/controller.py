"""The run controller (the `meshrl train` process): spawns the meshes and drives the steps.

Generation never waits on the controller. Generators are fed groups (one prompt, sampled
`samples_per_prompt` times) up to `max_async_level` policy versions ahead, each tagged with
the oldest version it may start on, and stream finished groups back through long-polled
`take` calls. Per step: gather the step's groups, drop rollouts whose oldest token is more
than `max_off_policy_steps` versions old, compute group-normalised advantages, shard packed
micro-batches and the replay/SDPO batch to the trainer ranks, step, publish the new weights
(generators pull them from the trainer's registered buffer and swap them in between decode
steps; the controller does not wait), hand imperfect states to idle teacher actors and mine
the answers that have come back into DPO pairs, log, and checkpoint.

Faults: a dead generator or teacher is replaced on its host (a generator with the current
weights) and its in-flight work is dropped and counted. A dead trainer process or a lost
worker host stops the run with `RunStopped`, after a checkpoint when the trainers can still
take one.
"""

from __future__ import annotations

import json
import random
import time
import zlib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from monarch.actor import ActorError
from monarch.spmd import setup_torch_elastic_env
from transformers import AutoTokenizer

from meshrl.actors.generator import GeneratorActor
from meshrl.actors.teacher import TeacherActor, TeacherAnswers
from meshrl.actors.trainer import TrainerActor
from meshrl.configs.loader import ConfigError, to_toml
from meshrl.configs.schema import RefKlLoss, RunConfig
from meshrl.ingress.protocol import Spec
from meshrl.ingress.server import IngressServer, model_files
from meshrl.ingress.verify import Scorer, Verifier
from meshrl.models.gguf import ensure_gguf, is_gguf
from meshrl.models.tiny import ensure_tiny
from meshrl.rollouts.advantages import check_draws, group_advantages
from meshrl.rollouts.batches import aux_shards, rl_shards, rollout_trace
from meshrl.rollouts.chat import ChatSettings, make_chat
from meshrl.rollouts.episodes import (
    EpisodeFormat,
    EpisodeLimits,
    Rollout,
    cap_trace,
    fresh_rollouts,
    reasoning_tokens,
    rubric_means,
)
from meshrl.rollouts.scheduler import FinishedGroup, GroupRequest
from meshrl.run.evaluate import BackgroundEval
from meshrl.run.export import export_model
from meshrl.run.plots import plot
from meshrl.run.progress import Progress
from meshrl.run.run_dir import RunDir, write_atomic
from meshrl.run.sinks import MetricSinks
from meshrl.tasks.base import make_task, task_tools
from meshrl.topology.faults import HostLost, RunStopped, SupervisionError, install_fault_hook
from meshrl.topology.placement import Placement
from meshrl.topology.pool import ActorPool, ProcMesh, stop_meshes
from meshrl.traces.collator import TraceCollator, to_message
from meshrl.traces.errors import ErrorClassifier
from meshrl.traces.pairs import DpoPair, ReplayState, mine_pairs, trace_states
from meshrl.traces.schema import TraceExample


@dataclass
class GroupSlot:
    """A requested group not yet back: the step it is for, the generator rank and actor asked
    (a replaced rank has a new one; None while offered to outside workers), the request, and
    whether it was dealt again already after a generator failed on it."""

    step: int
    rank: int | None
    actor: Any
    group: GroupRequest
    redealt: bool = False

    @property
    def samples(self) -> int:
        return self.group.samples


@dataclass
class PendingTake:
    """A generator's long-polled `take` (-> list[FinishedGroup]) and when its host was last
    known to answer (the call was made, or a probe found the host up)."""

    future: Any
    probed: float


@dataclass
class StepRequest:
    """One step's groups, and the prompt streams as they were before its prompts were drawn: a
    checkpoint taken while it is in flight saves those, so a resumed run draws the same prompts
    again instead of skipping them."""

    keys: list[str]
    streams_before: dict[str, Any]
    asked: list[GroupRequest]  # what it asked for: a step whose rollouts were all lost asks for it again
    groups: list[FinishedGroup] = field(default_factory=list)


@dataclass
class StepRollouts:
    """What a step trains on: its request (the groups that came back), its dynamic sampling, and
    the rollouts fresh enough to train on (never empty)."""

    request: StepRequest
    refill: Refill
    fresh: list[Rollout]


@dataclass
class Refill:
    """A step's dynamic sampling: its groups found with all rewards equal, the extra groups asked
    for, and the tied groups they replaced (out of the batch)."""

    uninformative: int
    extra: int
    replaced: list[FinishedGroup] = field(default_factory=list)


@dataclass
class TeacherRound:
    """States sent to a teacher actor, awaiting its answers (mined into pairs when they come)."""

    actor: Any
    future: Any  # -> TeacherAnswers
    states: list[ReplayState]
    sent: float


@dataclass
class PendingCheckpoint:
    """A checkpoint the trainer is still writing in the background, with the controller state
    of the moment it was snapshotted; committed once the trainer reports the write done."""

    staging: Path
    step: int
    state: dict[str, Any]
    started: float


TAKE_WAIT_S = 1.0  # a generator's `take` answers within this, with whatever groups have finished
# A generator call unanswered this long has its worker host probed (attach mode; a TCP connect):
# a host that is gone is noticed at once instead of after Monarch's supervision timeout.
HOST_PROBE_S = 2.0


def resolve_model(config: RunConfig, run: RunDir) -> str:
    """`tiny` is built and a GGUF file converted, under the run directory on first use; anything
    else is a path or hub id."""
    if config.model.path == "tiny":
        return str(ensure_tiny(run.root / "tiny_model", config.model.tiny, seed=config.seed))
    if is_gguf(config.model.path):
        return str(ensure_gguf(config.model.path, run.root / "gguf_model"))
    return config.model.path


def stream_seed(config: RunConfig) -> int:
    """The seed of the run's prompt, sampling and teacher-state streams. Islands share
    `config.seed` (the same tiny model and warm start: every island starts from the same weights)
    but each draws its own prompts and sampling seeds; two islands on one seed would train on the
    same rollouts, half the data their rollout count says."""
    island = config.trainer.diloco.replica_id
    return config.seed if island is None else config.seed + (zlib.crc32(island.encode()) << 4)


class Controller:
    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.run = RunDir(config.output_dir)
        self.model_path = resolve_model(config, self.run)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.task = make_task(config.task)
        hint = getattr(self.task, "hint", None)
        self.chat = ChatSettings.of(config.model)
        tools = task_tools(self.task)
        self.collator = TraceCollator(
            self.tokenizer, hint_generator=hint if config.loss.sdpo.weight > 0 else None, tools=tools,
            template_kwargs=self.chat.template_kwargs, max_seq_len=config.trainer.micro_batch_tokens,
            sampled_format=make_chat(self.tokenizer, self.chat, tools),  # one that would fail mid-run is refused here
        )  # fmt: skip
        if config.trainer.warm_start_steps or config.task.traces:
            self.collator.turn_markers  # noqa: B018 - traces without sampled ids need them: refused here, not mid-run
        streams = stream_seed(config)
        self.data_rng = random.Random(streams)  # prompts
        self.seed_rng = random.Random(streams + 1)  # generator sampling seeds
        self.teacher_rng = random.Random(streams + 3)  # offline states for the teachers
        self.refill_rng = random.Random(streams + 4)  # prompts and seeds of dynamic sampling's extra groups
        self.step = 0
        self.requests: dict[int, StepRequest] = {}  # by step, oldest first
        self.slots: dict[str, GroupSlot] = {}  # groups in flight, by key
        self.takes: dict[int, PendingTake] = {}  # generator rank -> its pending `take`
        self.pulls: dict[int, Any] = {}  # generator rank -> its pending weight load
        self.pending_checkpoint: PendingCheckpoint | None = None
        self.groups_asked = 0
        self.dealt = 0  # groups handed to the mesh's generators (round-robin)
        self.pairs: list[DpoPair] = []
        self.dropped_stale = 0
        self.lost_rollouts = 0  # in flight on a generator that died
        self.generator_errors = 0  # generator calls that raised (the rank was replaced)
        self.teacher_rounds: dict[int, TeacherRound] = {}  # teacher rank -> its round in flight
        self.teacher_counts = {"actor_failures": 0, "late_rounds": 0}
        self.teacher_totals: dict[str, float] = {}  # counters of teacher actors gone (died, or before a resume)
        self.teacher_latest: dict[int, dict[str, float]] = {}  # teacher rank -> its live actor's counters
        self.offline_states = self._offline_states()
        self.timeline: list[dict[str, Any]] = []  # this step's spans (see `_span`)
        self.evaluator = BackgroundEval(config, self.model_path) if config.eval.interval else None
        self.ingress: IngressServer | None = None
        self.ingress_version = -1  # newest policy version handed to the ingress
        self.lost_hosts: frozenset[int] = frozenset()  # host indices found gone (their meshes are not waited on)

    # ------------------------------------------------------------------ meshes

    def spawn(self) -> None:
        """Place the meshes (topology config) and spawn their actors; generators and teachers
        are pools of replaceable ranks, however many hosts they span. Every mesh is spawned
        before any is waited on, so their processes start (and import) side by side."""
        install_fault_hook()
        self.placement = Placement(self.config.topology)
        self.generators = ActorPool(
            self.placement, "generator", "generator", GeneratorActor, self.config, self.model_path
        )
        self.trainer_procs = self.placement.procs("trainer")
        setup_torch_elastic_env(self.trainer_procs)
        self.trainers = self.trainer_procs.spawn("trainer", TrainerActor, self.config, self.model_path).flatten("rank")
        trainers_ready = self.trainers.setup.call()
        self.teachers = None
        if self.config.teachers.members:
            cache = str(self.run.root / "teacher_cache.jsonl")
            self.teachers = ActorPool(
                self.placement, "teacher", "teacher", TeacherActor, self.config, self.model_path, cache
            )
        self.actors = list(trainers_ready.get().values()) + self.generators.infos()
        self.run.check_shared(lambda path: self.trainers.read_text.call(path).get().item(rank=0))
        if self.teachers is not None:
            self.actors += self.teachers.infos()
        self.run.write_topology(self.actors)
        if self.config.ingress.bind is not None:
            self.ingress = self._start_ingress()

    def _start_ingress(self) -> IngressServer:
        """Listen for rollout workers; their submissions are verified against this run's task and
        the policy versions the ingress keeps."""
        cfg, g = self.config, self.config.generator
        limits = EpisodeLimits.of(cfg)
        spec = Spec(
            task_import_path=cfg.task.import_path, task_kwargs=cfg.task.kwargs, temperature=g.temperature,
            top_p=g.top_p, max_new_tokens=g.max_new_tokens, dtype=cfg.model.dtype,
            renderer=self.chat.renderer, tool_parser=self.chat.tool_parser,
            chat_template_kwargs=self.chat.template_kwargs, model_files=model_files(self.model_path),
            max_episode_tokens=limits.max_tokens, max_tool_result_tokens=limits.max_tool_tokens,
        )  # fmt: skip
        holder: list[IngressServer] = []
        scorer = Scorer(self.model_path, cfg.model.dtype, g.temperature, lambda v: holder[0].weights_path(v))
        verifier = Verifier(
            EpisodeFormat(self.tokenizer, make_task(cfg.task), self.chat, limits), scorer,
            max_new_tokens=g.max_new_tokens,
            fraction=cfg.ingress.verify_fraction, tolerance=cfg.ingress.verify_tolerance,
        )  # fmt: skip
        holder.append(IngressServer(cfg.ingress, spec, verifier))
        print(f"ingress: listening on {holder[0].address}")
        return holder[0]

    def shutdown(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
        if self.ingress is not None:
            self.ingress.close()
        meshes = [mesh for pool in (getattr(self, "generators", None), getattr(self, "teachers", None))
                  if pool is not None for mesh in pool.proc_meshes]  # fmt: skip
        if getattr(self, "trainer_procs", None) is not None:
            meshes.append(ProcMesh(self.trainer_procs, frozenset(range(self.config.topology.trainer.hosts)), "trainer"))
        stop_meshes(meshes, self.lost_hosts)
        self.run.prune_weights()  # published weights are only for the generators just stopped

    # ------------------------------------------------------------------ faults

    def _replace(self, pool: ActorPool, rank: int) -> None:
        """A dead generator or teacher rank: stop the run if its host is gone, else respawn it there."""
        role = pool.role
        if not self.placement.host_alive(role, rank):
            raise HostLost(self.placement.host_name(role, rank), role, rank, "its worker does not answer")
        try:
            info = pool.replace(rank)
        except Exception as exc:  # noqa: BLE001 - a host that cannot start a proc is as good as lost
            raise HostLost(self.placement.host_name(role, rank), role, rank, f"{type(exc).__name__}: {exc}") from None
        self.actors = [a for a in self.actors if (a["role"], a["rank"]) != (role, rank)] + [info]
        self.run.write_topology(self.actors)

    def stop_for_lost_host(self, lost: HostLost) -> RunStopped:
        """Checkpoint if the trainers still can, and say which host was lost and where to resume."""
        self.lost_hosts |= {self.placement.host_index(lost.role, lost.rank)}
        latest = self.run.latest_checkpoint()
        try:
            self.commit_checkpoint(wait=True)  # the write in flight may be this very step's
            latest = self.run.latest_checkpoint()
            if latest is None or latest.name != f"step_{self.step}":
                self.save()
                self.commit_checkpoint(wait=True)
            saved = f"Saved checkpoint step {self.step};"
        except SupervisionError as exc:  # the trainers were on that host too
            saved = f"no checkpoint could be taken ({exc}); newest complete: {latest.name if latest else 'none'};"
        return RunStopped(
            f"worker host {lost.host} is lost ({lost.role} rank {lost.rank}; {lost.why}). {saved} "
            "start `meshrl worker` there again and rerun with --resume."
        )

    def trainer_lost(self, error: Exception) -> RunStopped:
        """A trainer process died: no checkpoint can be taken; name a lost host if there is one."""
        place = self.config.topology.trainer
        firsts = range(0, place.size, place.procs)  # one rank per host: each host is probed once
        gone = [r for r in firsts if not self.placement.host_alive("trainer", r)]
        self.lost_hosts |= {self.placement.host_index("trainer", r) for r in gone}
        lost = [self.placement.host_name("trainer", r) for r in gone]
        where = f"worker host {', '.join(lost)} is lost" if lost else "a trainer process died"
        latest = self.run.latest_checkpoint()
        resume = f"checkpoint {latest.name}" if latest is not None else "no checkpoint yet (rerun starts over)"
        return RunStopped(f"{where} ({error}). Newest complete: {resume}; fix it and rerun with --resume.")

    # ------------------------------------------------------------------ data

    def _offline_states(self) -> list[Any]:
        """States of the ingested traces named in task.traces, for teacher replay. A state whose
        context leaves no room for a reply in one micro-batch is left out, named: its pair rows
        could never be trained whole."""
        states = []
        for path in self.config.task.traces:
            for n, line in enumerate(Path(path).read_text().splitlines(), 1):
                if line.strip():
                    try:
                        example = TraceExample.model_validate_json(line)
                    except ValueError as exc:
                        raise ValueError(f"task.traces: {path}:{n}: not a trace example: {exc}") from None
                    example = cap_trace(example, self.tokenizer, self.config.generator.max_tool_result_tokens)
                    found = trace_states(example)
                    fitting = [state for state in found if self._fits(state)]
                    if len(fitting) < len(found):
                        print(f"task.traces: {path}:{n} (trace {example.trace_id}): {len(found) - len(fitting)} of "
                              f"{len(found)} states leave no room for a reply within trainer.micro_batch_tokens "
                              f"{self.config.trainer.micro_batch_tokens}; left out", flush=True)  # fmt: skip
                    states += fitting
        return states

    def _fits(self, state: ReplayState) -> bool:
        """Whether a state's context, as the policy's prompt, plus one turn fits a trainer micro-batch."""
        context = len(self.collator.prompt_ids([to_message(m) for m in state.state_messages]))
        return context + self.config.generator.max_new_tokens <= self.config.trainer.micro_batch_tokens

    def _streams(self) -> dict[str, Any]:
        return {"data_rng": _rng_state(self.data_rng), "seed_rng": _rng_state(self.seed_rng)}

    def _groups(self, step: int, n: int, prompt_rng: random.Random, seed_rng: random.Random) -> list[GroupRequest]:
        """`n` groups for `step`: a group starts once its generator runs policy version
        `step - max_async_level` or newer."""
        g = self.config.generator
        prompts = self.task.sample_prompts(prompt_rng, n)
        in_flight = [slot.group.prompt.prompt_id for slot in self.slots.values() if slot.step == step]
        check_draws([p.prompt_id for p in prompts], in_flight, self.config.task.import_path)
        groups = []
        for prompt in prompts:
            key = f"{step}/{self.groups_asked}"
            self.groups_asked += 1
            seed = seed_rng.randrange(2**31)
            groups.append(
                GroupRequest(key, prompt, g.samples_per_prompt, seed, min_version=max(0, step - g.max_async_level))
            )
        return groups

    def _request(self, step: int) -> None:
        """Deal a step's groups round-robin to the generators (its first ones offered to outside
        workers when the ingress is on)."""
        before = self._streams()
        groups = self._groups(step, self.config.task.prompts_per_step, self.data_rng, self.seed_rng)
        self.requests[step] = StepRequest([group.key for group in groups], before, groups)
        if self.ingress is not None:  # the step's first groups are offered to outside workers
            offered, groups = (
                groups[: self.config.ingress.groups_per_step],
                groups[self.config.ingress.groups_per_step :],
            )
            for group in offered:
                self.slots[group.key] = GroupSlot(step, None, None, group)
            self.ingress.offer(step, offered)
        self._deal(step, groups)

    def _deal(self, step: int, groups: list[GroupRequest], redealt: bool = False) -> None:
        """Hand groups round-robin to the mesh's generators."""
        by_rank: dict[int, list[GroupRequest]] = {}
        for group in groups:
            rank = self.dealt % len(self.generators)
            self.dealt += 1
            by_rank.setdefault(rank, []).append(group)
            self.slots[group.key] = GroupSlot(step, rank, self.generators[rank], group, redealt)
        for rank, rank_groups in by_rank.items():
            submitted = self.generators[rank].submit.call_one(rank_groups)
            while True:
                try:
                    submitted.get(timeout=HOST_PROBE_S)
                    break
                except TimeoutError:
                    if self._probe_host(rank):
                        break
                except SupervisionError:
                    self._generator_died(rank)
                    break
                except ActorError as error:
                    self._generator_failed(rank, error)
                    break

    def _feed(self) -> None:
        """Keep the generators a step beyond what they may start: its groups wait on the
        generator for the weights they need and start the moment those land."""
        level = self.config.generator.max_async_level
        ahead = max(self.requests, default=self.step - 1) + 1
        while ahead < self.config.max_steps and ahead <= self.step + level + 1:
            self._request(ahead)
            ahead += 1

    def _gather(self, step: int) -> StepRequest:
        """Wait until every group of `step` is back or lost, taking finished groups of any step
        as they come."""
        request = self.requests[step]
        while any(key in self.slots for key in request.keys):
            self._poll(wait_s=0.01)
            if self.ingress is not None:
                self._poll_ingress(step)
        return self.requests.pop(step)

    def _collect(self, step: int) -> StepRollouts:
        """The step's groups, refilled, and their fresh rollouts. A step left with none (every
        generator of it died, or all it got was too stale) asks for its own groups again."""
        while True:
            self._feed()
            request = self._gather(step)
            refill = self._refill(request, step)
            rollouts = [r for group in request.groups for r in group.rollouts]
            fresh = fresh_rollouts(rollouts, step, self.config.generator.max_off_policy_steps)
            self.dropped_stale += len(rollouts) - len(fresh)
            if fresh:
                return StepRollouts(request, refill, fresh)
            self._ask_again(request, step)

    def _ask_again(self, request: StepRequest, step: int) -> None:
        """Deal a step's own groups again (same prompts and seeds, new keys) to the mesh's
        generators: drawing new ones would take later steps' prompts out of the streams, and a
        checkpoint's record of the streams (the oldest request's `streams_before`) would no longer
        say where a resumed run draws from."""
        groups = []
        for group in request.asked:
            groups.append(replace(group, key=f"{step}/{self.groups_asked}"))
            self.groups_asked += 1
        self.requests[step] = StepRequest([group.key for group in groups], request.streams_before, groups)
        self._deal(step, groups)

    def checkpoint_streams(self) -> dict[str, Any]:
        """The prompt streams a checkpoint records: where the oldest step still in flight drew from."""
        oldest = min(self.requests, default=None)
        return self.requests[oldest].streams_before if oldest is not None else self._streams()

    def _refill(self, request: StepRequest, step: int) -> Refill:
        """DAPO's dynamic sampling: while the step has groups whose rewards are all equal (they
        carry no advantage), ask the mesh's generators for as many fresh groups, up to
        `generator.refill_uninformative` extra groups in all. Their prompts and seeds come from a
        stream of their own, so the steps' regular prompts are those of a run without refills."""
        budget = self.config.generator.refill_uninformative
        tied = [group for group in request.groups if _uninformative(group)]
        first, extra, replaced = len(tied), 0, []
        while budget and tied and extra < budget:
            groups = self._groups(step, min(len(tied), budget - extra), self.refill_rng, self.refill_rng)
            extra += len(groups)
            self.requests[step] = StepRequest([group.key for group in groups], request.streams_before, groups)
            self._deal(step, groups)
            added = self._gather(step).groups
            # as in DAPO, a replaced group leaves the batch (and the loss normaliser) for the one that came back
            replaced += tied[: len(added)]
            request.groups = [g for g in request.groups if all(g is not r for r in replaced)] + added
            tied = tied[len(added) :] + [group for group in added if _uninformative(group)]
        return Refill(uninformative=first, extra=extra, replaced=replaced)

    def _poll_ingress(self, step: int) -> None:
        """Take the verified outside groups; what the ingress gives back (offers of this step
        nobody leased, expired leases, rejected submissions) the mesh's generators run."""
        for group in self.ingress.collect():
            self._arrived(group, "ingress")
        by_step: dict[int, list[GroupRequest]] = {}
        for group in self.ingress.reclaim(step):
            if group.key in self.slots:
                by_step.setdefault(self.slots[group.key].step, []).append(group)
        for slot_step, groups in sorted(by_step.items()):
            self._deal(slot_step, groups)

    def _arrived(self, group: FinishedGroup, lane: str) -> None:
        """A finished group joins its step's request (unless its slot was dropped meanwhile)."""
        slot = self.slots.pop(group.key, None)
        if slot is not None:
            self.requests[slot.step].groups.append(group)
            self.timeline.append(_span(lane, group.started, group.finished, slot.step))

    def _ingress_stats(self, fresh: list[Rollout]) -> dict[str, float]:
        """The ingress counters, the outside rollouts this step trained on and their mean reward
        (a worker that cherry-picks samples shows as a gap to the mesh's)."""
        external = [r for r in fresh if "worker" in r.info]
        return {
            **self.ingress.stats(),
            "rollouts/external": float(len(external)),
            "reward/external": sum(r.reward for r in external) / len(external) if external else float("nan"),
        }

    def _poll(self, wait_s: float) -> None:
        for rank in range(len(self.generators)):
            if rank not in self.takes:
                self.takes[rank] = PendingTake(self.generators[rank].take.call_one(TAKE_WAIT_S), time.monotonic())
            pending = self.takes[rank]
            try:
                groups = pending.future.get(timeout=wait_s)
            except TimeoutError:
                if time.monotonic() - pending.probed > HOST_PROBE_S:
                    pending.probed = time.monotonic()
                    self._probe_host(rank)
                continue
            except SupervisionError:
                self._generator_died(rank)
                continue
            except ActorError as error:
                self._generator_failed(rank, error)
                continue
            del self.takes[rank]
            for group in groups:
                self._arrived(group, f"generator {rank}")

    def _probe_host(self, rank: int) -> bool:
        """A generator rank is slow to answer: if its worker host no longer accepts connections,
        handle the rank as dead now (which stops the run: its host is lost) rather than after
        Monarch's supervision notices, about a minute later. Whether it was handled as dead."""
        if self.placement.host_alive("generator", rank):
            return False
        self._generator_died(rank)
        return True

    def _generator_failed(self, rank: int, error: ActorError) -> None:
        """A generator's call raised (its scheduler stopped on an engine or task error): the rank
        is replaced like a dead one, and its groups are dealt again, once (a group that fails a
        second generator is counted lost, so no deterministic failure loops)."""
        self.generator_errors += 1
        print(f"generator rank {rank} failed and is replaced: {str(error).strip().splitlines()[-1]}", flush=True)
        failed = self.generators[rank]
        again = [(key, slot) for key, slot in self.slots.items() if slot.actor is failed and not slot.redealt]
        for key, _ in again:
            del self.slots[key]
        try:  # free its engine now; its process ends with the run
            failed.close.call_one().get(timeout=HOST_PROBE_S * 5)
        except Exception:  # noqa: BLE001 - a generator too broken to close is replaced all the same
            pass
        self._generator_died(rank)
        by_step: dict[int, list[GroupRequest]] = {}
        for _, slot in again:
            by_step.setdefault(slot.step, []).append(slot.group)
        for step, groups in sorted(by_step.items()):
            self._deal(step, groups, redealt=True)

    def _generator_died(self, rank: int) -> None:
        """Count the rank's groups in flight as lost, and replace it (once, however many calls
        found it dead)."""
        dead = self.generators[rank]
        for key, slot in list(self.slots.items()):
            if slot.actor is dead:
                self.lost_rollouts += slot.samples
                del self.slots[key]
        self.takes.pop(rank, None)
        self.pulls.pop(rank, None)
        self._replace(self.generators, rank)
        try:
            self._load_weights([rank], self.step, wait=True)
            self.pulls.pop(rank).get()
        except SupervisionError:
            raise RunStopped(
                f"generator rank {rank} died again right after it was replaced; see the worker's log"
            ) from None

    # ------------------------------------------------------------------ weights

    def _load_weights(self, ranks: list[int], version: int, wait: bool = False) -> None:
        """Trainer rank 0's weights → these generator ranks, through the trainer's registered
        RDMA buffer or a safetensors file (both read by the generators themselves) or as pickled
        tensors; the loads are left in `self.pulls`. Every trainer rank is called: under FSDP2 the full weights are an all-gather."""
        self._settle_pulls()  # the buffer is refilled in place, old files removed: earlier reads must be done
        sync = self.config.generator.weight_sync
        if sync == "rdma":
            buffer, layout = self.trainers.policy_weights_rdma.call().get().item(rank=0)
            for rank in ranks:
                self.pulls[rank] = self.generators[rank].pull_weights.call_one(buffer, layout, version, wait)
        elif sync == "filesystem":
            path = self.trainers.policy_weights_file.call(str(self.run.weights_file(version))).get().item(rank=0)
            self.run.prune_weights(keep=Path(path))  # every earlier version's reads are settled
            for rank in ranks:
                self.pulls[rank] = self.generators[rank].read_weights.call_one(path, version, wait)
        else:
            weights = self.trainers.policy_weights.call().get().item(rank=0)
            for rank in ranks:
                self.pulls[rank] = self.generators[rank].load_weights.call_one(weights, version, wait)

    def _settle_pulls(self) -> None:
        """Wait for the weight loads in flight; a generator that died meanwhile is replaced."""
        while self.pulls:
            rank, future = self.pulls.popitem()
            try:
                future.get()
            except SupervisionError:
                self._generator_died(rank)

    def publish(self, version: int, wait: bool = False) -> float:
        """The new policy to every generator (and to the ingress, for outside workers and the
        verifier); returns the seconds the controller spent on it."""
        start = time.perf_counter()
        self._load_weights(list(range(len(self.generators))), version, wait)
        self._publish_ingress(version)
        if wait:
            self._settle_pulls()
        return time.perf_counter() - start

    def _publish_ingress(self, version: int) -> None:
        """Trainer rank 0 writes the version's safetensors file into the ingress's folder (a
        filesystem the controller shares, as for checkpoints); the ingress serves it in chunks."""
        if self.ingress is None or version == self.ingress_version:
            return
        path = self.run.root / "ingress" / f"step_{version}.safetensors"
        self.trainers.policy_weights_file.call(str(path)).get()
        self.ingress.publish(version, path)
        self.ingress_version = version

    # ------------------------------------------------------------------ teachers

    def _teacher_round(self, rollouts: list[Rollout]) -> dict[str, float]:
        """Mine the teacher answers that have come back; send this step's imperfect states to
        the teacher actors that are free. Never waits for a teacher."""
        if self.teachers is None:
            return {}
        for rank, pending in list(self.teacher_rounds.items()):
            try:
                reply: TeacherAnswers = pending.future.get(timeout=0.001)
            except TimeoutError:
                self.teacher_counts["late_rounds"] += 1
                continue
            except SupervisionError:
                del self.teacher_rounds[rank]
                self.teacher_counts["actor_failures"] += 1
                for name, value in self.teacher_latest.pop(rank, {}).items():
                    self.teacher_totals[name] = self.teacher_totals.get(name, 0.0) + value
                if self.teachers[rank] is pending.actor:
                    self._replace(self.teachers, rank)
                continue
            del self.teacher_rounds[rank]
            self.teacher_latest[rank] = reply.totals
            self.timeline.append(_span(f"teacher {rank}", pending.sent, time.time(), self.step - 1))
            for state, actions in zip(pending.states, reply.actions):
                pair = mine_pairs(state, actions, self.config.teachers.min_agree)
                if pair is not None:
                    self.pairs.append(pair)
        free = [rank for rank in range(len(self.teachers)) if rank not in self.teacher_rounds]
        if free:
            states, contexts = self._teacher_states(rollouts)
            spent = self._teacher_totals().get("usd_spent", 0.0)
            for i, rank in enumerate(free):
                chunk, chunk_contexts = states[i :: len(free)], contexts[i :: len(free)]
                if chunk:
                    actor = self.teachers[rank]
                    elsewhere = spent - self.teacher_latest.get(rank, {}).get("usd_spent", 0.0)
                    future = actor.replay.call_one([s.state_messages for s in chunk], chunk_contexts, elsewhere)
                    self.teacher_rounds[rank] = TeacherRound(actor, future, chunk, time.time())
        return self._teacher_stats()

    def _teacher_states(self, rollouts: list[Rollout]) -> tuple[list[ReplayState], list[dict[str, Any]]]:
        """Up to `states_per_step` states: the worst rollouts' imperfect states, then offline ones."""
        classifier = ErrorClassifier()
        budget = self.config.teachers.states_per_step
        states, contexts = [], []
        for r in sorted(rollouts, key=lambda r: r.reward)[:budget]:
            if r.reward < 1.0:
                for state in trace_states(rollout_trace(r, classifier)):
                    states.append(state)
                    contexts.append({"prompt": r.prompt})
        for state in self.teacher_rng.sample(self.offline_states, min(len(self.offline_states), budget // 2)):
            states.append(state)
            contexts.append({})
        return states[:budget], contexts[:budget]

    def _teacher_totals(self) -> dict[str, float]:
        """Teacher counters over the run: the live actors' plus those of actors before them
        (replaced ones, and the run before a resume)."""
        totals = dict(self.teacher_totals)
        for latest in self.teacher_latest.values():
            for name, value in latest.items():
                totals[name] = totals.get(name, 0.0) + value
        return totals

    def _teacher_stats(self) -> dict[str, float]:
        return {f"teacher/{k}": float(v) for k, v in {**self._teacher_totals(), **self.teacher_counts}.items()}

    # ------------------------------------------------------------------ evaluation

    def _eval_round(self) -> dict[str, float]:
        """Every `eval.interval` steps the new policy's weights go to the background evaluation
        (unless one is still running: skipped); a finished one's metrics go into this step's
        record. The last step evaluates the final policy and waits for it; the step before waits
        for a running round and starts none, so no round's result is left for the last step's
        record, which holds the final policy's."""
        if self.evaluator is None:
            return {}
        last = self.step == self.config.max_steps
        before_last = self.step == self.config.max_steps - 1
        stats = self.evaluator.done(wait=before_last)
        if (self.step % self.config.eval.interval == 0 and not before_last) or last:
            self.evaluator.start(self.trainers.policy_weights.call().get().item(rank=0), self.step)
        return self.evaluator.done(wait=True) if last else stats

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> None:
        """Snapshot a checkpoint: the trainers write it in the background while training goes on,
        and `commit_checkpoint` publishes it once written (one write in flight at a time)."""
        self.commit_checkpoint(wait=True)
        start = time.time()
        staging = self.run.staging(self.step)
        self.trainers.save_checkpoint.call(str(staging)).get()
        state = {
            "step": self.step,
            **self.checkpoint_streams(),
            "teacher_rng": _rng_state(self.teacher_rng),
            "refill_rng": _rng_state(self.refill_rng),
            "teacher_totals": self._teacher_totals(),
            "teacher_counts": self.teacher_counts,
            "pairs": [p.model_dump() for p in self.pairs],
            "dropped_stale": self.dropped_stale,
            "lost_rollouts": self.lost_rollouts,
            "generator_errors": self.generator_errors,
            "teacher_cache": str(self.run.root / "teacher_cache.jsonl"),
            "ingress": self.ingress.state() if self.ingress is not None else {},
        }
        self.pending_checkpoint = PendingCheckpoint(staging, self.step, state, start)
        self.timeline.append(_span("checkpoint", start, time.time(), self.step - 1))

    def commit_checkpoint(self, wait: bool) -> None:
        """Publish the pending checkpoint (controller state, COMPLETE, one rename) once every
        trainer rank reports its write done; `wait`: block until then."""
        pending = self.pending_checkpoint
        if pending is None or not all(self.trainers.checkpoint_written.call(wait).get().values()):
            return
        self.pending_checkpoint = None
        self.run.commit_checkpoint(pending.staging, pending.step, pending.state, self.config.ckpt.keep_last)
        self.timeline.append(_span("checkpoint write", pending.started, time.time(), pending.step - 1))

    def resume(self) -> bool:
        latest = self.run.latest_checkpoint()
        if latest is None:
            return False
        state = json.loads((latest / "controller.json").read_text())
        self.trainers.load_checkpoint.call(str(latest)).get()
        self.step = state["step"]
        self.data_rng.setstate(_rng_from(state["data_rng"]))
        self.seed_rng.setstate(_rng_from(state["seed_rng"]))
        self.teacher_rng.setstate(_rng_from(state["teacher_rng"]))
        if "refill_rng" in state:  # checkpoints written before dynamic sampling existed go on with a fresh stream
            self.refill_rng.setstate(_rng_from(state["refill_rng"]))
        self.teacher_totals, self.teacher_counts = state["teacher_totals"], state["teacher_counts"]
        self.pairs = [DpoPair.model_validate(p) for p in state["pairs"]]
        self.dropped_stale = state["dropped_stale"]
        self.lost_rollouts = state["lost_rollouts"]
        self.generator_errors = state.get("generator_errors", 0)  # absent from checkpoints of earlier versions
        if self.ingress is not None:
            self.ingress.restore(state.get("ingress", {}))
        self.run.keep_metrics_before(self.step)
        self.publish(self.step, wait=True)
        return True

    # ------------------------------------------------------------------ the loop

    def warm_start(self) -> None:
        steps = self.config.trainer.warm_start_steps
        if steps == 0 or self.step > 0:
            return
        demos = [
            cap_trace(demo, self.tokenizer, self.config.generator.max_tool_result_tokens)
            for demo in self.task.demonstrations(
                random.Random(self.config.seed + 2), steps * self.config.trainer.warm_start_batch_size
            )
        ]
        world = self.config.topology.trainer.size
        size = self.config.trainer.warm_start_batch_size
        cut = 0
        for i in range(steps):
            chunk = demos[i * size : (i + 1) * size]
            collated = [self.collator(chunk[r::world]) for r in range(world)]
            cut += sum(c.stats.truncated for c in collated)
            self.trainers.sft_step.call([c.batch for c in collated]).get()
        if cut:
            print(f"warm start: {cut} demonstrations longer than trainer.micro_batch_tokens "
                  f"{self.config.trainer.micro_batch_tokens} were cut to it", flush=True)  # fmt: skip
        self.trainers.start_rl.call().get()
        self.publish(0, wait=True)

    def train(self, progress: Progress, sinks: MetricSinks) -> None:
        cfg = self.config
        world = cfg.topology.trainer.size
        self._publish_ingress(self.step)  # no warm start and no resume: the initial weights
        while self.step < cfg.max_steps:
            step_start = time.perf_counter()
            self.timeline = []
            collected = self._collect(self.step)
            request, refill, fresh = collected.request, collected.refill, collected.fresh
            waited = time.perf_counter() - step_start
            advantages = group_advantages(fresh)
            rl = rl_shards(fresh, advantages, cfg.trainer.micro_batch_tokens, self.tokenizer.pad_token_id, world,
                           keep_zero_advantage=isinstance(cfg.loss, RefKlLoss),
                           mask_truncated=cfg.trainer.mask_truncated_completions,
                           count_zero_advantage=cfg.trainer.zero_advantage_tokens == "count")  # fmt: skip
            pairs = self.pairs if cfg.loss.replay.weight > 0 else []  # a channel at weight 0 gets no rows
            aux = aux_shards(fresh, pairs, self.collator, world, cfg.loss.sdpo.max_traces_per_step)
            replay_pairs = len(self.pairs)
            self.pairs = []
            train_start, train_wall = time.perf_counter(), time.time()
            metrics = self.trainers.train_step.call(rl.shards, aux.shards, rl.normaliser).get().item(rank=0)
            train_seconds = time.perf_counter() - train_start
            self.timeline.append(_span("trainer", train_wall, time.time(), self.step))
            self.step += 1
            lost = None
            try:
                publish_wall = time.time()
                timings = {"time/weight_sync": self.publish(self.step)}
                self.timeline.append(_span("weights", publish_wall, time.time(), self.step - 1))
                teacher_stats = self._teacher_round(fresh)
                eval_stats = self._eval_round()
            except HostLost as exc:  # record the step trained before stopping, so resume has no gap
                lost, timings, teacher_stats, eval_stats = exc, {}, {}, {}

            sampled = [v for r in fresh for v in r.versions]
            think_end = self.collator.think_end
            gen_seconds = max(g.finished for g in request.groups) - min(g.started for g in request.groups)
            record = {
                "step": self.step - 1,
                "policy_version": self.step,
                "reward/mean": sum(r.reward for r in fresh) / max(1, len(fresh)),
                **(
                    _sampled_reward(fresh, refill, self.step - 1, cfg.generator.max_off_policy_steps)
                    if cfg.generator.refill_uninformative
                    else {}
                ),  # fmt: skip
                **rubric_means(fresh),
                **({"reasoning/tokens": reasoning_tokens(fresh, think_end)} if think_end is not None else {}),
                "rollouts": len(fresh),
                "dropped_stale": self.dropped_stale,
                "lost_rollouts": self.lost_rollouts,
                "generator/respawns": self.generators.replaced,
                "generator/errors": self.generator_errors,
                "staleness": sum(self.step - 1 - v for v in sampled) / max(1, len(sampled)),
                "staleness/max": max(self.step - 1 - v for v in sampled),
                "tool_errors": sum(r.tool_errors for r in fresh),
                "replay_pairs": replay_pairs,
                "truncated": rl.truncated,
                "rollouts/cut_off": sum(r.finish_reason == "length" for r in fresh),
                "rollouts/cut_off_masked": rl.cut_off,
                "groups/uninformative": refill.uninformative,
                "groups/refilled": refill.extra,
                **{k: v for k, v in metrics.items()},
                **{f"collate/{k}": v for k, v in asdict(aux.stats).items()},
                **teacher_stats,
                **eval_stats,
                **(self._ingress_stats(fresh) if self.ingress is not None else {}),
                "rollout_tokens_per_s": len(sampled) / max(gen_seconds, 1e-9),
                "train_tokens_per_s": rl.tokens / max(train_seconds, 1e-9),
                "time/step": time.perf_counter() - step_start,
                "time/generate": gen_seconds,
                "time/wait_rollouts": waited,
                "time/train": train_seconds,
                **timings,
            }
            self.run.append_metrics(record)
            sinks.log(record)
            progress.update(record, cfg.max_steps)
            if lost is not None:
                raise lost
            self.commit_checkpoint(wait=False)
            if self.step % cfg.ckpt.interval == 0 or self.step == cfg.max_steps:
                self.save()
            self.run.append_timeline({"step": self.step - 1, "spans": self.timeline})
        self.commit_checkpoint(wait=True)


def _sampled_reward(fresh: list[Rollout], refill: Refill, step: int, max_off_policy_steps: int) -> dict[str, float]:
    """`reward/sampled`: the mean over every fresh rollout sampled for the step, the tied groups
    dynamic sampling replaced included (`reward/mean` covers the trained batch only)."""
    replaced = fresh_rollouts([r for g in refill.replaced for r in g.rollouts], step, max_off_policy_steps)
    every = fresh + replaced
    return {"reward/sampled": sum(r.reward for r in every) / max(1, len(every))}


def _uninformative(group: FinishedGroup) -> bool:
    """Every rollout of the group got the same reward: their advantages are all 0."""
    return len({r.reward for r in group.rollouts}) <= 1


def _span(lane: str, start: float, end: float, step: int) -> dict[str, Any]:
    """One bar of the timeline figure: a lane (generator r, trainer, weights, teacher r,
    checkpoint (the snapshot), checkpoint write (until committed)), wall-clock start and end, and the step it served."""
    return {"lane": lane, "start": start, "end": end, "step": step}


def _rng_state(rng: random.Random) -> list[Any]:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _rng_from(state: list[Any]) -> tuple[Any, ...]:
    return (state[0], tuple(state[1]), state[2])


def train(config: RunConfig) -> Path:
    """Run (or resume) training; returns the run directory."""
    run = RunDir(config.output_dir)
    if config.overwrite:
        run.clear()
    elif not config.resume and run.earlier_run():
        raise ConfigError(
            f"output_dir {run.root} holds an earlier run ({'; '.join(run.earlier_run())}): pass --resume to "
            "continue it, --overwrite to start over there, or choose another --output-dir"
        )
    write_atomic(run.root / "config.toml", to_toml(config))
    controller = Controller(config)
    controller.spawn()
    try:
        resumed = config.resume and controller.resume()
        if not resumed:
            if config.resume:
                print(f"no complete checkpoint in {run.checkpoints}; starting from step 0")
            run.keep_metrics_before(0)
            controller.warm_start()
        sinks = MetricSinks(config, run.root, controller.step)
        try:
            with Progress(config.metrics.progress, start=controller.step) as progress:
                controller.train(progress, sinks)
        finally:
            sinks.close()
    except HostLost as lost:
        raise controller.stop_for_lost_host(lost) from None
    except SupervisionError as exc:  # generators and teachers are handled where called: a trainer died
        raise controller.trainer_lost(exc) from None
    finally:
        controller.shutdown()
    plot(run.root)
    export_model(run.latest_checkpoint() / "model", run.root / "final", config.model.dtype)
    return run.root
