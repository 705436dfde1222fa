"""The run directory: checkpoints durable before they count as complete, a run directory the
trainer cannot see refused, metrics as strict JSON, one run at a time, and the run's config record
that a resume and `meshrl eval` start from."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshrl.cli.main import EXIT_CONFIG, main
from meshrl.configs import ConfigError, RunConfig, load_config, run_record, to_toml
from meshrl.configs.run_record import ALLOW_CHANGE as ALLOW
from meshrl.configs.run_record import record_changes, resume_config, run_record_of, train_config
from meshrl.run.preflight import preflight
from meshrl.run.run_dir import COMPLETE, RunDir, RunDirBusy
from meshrl.run.stopping import resume_hint

REPO = Path(__file__).resolve().parents[1]


def test_everything_is_fsynced_before_the_complete_marker(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run")
    staging = run.staging(4)
    (staging / "model").mkdir()
    for name in ("model/model.safetensors", "model/tokenizer.json", "trainer.pt"):
        (staging / name).write_bytes(b"x")
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    final = run.commit_checkpoint(staging, 4, {"step": 4}, keep_last=2)
    marker = next(i for i, path in enumerate(synced) if Path(path).name.startswith(f".{COMPLETE}"))
    before = set(synced[:marker])
    for path in [staging / "model" / "model.safetensors", staging / "model" / "tokenizer.json",
                 staging / "trainer.pt", staging / "controller.json", staging / "model", staging]:  # fmt: skip
        assert str(path) in before, path
    assert synced[-1] == str(run.checkpoints)  # the rename that publishes the step, made durable
    assert run.latest_checkpoint() == final


def test_a_run_directory_the_trainer_cannot_see_is_refused(tmp_path):
    run = RunDir(tmp_path / "run")
    run.check_shared(lambda path: Path(path).read_text())  # the same filesystem
    with pytest.raises(RuntimeError, match=f"output_dir {run.root} is not the same directory"):
        run.check_shared(lambda path: None)  # another host's disk: the probe is not there
    assert not list(run.root.glob(".shared-probe-*"))


def test_overwrite_clears_an_earlier_run_but_keeps_the_teacher_cache(tmp_path):
    run = RunDir(tmp_path / "run")
    assert run.earlier_run() == []
    run.commit_checkpoint(run.staging(2), 2, {"step": 2}, keep_last=2)
    run.append_metrics({"step": 0})
    (run.root / "teacher_cache.jsonl").write_text("{}\n")
    assert run.earlier_run() == ["checkpoints: step_2", "metrics.jsonl: 1 steps"]
    run.clear()
    assert run.earlier_run() == [] and (run.root / "teacher_cache.jsonl").exists()


def test_metrics_lines_are_strict_json(tmp_path):
    """A NaN or infinite value is written as null (Python's NaN token is not JSON), and a resume's
    rewrite keeps it so."""
    run = RunDir(tmp_path / "run")
    for step, value in enumerate([float("nan"), float("inf"), 0.5]):
        run.append_metrics({"step": step, "grad_norm": value, "skipped_steps": 1})
    run.keep_records(0, 2)
    refuse = {"parse_constant": lambda token: pytest.fail(f"{token} in metrics.jsonl")}
    lines = [json.loads(line, **refuse) for line in run.metrics_path.read_text().splitlines()]
    assert lines == run.read_metrics() == [{"step": s, "grad_norm": None, "skipped_steps": 1} for s in (0, 1)]


def test_warm_start_records_are_a_phase_of_their_own_kept_as_far_as_the_checkpoint_covers(tmp_path):
    run = RunDir(tmp_path / "run")
    for step in range(4):
        run.append_metrics({"phase": "warm_start", "step": step, "warm_start/loss": 1.0 / (step + 1)})
    for step in range(3):
        run.append_metrics({"step": step, "reward/mean": 0.5})
    assert [r["step"] for r in run.read_metrics()] == [0, 1, 2]  # RL steps, as every reader expects
    assert [r["step"] for r in run.read_metrics("warm_start")] == [0, 1, 2, 3]
    run.keep_records(float("inf"), 1)  # resumed at RL step 1: the whole warm start stays
    assert len(run.read_metrics("warm_start")) == 4 and len(run.read_metrics()) == 1
    run.keep_records(2, 0)  # resumed in the warm start after SFT step 2
    assert [r["step"] for r in run.read_metrics("warm_start")] == [0, 1] and run.read_metrics() == []


def test_a_second_run_in_a_locked_directory_is_refused_naming_the_holder(tmp_path):
    first, second = RunDir(tmp_path / "run"), RunDir(tmp_path / "run")
    first.lock()
    with pytest.raises(RunDirBusy, match=rf"in use by another meshrl run \(pid {os.getpid()}\)"):
        second.lock()
    first.unlock()
    second.lock()  # free again once the holder lets go (or exits)
    second.unlock()


def _recorded_run(tmp_path: Path, *args: str) -> Path:
    """A run directory as `meshrl train` leaves it: its config record and a metrics file."""
    out = tmp_path / "run"
    out.mkdir()
    config = load_config(["@", str(REPO / "configs" / "local.toml"), "--output-dir", str(out), *args])
    (out / "config.toml").write_text(to_toml(config))
    (out / "metrics.jsonl").write_text("")
    return out


def test_resume_starts_from_the_runs_record_and_refuses_changes_that_alter_training(tmp_path):
    out = _recorded_run(tmp_path, "--trainer.lr", "3e-4")
    bare = ["--output-dir", str(out), "--resume"]
    config, changes = resume_config(load_config(bare), bare, allow_change=False)
    assert config.trainer.lr == 3e-4 and config.teachers.members and config.task.kwargs["guess_rate"] == 0.5
    assert changes == {}  # the preset forgotten: nothing changes
    more = [*bare, "--max-steps", "90", "--metrics.tensorboard"]
    config, changes = resume_config(load_config(more), more, allow_change=False)
    assert config.max_steps == 90 and changes == {"max_steps": (60, 90), "metrics.tensorboard": (False, True)}
    changed = [*bare, "--trainer.lr", "1e-4", "--task.kwargs", "{}"]
    with pytest.raises(ConfigError) as refused:
        resume_config(load_config(changed), changed, allow_change=False)
    assert "trainer.lr 0.0001 (the run's: 0.0003)" in str(refused.value) and "task.kwargs {}" in str(refused.value)
    assert "--allow-config-change" in str(refused.value)
    config, changes = resume_config(load_config(changed), changed, allow_change=True)
    assert config.trainer.lr == 1e-4 and set(changes) == {"trainer.lr", "task.kwargs"}
    # Recorded, the changes are part of the run's config from then on; config.toml is untouched.
    record_changes(out, changes, "step_20")
    config, changes = resume_config(load_config(bare), bare, allow_change=False)
    assert config.trainer.lr == 1e-4 and config.task.kwargs == {} and changes == {}
    assert load_config(["@", str(out / "config.toml")]).trainer.lr == 3e-4
    entry = json.loads((out / "config_changes.jsonl").read_text())
    assert entry["resumed_from"] == "step_20" and entry["changes"]["trainer.lr"] == {"was": 3e-4, "now": 1e-4}


def _resume(out: Path, *extra: str) -> RunConfig:
    """A resume as `meshrl train` makes it from the command a stopped run prints, `extra` on top:
    its config, its changes recorded as the run records them."""
    config, changes = train_config([*shlex.split(resume_hint(out))[2:], *extra])
    record_changes(out, changes, "step_20")
    return config


def _eval_config(out: Path, monkeypatch) -> RunConfig:
    """The config `meshrl eval --checkpoint RUN` scores the run's checkpoint with."""
    seen: list[RunConfig] = []

    def evaluate(config: RunConfig, checkpoint: str, out: Path | None) -> SimpleNamespace:
        seen.append(config)
        return SimpleNamespace(prompts=0, k=0, metrics=dict)

    monkeypatch.setattr("meshrl.run.evaluate.evaluate_checkpoint", evaluate)
    assert main(["eval", "--checkpoint", str(out)]) == 0
    return seen[0]


def test_a_run_started_with_overwrite_resumes_with_the_command_meshrl_prints(tmp_path):
    out = _recorded_run(tmp_path, "--overwrite")  # the usual way to rerun into a directory
    assert "overwrite" not in (out / "config.toml").read_text()  # a flag of that invocation, not of the run
    assert _resume(out).max_steps == 60
    # A record an earlier meshrl wrote holds the flag: it is not replayed.
    (out / "config.toml").write_text("overwrite = true\n" + (out / "config.toml").read_text())
    config = _resume(out)
    assert config.resume and not config.overwrite and not (out / "config_changes.jsonl").exists()


def test_resumes_that_change_task_kwargs_replay_to_the_kwargs_the_run_used(tmp_path, monkeypatch):
    out = _recorded_run(tmp_path)
    toy = load_config(["@", str(REPO / "configs" / "local.toml")]).task.kwargs
    one = _resume(out, "--task.kwargs.n_keys", "2", ALLOW)  # merges over the run's kwargs
    assert one.task.kwargs == {**toy, "n_keys": "2"}
    two = _resume(out, "--task.kwargs", "{}", "--task.kwargs.max_turns", "2", ALLOW)  # cleared, then one key
    assert two.task.kwargs == {"max_turns": "2"}
    # each recorded change replays to what that resume trained with, twice over
    assert _resume(out).task.kwargs == {"max_turns": "2"} == _eval_config(out, monkeypatch).task.kwargs
    # another factory (the same toy by its dotted name) with the kwargs the run has: recorded with it
    three = _resume(out, "--task.import_path", "meshrl.tasks.toy.ToolTask", "--task.kwargs.max_turns", "2", ALLOW)
    assert three.task.kwargs == {"max_turns": "2"} == _resume(out).task.kwargs
    assert len((out / "config_changes.jsonl").read_text().splitlines()) == 3


def test_a_resume_with_the_command_that_started_the_run_changes_nothing(tmp_path):
    out = tmp_path / "run"
    command = ["@", str(REPO / "configs" / "local.toml"), "--task.kwargs.n_keys", "2", "--output-dir", str(out)]
    config, _ = train_config(command)
    preflight(config)  # checks the kwargs against the toy's signature; the record keeps them as given
    out.mkdir()
    (out / "config.toml").write_text(to_toml(config))
    (out / "metrics.jsonl").write_text("")
    resumed, changes = train_config([*command, "--resume"])
    assert changes == {} and resumed.task.kwargs["n_keys"] == "2"


def test_resumes_that_swap_the_loss_replay_to_the_config_the_run_used(tmp_path, monkeypatch):
    out = _recorded_run(tmp_path, "--loss.kl-tau", "0.01")
    with pytest.raises(ConfigError, match=r"loss \{"):  # the recipe as a whole, refused without the flag
        _resume(out, "--loss.type", "ipo")
    ipo = _resume(out, "--loss.type", "ipo", "--loss.ipo-threshold", "0.3", ALLOW)
    # What both recipes take carries over from the run; the other recipe's knobs do not.
    assert ipo.loss.type == "ipo" and ipo.loss.ipo_threshold == 0.3 and ipo.loss.kl_tau == 0.01
    assert ipo.loss.replay.weight == 0.1 and ipo.loss.sdpo.weight == 0.05
    entry = json.loads((out / "config_changes.jsonl").read_text())
    assert set(entry["changes"]) == {"loss"} and entry["changes"]["loss"]["now"]["type"] == "ipo"
    assert _resume(out) == ipo  # the printed command: no change, nothing recorded
    assert _resume(out, "--loss.ipo-threshold", "0.4", ALLOW).loss.ipo_threshold == 0.4  # the run's recipe's knob
    tis = _resume(out, "--loss.type", "tis", "--loss.cap", "1.5", ALLOW)
    assert tis.loss.type == "tis" and tis.loss.cap == 1.5 and tis.loss.kl_tau == 0.01
    assert _resume(out) == tis and len((out / "config_changes.jsonl").read_text().splitlines()) == 3
    assert _eval_config(out, monkeypatch).loss == tis.loss


def test_a_resume_that_turns_lora_off_replays_and_one_that_turns_it_on_again_is_refused(tmp_path, monkeypatch, capsys):
    """Turning adapters on over a run's trained full weights is refused before anything is recorded,
    in one line naming model.lora and the way out: HF generators and outside workers hold the base
    from model.path and get only the adapters (it was recorded, and the trainer could not load)."""
    out = _recorded_run(tmp_path, "--model.lora", '{"r": 8, "lora_alpha": 16}')
    with pytest.raises(ConfigError, match=r"model.lora null \(the run's: \{"):
        _resume(out, "--model.lora", "null")
    off = _resume(out, "--model.lora", "null", ALLOW)
    assert off.model.lora is None
    entry = json.loads((out / "config_changes.jsonl").read_text())
    assert entry["changes"] == {"model.lora": {"was": {"r": 8, "lora_alpha": 16.0, "lora_dropout": 0.0,
                                                       "target_modules": "all-linear"}, "now": None}}  # fmt: skip
    assert _resume(out) == off and _eval_config(out, monkeypatch).model.lora is None
    capsys.readouterr()
    assert main(["train", "--output-dir", str(out), "--resume", "--model.lora.r", "4", ALLOW]) == EXIT_CONFIG
    refusal = capsys.readouterr().err
    assert refusal.count("\n") == 1 and "model.lora cannot be turned on" in refusal
    assert f"meshrl export {out} DIR" in refusal and "--model.path DIR --model.lora" in refusal
    assert len((out / "config_changes.jsonl").read_text().splitlines()) == 1  # nothing recorded
    assert _resume(out) == off  # the command meshrl prints still continues the run


def test_an_island_cannot_turn_its_adapters_off_on_resume(tmp_path):
    """The islands' DiLoCo outer state is the adapters alone, and the other islands go on averaging
    adapters: an island resumed without them is refused, naming it, before anything is recorded."""
    out = _recorded_run(tmp_path, "--model.lora", '{"r": 8}', "--trainer.diloco.replica_id", "a",
                        "--trainer.diloco.lighthouse", "http://localhost:29510")  # fmt: skip
    with pytest.raises(ConfigError, match=r"model.lora cannot be turned off for island 'a'"):
        _resume(out, "--model.lora", "null", ALLOW)
    assert not (out / "config_changes.jsonl").exists()


def test_a_resumes_changes_are_recorded_once_its_checkpoint_is_restored(tmp_path, monkeypatch):
    """A restore that fails (a checkpoint the changed config cannot continue) leaves the run's config as
    it was: the changes were recorded before the trainers loaded the checkpoint."""
    from meshrl.run import controller

    def failing(why: str) -> Callable[..., None]:
        def fail(*args: object) -> None:
            raise RuntimeError(why)

        return fail

    out = _recorded_run(tmp_path)
    monkeypatch.setattr(controller.Controller, "spawn", lambda self: None)  # no meshes
    monkeypatch.setattr(controller.Controller, "restore", failing("restore failed"))
    config, changes = train_config(["--output-dir", str(out), "--resume", "--trainer.lr", "1e-4", ALLOW])
    with pytest.raises(RuntimeError, match="restore failed"):
        controller.train(config, changes)
    assert not (out / "config_changes.jsonl").exists()
    monkeypatch.setattr(controller.Controller, "restore", lambda self: None)  # restored, then training fails
    monkeypatch.setattr(controller.Controller, "train", failing("step failed"))
    with pytest.raises(RuntimeError, match="step failed"):
        controller.train(config, changes)
    assert set(json.loads((out / "config_changes.jsonl").read_text())["changes"]) == {"trainer.lr"}


@pytest.mark.parametrize(
    ("recorded", "refusal"),
    [
        ({"model.lora.r": (8, None)}, r"\(this resume's line\): model\.lora\.r: Input should be a valid integer"),
        ({}, r"the change would replay to another config \(model\.lora\); nothing was recorded"),
    ],
    ids=["per-field-nulls", "forgotten"],
)
def test_a_change_whose_record_would_not_replay_is_refused(tmp_path, monkeypatch, recorded, refusal):
    """A record the diff got wrong (as lora's removal once was: per-field nulls) stops the resume
    before the run starts and records it."""
    out = _recorded_run(tmp_path, "--model.lora", '{"r": 8}')
    real, wrong = run_record.changed, [recorded]
    monkeypatch.setattr(run_record, "changed", lambda *diffed: wrong.pop() if wrong else real(*diffed))
    with pytest.raises(ConfigError, match=refusal):
        _resume(out, "--model.lora", "null", ALLOW)


def test_export_casts_to_the_dtype_a_resume_changed(tmp_path, monkeypatch):
    from meshrl.run import export

    out = _recorded_run(tmp_path)
    _resume(out, "--model.dtype", "bfloat16", ALLOW)
    RunDir(out).commit_checkpoint(RunDir(out).staging(20), 20, {"step": 20}, keep_last=1)
    cast: list[str] = []
    monkeypatch.setattr(export, "export_model", lambda source, to, dtype: cast.append(dtype) or to)
    export.export_run(out, tmp_path / "exported")
    assert cast == ["bfloat16"]


def test_eval_finds_the_config_of_the_run_a_checkpoint_belongs_to(tmp_path):
    out = _recorded_run(tmp_path)
    (out / "checkpoints" / "step_4" / "model").mkdir(parents=True)
    (out / "final").mkdir()
    for path in (out, out / "checkpoints" / "step_4", out / "final"):
        assert run_record_of(path) == (out / "config.toml").resolve()
    assert run_record_of(tmp_path) is None
