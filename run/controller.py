"""The run controller (the `meshrl train` process): spawns the meshes and drives the steps.

Per step: take the rollouts generated for it (at most `max_async_level` policy versions
stale; older than `max_off_policy_steps` are dropped), compute group-normalised
advantages, shard packed micro-batches and the replay/SDPO batch to the trainer ranks,
step, push the new weights to the generators, hand this step's imperfect states to the
teachers and mine last step's answers into DPO pairs, log, and checkpoint.

Faults: a dead generator or teacher is replaced on its host (a generator with the current
weights) and its in-flight work is dropped and counted; teacher answers are awaited at most
`teachers.wait_s` per step. A dead trainer process or a lost worker host stops the run with
`RunStopped`, after a checkpoint when the trainers can still take one.
"""

from __future__ import annotations

import json
import random
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from monarch.spmd import setup_torch_elastic_env
from transformers import AutoTokenizer

from meshrl.actors.generator import GeneratorActor, RolloutBatch
from meshrl.actors.teacher import TeacherActor, TeacherAnswers
from meshrl.actors.trainer import TrainerActor
from meshrl.configs.loader import ConfigError, to_toml
from meshrl.configs.schema import RunConfig
from meshrl.models.tiny import ensure_tiny
from meshrl.rollouts.advantages import group_advantages
from meshrl.rollouts.batches import aux_shards, rl_shards, rollout_trace
from meshrl.rollouts.episodes import Rollout
from meshrl.run.export import export_model
from meshrl.run.plots import plot
from meshrl.run.progress import Progress
from meshrl.run.run_dir import RunDir, write_atomic
from meshrl.tasks.base import make_task
from meshrl.topology.faults import HostLost, RunStopped, SupervisionError, install_fault_hook
from meshrl.topology.placement import Placement
from meshrl.topology.pool import ActorPool
from meshrl.traces.collator import TraceCollator
from meshrl.traces.errors import ErrorClassifier
from meshrl.traces.pairs import DpoPair, ReplayState, mine_pairs, trace_states
from meshrl.traces.schema import TraceExample


@dataclass
class RolloutRequest:
    """A step's prompts asked of one generator rank: the actor asked (a replaced rank has a new
    one), how many rollouts that is, and the answer to come."""

    rank: int
    actor: Any
    asked: int
    future: Any  # -> RolloutBatch


@dataclass
class StepRequest:
    """One step's requests to the generators, and the prompt streams as they were before its
    prompts were drawn: a checkpoint taken while it is in flight saves those, so a resumed run
    draws the same prompts again instead of skipping them."""

    requests: list[RolloutRequest]
    streams_before: dict[str, Any]


@dataclass
class TeacherRound:
    """States sent to a teacher actor, awaiting its answers (mined into pairs a step later)."""

    actor: Any
    future: Any  # -> TeacherAnswers
    states: list[ReplayState]


def resolve_model(config: RunConfig, run: RunDir) -> str:
    """`tiny` is built and saved under the run directory on first use; anything else is a path or hub id."""
    if config.model.path == "tiny":
        return str(ensure_tiny(run.root / "tiny_model", config.model.tiny, seed=config.seed))
    return config.model.path


class Controller:
    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.run = RunDir(config.output_dir)
        self.model_path = resolve_model(config, self.run)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.task = make_task(config.task)
        hint = getattr(self.task, "hint", None)
        self.collator = TraceCollator(self.tokenizer, hint_generator=hint if config.loss.sdpo.weight > 0 else None)
        self.data_rng = random.Random(config.seed)  # prompts
        self.seed_rng = random.Random(config.seed + 1)  # generator sampling seeds
        self.teacher_rng = random.Random(config.seed + 3)  # offline states for the teachers
        self.pending: deque[StepRequest] = deque()
        self.step = 0
        self.pairs: list[DpoPair] = []
        self.dropped_stale = 0
        self.lost_rollouts = 0  # in flight on a generator that died
        self.pending_teacher: TeacherRound | None = None
        self.teacher_counts = {"actor_failures": 0, "late_rounds": 0}
        self.teacher_totals: dict[str, float] = {}  # counters of teacher actors that died
        self.teacher_latest: dict[str, float] = {}
        self.offline_states = self._offline_states()

    # ------------------------------------------------------------------ meshes

    def spawn(self) -> None:
        """Place the meshes (topology config) and spawn their actors; generators and teachers
        are pools of replaceable ranks, however many hosts they span."""
        install_fault_hook()
        self.placement = Placement(self.config.topology)
        self.generators = ActorPool(
            self.placement, "generator", "generator", GeneratorActor, self.config, self.model_path
        )
        self.trainer_procs = self.placement.procs("trainer")
        setup_torch_elastic_env(self.trainer_procs)
        self.trainers = self.trainer_procs.spawn("trainer", TrainerActor, self.config, self.model_path).flatten("rank")
        self.actors = list(self.trainers.setup.call().get().values()) + self.generators.infos()
        self.run.check_shared(lambda path: self.trainers.read_text.call(path).get().item(rank=0))
        self.teachers = None
        if self.config.teachers.members:
            cache = str(self.run.root / "teacher_cache.jsonl")
            self.teachers = ActorPool(
                self.placement, "teacher", "teacher", TeacherActor, self.config, self.model_path, cache
            )
            self.actors += self.teachers.infos()
        self.run.write_topology(self.actors)

    def shutdown(self) -> None:
        for pool in (getattr(self, "generators", None), getattr(self, "teachers", None)):
            if pool is not None:
                pool.stop()
        if getattr(self, "trainer_procs", None) is not None:
            try:
                self.trainer_procs.stop().get(timeout=30)
            except Exception as exc:  # noqa: BLE001 - after a trainer fault its mesh may not answer
                print(f"stopping the trainer mesh: {type(exc).__name__}: {exc}")

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
        latest = self.run.latest_checkpoint()
        try:
            if latest is None or latest.name != f"step_{self.step}":
                self.save()
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
        lost = [self.placement.host_name("trainer", r) for r in firsts if not self.placement.host_alive("trainer", r)]
        where = f"worker host {', '.join(lost)} is lost" if lost else "a trainer process died"
        latest = self.run.latest_checkpoint()
        resume = f"checkpoint {latest.name}" if latest is not None else "no checkpoint yet (rerun starts over)"
        return RunStopped(f"{where} ({error}). Newest complete: {resume}; fix it and rerun with --resume.")

    # ------------------------------------------------------------------ data

    def _offline_states(self) -> list[Any]:
        """States of the ingested traces named in task.traces, for teacher replay."""
        states = []
        for path in self.config.task.traces:
            for n, line in enumerate(Path(path).read_text().splitlines(), 1):
                if line.strip():
                    try:
                        states += trace_states(TraceExample.model_validate_json(line))
                    except ValueError as exc:
                        raise ValueError(f"task.traces: {path}:{n}: not a trace example: {exc}") from None
        return states

    def _streams(self) -> dict[str, Any]:
        return {"data_rng": _rng_state(self.data_rng), "seed_rng": _rng_state(self.seed_rng)}

    def _request(self) -> StepRequest:
        """Ask every generator for its share of a step's prompts."""
        before = self._streams()
        prompts = self.task.sample_prompts(self.data_rng, self.config.task.prompts_per_step)
        n, samples = len(self.generators), self.config.generator.samples_per_prompt
        requests = []
        for i in range(n):
            if prompts[i::n]:
                actor = self.generators[i]
                future = actor.rollout.call_one(prompts[i::n], self.seed_rng.randrange(2**31))
                requests.append(RolloutRequest(i, actor, len(prompts[i::n]) * samples, future))
        return StepRequest(requests, before)

    def _collect(self, requests: list[RolloutRequest]) -> RolloutBatch:
        """The rollouts of the generators that answered and their slowest time; rollouts of a
        dead generator are counted lost and the generator replaced (once, however many of its
        requests were in flight)."""
        collected = RolloutBatch([], 0.0)
        for request in requests:
            try:
                batch: RolloutBatch = request.future.get()
            except SupervisionError:
                self.lost_rollouts += request.asked
                if self.generators[request.rank] is request.actor:
                    self._replace_generator(request.rank)
                continue
            collected.rollouts += batch.rollouts
            collected.seconds = max(collected.seconds, batch.seconds)
        return collected

    def _replace_generator(self, rank: int) -> None:
        self._replace(self.generators, rank)
        if self._sync_weights(self.step, [rank]):
            raise RunStopped(f"generator rank {rank} died again right after it was replaced; see the worker's log")

    def _sync_weights(self, version: int, ranks: list[int]) -> list[int]:
        """Trainer rank 0's weights → these generator ranks; returns the ranks that died meanwhile.
        Every trainer rank is called: under FSDP2 the full weights are an all-gather."""
        if self.config.generator.weight_sync == "rdma":
            buffer, layout = self.trainers.policy_weights_rdma.call().get().item(rank=0)
            futures = {r: self.generators[r].pull_weights.call_one(buffer, layout, version) for r in ranks}
        else:
            weights = self.trainers.policy_weights.call().get().item(rank=0)
            futures = {r: self.generators[r].load_weights.call_one(weights, version) for r in ranks}
        dead = []
        for rank, future in futures.items():
            try:
                future.get()
            except SupervisionError:
                dead.append(rank)
        return dead

    def _push_weights(self, version: int) -> float:
        """The new policy to every generator, as pickled tensors or through an RDMA buffer;
        a generator that died meanwhile is replaced (and gets the weights)."""
        start = time.perf_counter()
        for rank in self._sync_weights(version, list(range(len(self.generators)))):
            self._replace_generator(rank)
        return time.perf_counter() - start

    def _teacher_round(self, rollouts: list[Rollout]) -> dict[str, float]:
        """Collect last step's teacher answers as pairs; send this step's imperfect states."""
        if self.teachers is None:
            return {}
        if self.pending_teacher is not None:
            pending = self.pending_teacher
            try:
                reply: TeacherAnswers = pending.future.get(timeout=self.config.teachers.wait_s)
                answers, self.teacher_latest = reply.actions, reply.totals
            except TimeoutError:  # still answering: keep waiting next step, send nothing new
                self.teacher_counts["late_rounds"] += 1
                return self._teacher_stats()
            except SupervisionError:
                self.teacher_counts["actor_failures"] += 1
                answers = []
                for name, value in self.teacher_latest.items():
                    self.teacher_totals[name] = self.teacher_totals.get(name, 0.0) + value
                self.teacher_latest = {}
                if self.teachers[0] is pending.actor:
                    self._replace(self.teachers, 0)
                    self._carry_teacher_spend()
            self.pending_teacher = None
            for state, actions in zip(pending.states, answers):
                pair = mine_pairs(state, actions, self.config.teachers.min_agree)
                if pair is not None:
                    self.pairs.append(pair)
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
        states, contexts = states[:budget], contexts[:budget]
        actor = self.teachers[0]
        self.pending_teacher = TeacherRound(
            actor, actor.replay.call_one([s.state_messages for s in states], contexts), states
        )
        return self._teacher_stats()

    def _carry_teacher_spend(self) -> None:
        """A new teacher actor (respawn, resume) starts its ceiling from what the run has spent."""
        self.teachers[0].carry_spend.call_one(self.teacher_totals.get("usd_spent", 0.0)).get()

    def _teacher_totals(self) -> dict[str, float]:
        """Teacher counters over the run: the live actor's plus those of actors before it
        (replaced ones, and the run before a resume)."""
        names = set(self.teacher_totals) | set(self.teacher_latest)
        return {k: self.teacher_totals.get(k, 0.0) + self.teacher_latest.get(k, 0.0) for k in names}

    def _teacher_stats(self) -> dict[str, float]:
        return {f"teacher/{k}": float(v) for k, v in {**self._teacher_totals(), **self.teacher_counts}.items()}

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> None:
        staging = self.run.staging(self.step)
        self.trainers.save_checkpoint.call(str(staging)).get()
        state = {
            "step": self.step,
            **(self.pending[0].streams_before if self.pending else self._streams()),
            "teacher_rng": _rng_state(self.teacher_rng),
            "teacher_totals": self._teacher_totals(),
            "teacher_counts": self.teacher_counts,
            "pairs": [p.model_dump() for p in self.pairs],
            "dropped_stale": self.dropped_stale,
            "lost_rollouts": self.lost_rollouts,
            "teacher_cache": str(self.run.root / "teacher_cache.jsonl"),
        }
        self.run.commit_checkpoint(staging, self.step, state, self.config.ckpt.keep_last)

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
        self.teacher_totals, self.teacher_counts = state["teacher_totals"], state["teacher_counts"]
        if self.teachers is not None:
            self._carry_teacher_spend()
        self.pairs = [DpoPair.model_validate(p) for p in state["pairs"]]
        self.dropped_stale = state["dropped_stale"]
        self.lost_rollouts = state["lost_rollouts"]
        self.run.keep_metrics_before(self.step)
        self._push_weights(self.step)
        return True

    # ------------------------------------------------------------------ the loop

    def warm_start(self) -> None:
        steps = self.config.trainer.warm_start_steps
        if steps == 0 or self.step > 0:
            return
        demos = self.task.demonstrations(
            random.Random(self.config.seed + 2), steps * self.config.trainer.warm_start_batch_size
        )
        world = self.config.topology.trainer.size
        size = self.config.trainer.warm_start_batch_size
        for i in range(steps):
            chunk = demos[i * size : (i + 1) * size]
            self.trainers.sft_step.call([self.collator(chunk[r::world]).batch for r in range(world)]).get()
        self.trainers.start_rl.call().get()
        self._push_weights(0)

    def train(self, progress: Progress) -> None:
        cfg = self.config
        world = cfg.topology.trainer.size
        level = cfg.generator.max_async_level
        pending = self.pending
        for _ in range(self.step, min(self.step + max(level, 1), cfg.max_steps)):
            pending.append(self._request())
        while self.step < cfg.max_steps:
            step_start = time.perf_counter()
            if not pending:
                pending.append(self._request())
            collected = self._collect(pending.popleft().requests)
            rollouts, gen_seconds = collected.rollouts, collected.seconds
            fresh = [r for r in rollouts if self.step - r.version <= cfg.generator.max_off_policy_steps]
            self.dropped_stale += len(rollouts) - len(fresh)
            if level > 0 and self.step + level < cfg.max_steps:
                pending.append(self._request())
            if not fresh:  # every generator of this step died (or was too stale): ask again
                continue

            advantages = group_advantages(fresh)
            rl = rl_shards(fresh, advantages, cfg.trainer.micro_batch_tokens, self.tokenizer.pad_token_id, world)
            pairs = self.pairs if cfg.loss.replay.weight > 0 else []  # a channel at weight 0 gets no rows
            aux = aux_shards(fresh, pairs, self.collator, world, cfg.loss.sdpo.max_traces_per_step)
            replay_pairs = len(self.pairs)
            self.pairs = []
            train_start = time.perf_counter()
            metrics = self.trainers.train_step.call(rl.shards, aux.shards, rl.tokens).get().item(rank=0)
            train_seconds = time.perf_counter() - train_start
            self.step += 1
            lost = None
            try:
                timings = {"time/weight_sync": self._push_weights(self.step)}
                teacher_stats = self._teacher_round(fresh)
            except HostLost as exc:  # record the step trained before stopping, so resume has no gap
                lost, timings, teacher_stats = exc, {}, {}
            if level == 0 and self.step < cfg.max_steps:
                pending.append(self._request())

            sampled = sum(sum(r.loss_mask) for r in fresh)
            record = {
                "step": self.step - 1,
                "policy_version": self.step,
                "reward/mean": sum(r.reward for r in fresh) / max(1, len(fresh)),
                "rollouts": len(fresh),
                "dropped_stale": self.dropped_stale,
                "lost_rollouts": self.lost_rollouts,
                "generator/respawns": self.generators.replaced,
                "staleness": sum(self.step - 1 - r.version for r in fresh) / max(1, len(fresh)),
                "tool_errors": sum(r.tool_errors for r in fresh),
                "replay_pairs": replay_pairs,
                "truncated": rl.truncated,
                **{k: v for k, v in metrics.items()},
                **{f"collate/{k}": v for k, v in asdict(aux.stats).items()},
                **teacher_stats,
                "rollout_tokens_per_s": sampled / max(gen_seconds, 1e-9),
                "train_tokens_per_s": rl.tokens / max(train_seconds, 1e-9),
                "time/step": time.perf_counter() - step_start,
                "time/generate": gen_seconds,
                "time/train": train_seconds,
                **timings,
            }
            self.run.append_metrics(record)
            progress.update(record, cfg.max_steps)
            if lost is not None:
                raise lost
            if self.step % cfg.ckpt.interval == 0 or self.step == cfg.max_steps:
                self.save()
        while pending:  # rollouts requested past the last step
            self._collect(pending.popleft().requests)


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
        with Progress(config.metrics.progress, start=controller.step) as progress:
            controller.train(progress)
    except HostLost as lost:
        raise controller.stop_for_lost_host(lost) from None
    except SupervisionError as exc:  # generators and teachers are handled where called: a trainer died
        raise controller.trainer_lost(exc) from None
    finally:
        controller.shutdown()
    plot(run.root)
    export_model(run.latest_checkpoint() / "model", run.root / "final", config.model.dtype)
    return run.root
