"""The run controller (the `meshrl train` process): the step loop, composed of one collaborator
per concern (docs/concepts/step.md tells the step; each module says what it owns):

- `Meshes` (run/meshes.py): placing and spawning the meshes, replacing a dead rank, lost hosts;
- `RolloutFeed` (run/feed.py): the groups each step trains on, from the generators and the
  ingress lane (run/ingress_lane.py); prompt streams in `GroupStreams` (run/streams.py);
- `WeightPublisher` (run/weights.py): each policy version to the generators and the ingress;
- `TeacherRounds` (run/teachers.py): states to the teachers, answers mined into replay pairs;
- `BackgroundEval` (run/evaluate.py): evaluation rounds beside training;
- `Checkpointer` (run/checkpointer.py) and `warm_start` (run/warm_start.py);
- `step_record` and `Timeline` (run/record.py): what a step leaves in metrics.jsonl and timeline.jsonl.

Faults: a dead generator or teacher is replaced on its host (a generator with the current
weights) and its in-flight work is dropped and counted. A dead trainer process or a lost worker
host stops the run with `RunStopped`, after a checkpoint when the trainers can still take one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from meshrl.configs.loader import ConfigError, to_toml
from meshrl.configs.run_record import record_changes
from meshrl.configs.schema import RefKlLoss, RunConfig
from meshrl.ingress.server import IngressServer
from meshrl.models.resolve import resolve_model
from meshrl.rollouts.advantages import group_advantages
from meshrl.rollouts.batches import aux_shards, rl_shards
from meshrl.rollouts.chat import ChatSettings, make_chat
from meshrl.run.checkpointer import Checkpointer
from meshrl.run.evaluate import BackgroundEval
from meshrl.run.export import export_model
from meshrl.run.feed import RolloutFeed
from meshrl.run.generator_lane import GeneratorLane
from meshrl.run.ingress_lane import start_ingress
from meshrl.run.meshes import Meshes
from meshrl.run.plots import plot
from meshrl.run.progress import Progress
from meshrl.run.record import StepFacts, StepTimes, Timeline, step_record
from meshrl.run.run_dir import WARM_START, RunDir, write_atomic
from meshrl.run.sinks import MetricSinks
from meshrl.run.stopping import RunInterrupted, StopSignals
from meshrl.run.streams import GroupStreams
from meshrl.run.teachers import TeacherRounds, offline_states
from meshrl.run.warm_start import sft_steps
from meshrl.run.weights import WeightPublisher
from meshrl.sandbox.core import SandboxUnavailable
from meshrl.tasks.base import Grading, make_task, task_tools
from meshrl.topology.faults import HostLost, RunStopped, SupervisionError
from meshrl.traces.collator import TraceCollator


class Controller:
    """Builds what needs no mesh at once (model files, tokenizer, task, collator, streams): a bad
    config or trace file is refused before any process starts; `spawn` adds the rest."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.task = make_task(config.task)
        if config.teachers.agree_by == "outcome" and not isinstance(self.task, Grading):
            raise ValueError(f"teachers.agree_by = 'outcome': the task {config.task.import_path} says nothing of "
                             f"what an action does (no action_outcome); use 'text'")  # fmt: skip
        self.run = RunDir(config.output_dir)
        self.model_path = resolve_model(config, self.run.root)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if config.model.lora is not None:  # adapters whose merged weights cannot be built are refused here
            from meshrl.trainer.lora import lora_plan

            lora_plan(self.model_path, config.model.lora)
        self.chat = ChatSettings.of(config.model)
        tools = task_tools(self.task)
        self.collator = TraceCollator(
            self.tokenizer, hint_generator=getattr(self.task, "hint", None) if config.loss.sdpo.weight > 0 else None,
            tools=tools, template_kwargs=self.chat.template_kwargs, chat_template=self.chat.chat_template,
            max_seq_len=config.trainer.micro_batch_tokens,
            sampled_format=make_chat(self.tokenizer, self.chat, tools),  # one that would fail mid-run is refused here
        )  # fmt: skip
        if config.trainer.warm_start_steps or config.task.traces:
            self.collator.turn_markers  # noqa: B018 - traces without sampled ids need them: refused here, not mid-run
        self.offline_states = offline_states(config, self.tokenizer, self.collator)
        self.streams = GroupStreams(config, self.task)
        self.timeline = Timeline()
        self.evaluator = BackgroundEval(config, self.model_path) if config.eval.interval else None
        self.ingress: IngressServer | None = None
        self.meshes: Meshes | None = None
        self.step = 0

    def spawn(self) -> None:
        """The meshes, the ingress (when `ingress.bind` is set), and the collaborators that use them."""
        cfg = self.config
        roles = [f"{cfg.topology.generator.size} generator(s)", f"{cfg.topology.trainer.size} trainer(s)"]
        roles += [f"{cfg.topology.teacher.size} teacher actor(s)"] if cfg.teachers.members else []
        print(f"meshrl: starting the meshes ({', '.join(roles)}: each loads the model)", flush=True)
        began = time.perf_counter()
        self.meshes = meshes = Meshes(cfg, self.model_path, self.run)
        print(f"meshrl: meshes up in {time.perf_counter() - began:.0f} s", flush=True)
        if cfg.ingress.bind is not None:
            self.ingress = start_ingress(cfg, self.model_path, self.tokenizer, self.chat, self.run.root / "ingress")
        self.weights = WeightPublisher(cfg, self.run, meshes, self.ingress)
        self.generators = GeneratorLane(meshes.generators, meshes.generator_alive, self.weights)
        self.weights.on_dead = self.generators.died  # a generator found dead while its load settles
        self.weights.on_failed = self.generators.failed  # one whose load raised (its engine refuses to sample)
        self.feed = RolloutFeed(cfg, self.streams, self.generators, self.ingress, self.timeline)
        grading = self.task if cfg.teachers.agree_by == "outcome" else None
        self.teachers = TeacherRounds(cfg, meshes, self.offline_states, self.timeline, grading)
        self.checkpointer = Checkpointer(cfg, self.run, meshes.trainers, self.timeline)

    def shutdown(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
        if self.ingress is not None:
            self.ingress.close()
        if self.meshes is not None:
            self.meshes.shutdown()
        self.run.prune_weights()  # published weights are only for the generators just stopped

    # ------------------------------------------------------------------ the loop

    def train(self, progress: Progress, sinks: MetricSinks, stop: StopSignals) -> None:
        """Steps to `max_steps`, or until a stop signal: then a checkpoint of the last step done."""
        self.weights.publish_ingress(self.step)  # no warm start and no resume: the initial weights
        while self.step < self.config.max_steps:
            record, lost = self._step()
            self.run.append_metrics(record)
            sinks.log(record)
            progress.update(record, self.config.max_steps)
            if lost is not None:
                raise lost
            self.checkpointer.commit(wait=False)
            stopping = stop.received is not None
            if self.step % self.config.ckpt.interval == 0 or self.step == self.config.max_steps or stopping:
                self.save()
            self.run.append_timeline({"step": self.step - 1, "spans": self.timeline.take()})
            if stopping:
                break
        self.checkpointer.commit(wait=True)

    def _step(self) -> tuple[dict[str, Any], HostLost | None]:
        """One step: its rollouts, the trainers' step on them and the replay/SDPO rows, the new
        weights published, a teacher and an evaluation round; its record, and the lost host that
        stopped it after the trainers stepped (so resume has no gap)."""
        cfg, world, step = self.config, self.config.topology.trainer.size, self.step
        start = time.perf_counter()
        collected = self.feed.collect(step)
        waited = time.perf_counter() - start
        fresh = collected.fresh
        self.streams.observe(step, fresh)
        rl = rl_shards(fresh, group_advantages(fresh), cfg.trainer.micro_batch_tokens, self.tokenizer.pad_token_id,
                       world, keep_zero_advantage=isinstance(cfg.loss, RefKlLoss),
                       mask_truncated=cfg.trainer.mask_truncated_completions,
                       mask_budget_ended=cfg.trainer.mask_budget_ended_episodes,
                       count_zero_advantage=cfg.trainer.zero_advantage_tokens == "count")  # fmt: skip
        mined = self.teachers.take_pairs()
        pairs = mined if cfg.loss.replay.weight > 0 else []  # a channel at weight 0 gets no rows
        aux = aux_shards(fresh, pairs, self.collator, world, cfg.loss.sdpo.max_traces_per_step)
        train_start, train_wall = time.perf_counter(), time.time()
        trainer = self.meshes.trainers.train_step.call(rl.shards, aux.shards, rl.normaliser).get().item(rank=0)
        train_seconds = time.perf_counter() - train_start
        self.timeline.add("trainer", train_wall, time.time(), step)
        self.step += 1
        lost, sync, teacher_stats, eval_stats = None, None, {}, {}
        try:
            publish_wall = time.time()
            sync = self.weights.publish(self.step)
            self.timeline.add("weights", publish_wall, time.time(), step)
            teacher_stats = self.teachers.round(fresh, step)
            eval_stats = self._eval_round()
        except HostLost as exc:
            lost, sync, teacher_stats, eval_stats = exc, None, {}, {}
        groups, refill = collected.request.groups, collected.refill
        facts = StepFacts(
            step=step, fresh=fresh, uninformative=refill.uninformative, refilled=refill.extra,
            replaced=[r for g in refill.replaced for r in g.rollouts], refill_on=cfg.generator.refill_uninformative > 0,
            max_off_policy_steps=cfg.generator.max_off_policy_steps, think_end=self.collator.think_end,
            counters=self.feed.counters(), respawns=self.meshes.generators.replaced, replay_pairs=len(mined),
            rl=rl, trainer=trainer, collate=aux.stats, teachers=teacher_stats, evaluation=eval_stats,
            ingress=self.ingress.stats() if self.ingress is not None else None,
            times=StepTimes(step=time.perf_counter() - start,
                            generate=max(g.finished for g in groups) - min(g.started for g in groups),
                            wait_rollouts=waited, train=train_seconds, weight_sync=sync),
        )  # fmt: skip
        return {**step_record(facts), **self.streams.stage_metrics(step)}, lost

    def _eval_round(self) -> dict[str, float]:
        if self.evaluator is None:
            return {}
        return self.evaluator.round(self.step, lambda: self.meshes.trainer_value("policy_weights"))

    # ------------------------------------------------------------------ start, checkpoints, stops

    def warm_start(self, sinks: MetricSinks, stop: StopSignals, start: int = 0) -> bool:
        """The demonstrations' SFT steps (from `start` when a warm start resumes), shown, recorded and
        checkpointed as RL steps are; then the trainers turn to RL and version 0 goes to the
        generators. False: a stop signal ended it, after a checkpoint of the last step done."""
        steps = self.config.trainer.warm_start_steps
        if not steps:
            return True
        with Progress(self.config.metrics.progress, start=start, label="warm start") as progress:
            for record in sft_steps(self.config, self.task, self.tokenizer, self.collator, self.meshes.trainers, start):
                self.run.append_metrics(record)
                sinks.log(record)
                progress.update(record, steps)
                done = record["step"] + 1
                self.checkpointer.commit(wait=False)
                if stop.received is not None or (done % self.config.ckpt.interval == 0 and done < steps):
                    self.checkpointer.save(done, {}, WARM_START)
                if stop.received is not None:
                    self.checkpointer.commit(wait=True)
                    return False
        self.meshes.trainers.start_rl.call().get()
        self.weights.publish(0, wait=True)
        return True

    def save(self) -> None:
        """A checkpoint after the current step, with what each collaborator needs to resume exactly."""
        state = {
            **self.feed.state(),
            **self.teachers.state(),
            "teacher_cache": str(self.run.root / "teacher_cache.jsonl"),
            "ingress": self.ingress.state() if self.ingress is not None else {},
        }
        self.checkpointer.save(self.step, state)

    def restore(self) -> int | None:
        """Where the run starts: with `resume`, the newest RL checkpoint (returns None: the warm start
        is done), else the warm start's newest checkpoint (returns its SFT step), else the start
        (returns 0). Only the records of the steps it starts after are kept."""
        state = self.checkpointer.resume() if self.config.resume else None
        if state is not None:
            self.step = state["step"]
            self.feed.restore(state)
            self.teachers.restore(state)
            if self.ingress is not None:
                self.ingress.restore(state.get("ingress", {}))
            self.run.keep_records(float("inf"), self.step)
            self.weights.publish(self.step, wait=True)
            print(f"resuming {self.run.root} from {self.run.latest_checkpoint()} (step {self.step})", flush=True)
            return None
        warm = self.checkpointer.resume(WARM_START) if self.config.resume else None
        if warm is not None:
            print(f"resuming {self.run.root}'s warm start from {self.run.latest_checkpoint(WARM_START)} "
                  f"(SFT step {warm['step']} of {self.config.trainer.warm_start_steps})", flush=True)  # fmt: skip
        elif self.config.resume:
            print(f"no complete checkpoint in {self.run.checkpoints}; starting from step 0", flush=True)
        start = warm["step"] if warm is not None else 0
        self.run.keep_records(start, 0)
        return start

    def stop_for_lost_host(self, lost: HostLost) -> RunStopped:
        """Checkpoint if the trainers still can, and say which host was lost and where to resume."""
        self.meshes.host_lost(lost)
        latest = self.run.latest_checkpoint()
        try:
            self.checkpointer.commit(wait=True)  # the write in flight may be this very step's
            latest = self.run.latest_checkpoint()
            if latest is None or latest.name != f"step_{self.step}":
                self.save()
                self.checkpointer.commit(wait=True)
            saved = f"Saved checkpoint step {self.step};"
        except SupervisionError as exc:  # the trainers were on that host too
            saved = f"no checkpoint could be taken ({exc}); newest complete: {latest.name if latest else 'none'};"
        return RunStopped(
            f"worker host {lost.host} is lost ({lost.role} rank {lost.rank}; {lost.why}). {saved} "
            "start `meshrl worker` there again and rerun with --resume."
        )


def train(config: RunConfig, changes: dict[str, Any] | None = None) -> Path:
    """Run (or resume) training; returns the run directory. `changes`: what a resume changed in
    the run's config (recorded beside it). The first SIGINT/SIGTERM stops the run after the step in
    flight with a checkpoint (`RunInterrupted`), unless that step was the last: the run is complete and
    exported; a second stops it at once (`StopNow`)."""
    fresh_dir = not Path(config.output_dir).exists()
    run = RunDir(config.output_dir)
    run.lock()
    try:
        controller = starting(config, run, fresh_dir)
        if not (config.resume and run.record.exists()):
            write_atomic(run.record, to_toml(config))  # how the run started; a resume only appends its changes
        with StopSignals() as stop:
            running(controller, stop, changes or {})
        plot(run.root)
        if stop.received is not None and controller.step < config.max_steps:  # one in the last step: complete
            if run.latest_checkpoint() is None:  # stopped in the warm start
                warm = run.latest_checkpoint(WARM_START)
                where = f"in the warm start, after SFT step {warm.name.rpartition('_')[2] if warm else 0} of {config.trainer.warm_start_steps}"
                raise RunInterrupted(run.root, where, warm)
            raise RunInterrupted(
                run.root, f"after step {controller.step} of {config.max_steps}", run.latest_checkpoint()
            )
        export_model(run.latest_checkpoint() / "model", run.root / "final", config.model.dtype)
        return run.root
    finally:
        run.unlock()


def starting(config: RunConfig, run: RunDir, fresh_dir: bool) -> Controller:
    """The controller, or a refusal in one line: what fails here (an earlier run in the directory, a
    tokenizer, a chat template, a task, a sandbox) fails before any mesh is spawned, and leaves no
    run directory where there was none."""
    try:
        if config.overwrite:
            run.clear()
        elif not config.resume and run.earlier_run():
            raise ConfigError(
                f"output_dir {run.root} holds an earlier run ({'; '.join(run.earlier_run())}): pass --resume to "
                "continue it, --overwrite to start over there, or choose another --output-dir"
            )
        return Controller(config)
    except BaseException as exc:
        if fresh_dir:
            run.remove()
        if isinstance(exc, ValueError | OSError | SandboxUnavailable) and not isinstance(exc, ConfigError):
            raise ConfigError(str(exc)) from None
        raise


def running(controller: Controller, stop: StopSignals, changes: dict[str, Any]) -> None:
    """Spawn the meshes (their processes ignore Ctrl-C: it reaches the whole process group), resume or
    warm start, train; the meshes are stopped however it ends. A resume's config `changes` are recorded
    once its checkpoint is restored: a restore that fails leaves the run's config as it was."""
    config, run = controller.config, controller.run
    try:
        controller.spawn()
        warm_from = controller.restore()
        latest = run.latest_checkpoint()
        record_changes(run.root, changes, latest.name if config.resume and latest else None)
        warm_steps = config.trainer.warm_start_steps
        purge_from = controller.step if warm_from is None else warm_from - warm_steps
        sinks = MetricSinks(config, run.root, purge_from if config.resume else None)
        try:
            if warm_from is None or controller.warm_start(sinks, stop, warm_from):
                with Progress(config.metrics.progress, start=controller.step) as progress:
                    controller.train(progress, sinks, stop)
        finally:
            sinks.close()
    except HostLost as lost:
        raise controller.stop_for_lost_host(lost) from None
    except SupervisionError as exc:  # generators and teachers are handled where called: a trainer died
        raise controller.meshes.trainer_lost(exc) from None
    finally:
        controller.shutdown()
