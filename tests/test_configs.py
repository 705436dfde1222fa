"""Run-config schema and loader: composition, override forms, errors, bounds, round trip."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from meshrl.configs import (
    ConfigError,
    CustomLoss,
    DppoKlLoss,
    IpoLoss,
    MisLoss,
    RefKlLoss,
    RunConfig,
    TisLoss,
    load_config,
    to_toml,
)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
LOCAL = CONFIGS / "local.toml"
PRESETS = sorted(CONFIGS.glob("*.toml"))


def _error(args: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(args)
    return str(info.value)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- defaults


def test_presets_are_found():
    names = {p.name for p in PRESETS}
    assert {"local.toml", "dppo_kl.toml", "ipo.toml", "ref_kl.toml", "custom.toml", "simpo.toml", "tis.toml",
            "mis.toml"} <= names  # fmt: skip


def test_defaults_validate():
    config = load_config([])
    assert config == RunConfig()
    assert load_config(None) == RunConfig()
    assert isinstance(config.loss, DppoKlLoss)
    assert config.loss.type == "dppo_kl"
    assert config.max_steps == 100
    assert config.topology.mode == "local"
    assert config.loss.sdpo.token_clip is None


# --------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(
    "key",
    [
        "no_such_key",
        "model.no_such_key",
        "model.tiny.no_such_key",
        "topology.generator.no_such_key",
        "generator.no_such_key",
        "trainer.no_such_key",
        "loss.no_such_key",
        "loss.replay.no_such_key",
        "loss.sdpo.no_such_key",
        "teachers.no_such_key",
        "task.no_such_key",
        "ckpt.no_such_key",
        "metrics.no_such_key",
    ],
)
def test_unknown_keys_refused_with_dotted_key(key):
    message = _error([f"--{key}", "3"])
    assert f"unknown key '{key}'" in message
    assert "command line" in message


@pytest.mark.parametrize("loss_type", ["ipo", "ref_kl", "custom"])
def test_unknown_loss_key_refused_under_every_type(loss_type):
    args = ["--loss.type", loss_type, "--loss.no_such_key", "1"]
    if loss_type == "custom":
        args += ["--loss.import_path", "pkg.mod:fn"]
    assert "unknown key 'loss.no_such_key'" in _error(args)


@pytest.mark.parametrize(
    "member",
    [
        '{"backend": "hf", "name": "a", "path": "/m", "bogus": 1}',
        '{"backend": "openai", "name": "o", "base_url": "http://x/v1", "model": "m", "bogus": 1}',
        '{"backend": "oracle", "bogus": 1}',
    ],
)
def test_unknown_teacher_member_key_refused(member):
    message = _error(["--teachers.members", f"[{member}]"])
    assert "unknown key 'teachers.members.0.bogus'" in message


def test_unknown_key_in_toml_names_file_and_key(tmp_path):
    preset = _write(tmp_path, "extra.toml", "[model.tiny]\nwidth = 3\n")
    message = _error(["@", str(preset)])
    assert str(preset) in message
    assert "model.tiny.width" in message


def test_schema_forbids_extra_directly():
    with pytest.raises(ValidationError):
        RunConfig.model_validate({"bogus": 1})
    with pytest.raises(ValidationError):
        RunConfig.model_validate({"loss": {"type": "ipo", "dppo_mask_low": 0.1}})


def test_sections_validate_assignment():
    config = RunConfig()
    with pytest.raises(ValidationError):
        config.generator.top_p = 2.0
    with pytest.raises(ValidationError):
        config.max_steps = 0


# --------------------------------------------------------------------------- composition


def test_composition_order(tmp_path):
    a = _write(
        tmp_path,
        "a.toml",
        'max_steps = 10\nseed = 1\n[trainer]\nlr = 0.5\nwarmup_steps = 7\n[loss.replay]\nweight = 0.3\nvariant = "simpo"\n',
    )
    b = _write(tmp_path, "b.toml", "max_steps = 20\n[trainer]\nlr = 0.25\n[loss.replay]\nweight = 0.4\n")
    only_a = load_config(["@", str(a)])
    assert (only_a.max_steps, only_a.seed, only_a.trainer.lr) == (10, 1, 0.5)
    both = load_config(["@", str(a), "@", str(b)])
    assert both.max_steps == 20  # B over A
    assert both.seed == 1  # A over defaults
    assert both.trainer.lr == 0.25
    assert both.trainer.warmup_steps == 7  # deep merge keeps A's other keys of the table
    assert both.loss.replay.weight == 0.4
    assert both.loss.replay.variant == "simpo"
    assert both.trainer.weight_decay == 0.0  # default survives
    reversed_order = load_config(["@", str(b), "@", str(a)])
    assert reversed_order.max_steps == 10 and reversed_order.trainer.lr == 0.5
    cli = load_config(["@", str(a), "@", str(b), "--max_steps", "30", "--trainer.lr", "0.125"])
    assert cli.max_steps == 30 and cli.trainer.lr == 0.125 and cli.trainer.warmup_steps == 7


def test_later_overrides_win():
    config = load_config(["--seed", "1", "--seed", "2", "--loss.kl_tau=0.5", "--loss.kl-tau", "0.25"])
    assert config.seed == 2
    assert config.loss.kl_tau == 0.25


def test_override_before_preset_is_overridden_by_preset():
    config = load_config(["--max_steps", "5", "@", str(LOCAL)])
    assert config.max_steps == 60


def test_local_preset_values():
    """The embedded default: local mesh, tiny model, built-in task, all three channels live."""
    config = load_config(["@", str(LOCAL)])
    assert config.max_steps == 60
    assert config.model.path == "tiny" and config.topology.mode == "local"
    assert config.task.import_path == "meshrl.tasks.toy:ToolTask"
    assert config.loss.replay.weight == 0.1
    assert config.loss.sdpo.weight == 0.05
    assert config.teachers.members and config.trainer.warm_start_steps > 0


def test_simpo_preset_over_local_keeps_loss_type():
    config = load_config(["@", str(LOCAL), "@", str(CONFIGS / "simpo.toml")])
    assert isinstance(config.loss, DppoKlLoss)
    assert config.loss.replay.variant == "simpo"
    assert config.loss.replay.beta == 2.0
    assert config.loss.sdpo.weight == 0.05  # from local.toml


def test_loss_preset_over_local_swaps_recipe_and_keeps_channels():
    config = load_config(["@", str(LOCAL), "@", str(CONFIGS / "ipo.toml")])
    assert isinstance(config.loss, IpoLoss)
    assert config.loss.replay.weight == 0.1
    assert config.loss.sdpo.weight == 0.05


# --------------------------------------------------------------------------- override forms


def test_space_and_equals_forms_agree():
    assert load_config(["--generator.temperature", "0.5"]) == load_config(["--generator.temperature=0.5"])
    assert load_config(["--generator.temperature=0.5"]).generator.temperature == 0.5


def test_kebab_case_override_equals_snake_case():
    kebab = load_config(["--loss.kl-tau", "0.01"])
    snake = load_config(["--loss.kl_tau", "0.01"])
    assert kebab == snake
    assert kebab.loss.kl_tau == 0.01
    assert load_config(["--model.tiny.hidden-size=128"]).model.tiny.hidden_size == 128
    assert load_config(["--output-dir", "x/y"]).output_dir == "x/y"


def test_kebab_case_keys_in_toml(tmp_path):
    preset = _write(tmp_path, "kebab.toml", "max-steps = 7\n[loss]\nkl-tau = 0.02\n[model.tiny]\nnum-heads = 8\n")
    config = load_config(["@", str(preset)])
    assert config.max_steps == 7
    assert config.loss.kl_tau == 0.02
    assert config.model.tiny.num_heads == 8


def test_json_list_and_dict_values():
    config = load_config(
        ["--topology.mode", "attach", "--topology.workers", '["tcp://h:1", "tcp://g:2"]', "--task.kwargs", '{"n": 3}']
    )
    assert config.topology.workers == ["tcp://h:1", "tcp://g:2"]
    assert config.task.kwargs == {"n": 3}
    assert load_config(["--trainer.betas=[0.8, 0.9]"]).trainer.betas == (0.8, 0.9)


def test_malformed_json_value_errors():
    assert "does not parse" in _error(["--topology.workers", '["tcp://h:1"'])


def test_bare_flag_means_true():
    assert load_config(["--resume"]).resume is True
    config = load_config(["--resume", "--seed", "3"])
    assert config.resume is True and config.seed == 3
    assert load_config(["--resume", "false"]).resume is False
    assert load_config(["--metrics.tensorboard"]).metrics.tensorboard is True


def test_bare_flag_followed_by_preset():
    # exposes bug: a bare `--flag` swallows a following `@ preset` word as its value
    # (loader.py parse_sources, line 114 only treats `--` words as the next source), so
    # `--resume @ configs/local.toml` fails with "unexpected argument 'configs/local.toml'"
    # and `--resume @configs/local.toml` fails with "resume: Input should be a valid boolean".
    config = load_config(["--resume", "@", str(LOCAL)])
    assert config.resume is True and config.max_steps == 60
    config = load_config(["--resume", f"@{LOCAL}"])
    assert config.resume is True and config.max_steps == 60


def test_null_for_optional_fields():
    config = load_config(["--loss.sdpo.token_clip", "0.5"])
    assert config.loss.sdpo.token_clip == 0.5
    config = load_config(["--loss.sdpo.token_clip", "0.5", "--loss.sdpo.token_clip", "null"])
    assert config.loss.sdpo.token_clip is None
    assert load_config(["--metrics.wandb_project", "p", "--metrics.wandb_project=null"]).metrics.wandb_project is None


def test_null_for_required_field_errors():
    message = _error(["--model.path", "null"])
    assert "model.path" in message and "command line" in message


def test_at_file_forms_agree():
    joined = load_config([f"@{LOCAL}"])
    spaced = load_config(["@", str(LOCAL)])
    assert joined == spaced
    assert joined.max_steps == 60


def test_at_without_path_errors():
    assert "'@' must be followed" in _error(["@"])
    assert "'@' must be followed" in _error(["--seed", "1", "@"])


def test_stray_positional_word_errors():
    assert "unexpected argument 'oops'" in _error(["oops"])
    assert "unexpected argument '--'" in _error(["--"])


def test_empty_value_error_names_key():
    # exposes bug: loader.py _parse_value line 60 tests `text[:1] in "[{"`, which is true for
    # an empty value ("" is a substring of every string), so `--output_dir ""` or
    # `--loss.import_path=` fail with "value '' looks like JSON but does not parse" instead
    # of the schema's min_length error, and the message names neither the key nor the source.
    message = _error(["--output_dir", ""])
    assert "output_dir" in message and "command line" in message
    message = _error(["--loss.type", "custom", "--loss.import_path="])
    assert "import_path" in message


def test_malformed_dotted_key_errors():
    assert "malformed override key" in _error(["--loss..kl_tau", "1"])


# --------------------------------------------------------------------------- loss union


def test_loss_type_selects_member():
    assert isinstance(load_config(["--loss.type", "ipo"]).loss, IpoLoss)
    assert isinstance(load_config(["--loss.type", "ref_kl"]).loss, RefKlLoss)
    assert isinstance(load_config(["--loss.type", "dppo_kl"]).loss, DppoKlLoss)
    custom = load_config(["--loss.type", "custom", "--loss.import_path", "pkg.mod:fn"])
    assert isinstance(custom.loss, CustomLoss)
    assert custom.loss.import_path == "pkg.mod:fn"
    assert custom.loss.kwargs == {}


def test_loss_without_type_is_dppo_kl(tmp_path):
    config = load_config(["--loss.kl_tau", "0.01"])
    assert isinstance(config.loss, DppoKlLoss)
    assert config.loss.kl_tau == 0.01
    preset = _write(tmp_path, "notype.toml", "[loss]\ndppo_mask_low = 0.3\n")
    config = load_config(["@", str(preset)])
    assert isinstance(config.loss, DppoKlLoss) and config.loss.dppo_mask_low == 0.3
    assert isinstance(RunConfig.model_validate({"loss": {"adv_tau": 0.5}}).loss, DppoKlLoss)


def test_knob_of_other_recipe_refused():
    message = _error(["--loss.type", "ipo", "--loss.dppo_mask_low", "0.1"])
    assert "unknown key 'loss.dppo_mask_low'" in message
    message = _error(["--loss.ipo_threshold", "0.1"])  # no type: dppo_kl
    assert "unknown key 'loss.ipo_threshold'" in message
    message = _error(["--loss.type", "ref_kl", "--loss.adv_tau", "1"])
    assert "unknown key 'loss.adv_tau'" in message


def test_a_later_loss_type_that_refuses_a_preset_s_knobs_is_named():
    """The preset's knob is not the mistake alone: the command line's loss.type swapped the recipe under it."""
    preset = CONFIGS / "dppo_kl.toml"
    message = _error(["@", str(preset), "--loss.type", "tis"])
    assert (f"{preset}: unknown key 'loss.dppo_mask_low' for loss.type 'tis' (set on the command line), which "
            "takes: level, adv_tau, kl_tau, cap, replay, sdpo") in message  # fmt: skip
    mis = CONFIGS / "mis.toml"
    message = _error(["@", str(mis), "--loss.dppo_mask_low", "0.1"])
    assert f"for loss.type 'mis' (set in {mis}), which takes: level, adv_tau, kl_tau, low, high" in message
    message = _error(["--loss.ipo_threshold", "1"])
    assert "unknown key 'loss.ipo_threshold' for loss.type 'dppo_kl' (the default)" in message
    message = _error(["--teachers.members", '[{"backend": "hf", "name": "a", "path": "/m", "bogus": 1}]'])
    assert "for teachers.members.0.backend 'hf' (set on the command line), which takes: name, path" in message


@pytest.mark.parametrize(
    ("args", "suggestion"),
    [
        (["--trainer.lrr", "1"], "unknown key 'trainer.lrr' — did you mean 'trainer.lr'?"),
        (["--trainr.lr", "1"], "unknown key 'trainr' — did you mean 'trainer'?"),
        (["--loss.replay.wieght", "1"], "unknown key 'loss.replay.wieght' — did you mean 'loss.replay.weight'?"),
        (["--loss.type", "tis", "--loss.capp", "1"], "which takes: level, adv_tau, kl_tau, cap, replay, sdpo — did you "
         "mean 'loss.cap'?"),
    ],
)  # fmt: skip
def test_a_misspelled_key_suggests_the_nearest_valid_one(args, suggestion):
    assert suggestion in _error(args)
    assert "did you mean" not in _error(["--trainer.no_such_key", "1"])


def test_tis_and_mis_presets_select_their_recipes():
    tis = load_config(["@", str(LOCAL), "@", str(CONFIGS / "tis.toml")]).loss
    assert isinstance(tis, TisLoss) and (tis.level, tis.cap) == ("token", 2.0) and tis.replay.weight == 0.1
    mis = load_config(["@", str(CONFIGS / "mis.toml"), "--loss.level", "sequence"]).loss
    assert isinstance(mis, MisLoss) and (mis.level, mis.low, mis.high) == ("sequence", 0.125, 8.0)


def test_unknown_loss_type_refused():
    message = _error(["--loss.type", "nope"])
    assert "loss" in message and "nope" in message


def test_custom_needs_import_path():
    message = _error(["--loss.type", "custom"])
    assert "import_path" in message
    assert "Field required" in message
    assert "command line" in message
    message = _error(["--loss.type", "custom", "--loss.import_path", "pkg.mod:fn", "--loss.kwargs", "3"])
    assert "loss.kwargs" in message


def test_missing_field_error_names_dotted_key_without_union_tag():
    # exposes bug: loader.py _origin_of (lines 126-145) keeps pydantic's union tag in the
    # location when the field is absent from the input, so the message says
    # 'loss.custom.import_path' (and 'teachers.members.0.hf.path'), keys no user can type;
    # a present-but-invalid field is reported as 'loss.kl_tau' (tag dropped).
    message = _error(["--loss.type", "custom"])
    assert "loss.import_path" in message
    message = _error(["--teachers.members", '[{"backend": "hf", "name": "a"}]'])
    assert "teachers.members.0.path" in message


@pytest.mark.parametrize("loss_type", ["dppo_kl", "ipo", "ref_kl", "custom"])
def test_replay_and_sdpo_under_every_type(loss_type):
    args = ["--loss.type", loss_type]
    if loss_type == "custom":
        args += ["--loss.import_path", "pkg.mod:fn"]
    args += [
        "--loss.replay.weight",
        "0.2",
        "--loss.replay.variant",
        "simpo",
        "--loss.sdpo.weight",
        "0.3",
        "--loss.sdpo.token_clip",
        "4",
    ]
    config = load_config(args)
    assert config.loss.type == loss_type
    assert config.loss.replay.weight == 0.2
    assert config.loss.replay.variant == "simpo"
    assert config.loss.sdpo.weight == 0.3
    assert config.loss.sdpo.token_clip == 4.0
    message = _error([*args, "--loss.sdpo.jsd_beta", "2"])
    assert "loss.sdpo.jsd_beta" in message


def test_custom_preset():
    config = load_config(["@", str(CONFIGS / "custom.toml")])
    assert isinstance(config.loss, CustomLoss)
    assert config.loss.import_path == "meshrl.loss_adapters.prime_rl.loss_fn"
    assert config.loss.kwargs == {"dppo_mask_low": 0.3, "dppo_mask_high": 0.3, "kl_tau": 1e-3}


def test_teacher_members_union():
    members = (
        '[{"backend": "oracle"}, {"backend": "hf", "name": "h", "path": "/m"},'
        ' {"backend": "openai", "name": "o", "base_url": "http://x/v1", "model": "m"}]'
    )
    config = load_config(["--teachers.members", members])
    assert [m.backend for m in config.teachers.members] == ["oracle", "hf", "openai"]
    assert config.teachers.members[0].name == "oracle"
    assert config.teachers.members[2].timeout_s == 60.0
    assert "teachers.members.0" in _error(["--teachers.members", '[{"backend": "nope"}]'])


# --------------------------------------------------------------------------- error sources


def test_bad_value_in_preset_names_file_and_key(tmp_path):
    preset = _write(tmp_path, "bad.toml", "[loss]\nkl_tau = -1.0\n")
    message = _error(["@", str(preset)])
    assert str(preset) in message
    assert "loss.kl_tau" in message
    assert "command line" not in message


def test_bad_value_in_second_preset_names_that_file(tmp_path):
    good = _write(tmp_path, "good.toml", "[generator]\ntemperature = 0.7\n")
    bad = _write(tmp_path, "bad.toml", "[generator]\ntemperature = 9.0\n")
    message = _error(["@", str(good), "@", str(bad), "--seed", "3"])
    assert f"{bad}: generator.temperature" in message
    assert str(good) not in message


def test_bad_value_from_command_line_says_command_line(tmp_path):
    message = _error(["--loss.kl_tau", "-1"])
    assert "command line" in message
    assert "loss.kl_tau" in message
    preset = _write(tmp_path, "ok.toml", "[loss]\nkl_tau = 0.5\n")
    message = _error(["@", str(preset), "--loss.kl_tau", "-1"])
    assert "command line: loss.kl_tau" in message
    assert str(preset) not in message


def test_cli_override_repairs_bad_preset_value(tmp_path):
    preset = _write(tmp_path, "bad.toml", "[loss]\nkl_tau = -1.0\n")
    assert load_config(["@", str(preset), "--loss.kl_tau", "0.5"]).loss.kl_tau == 0.5


def test_table_level_error_names_source_that_set_the_key():
    # exposes bug: a model-level validator error (topology mode/workers, tiny heads/width,
    # a missing required field) is blamed on whichever source first created the table, via
    # the ancestor fallback in loader.py _origin_of (lines 141-144): with local.toml setting
    # mode = "local", `--topology.mode attach` is reported as "configs/local.toml: topology: ..."
    message = _error(["@", str(LOCAL), "--topology.mode", "attach"])
    assert "needs at least one address" in message
    assert "command line" in message
    assert str(LOCAL) not in message


def test_toml_syntax_error_names_file(tmp_path):
    preset = _write(tmp_path, "broken.toml", "[loss\nkl_tau = 1\n")
    message = _error(["@", str(preset)])
    assert str(preset) in message
    assert "invalid TOML" in message


def test_missing_preset_names_path(tmp_path):
    missing = tmp_path / "nope.toml"
    message = _error(["@", str(missing)])
    assert str(missing) in message and "not found" in message
    message = _error([f"@{missing}"])
    assert str(missing) in message


def test_preset_that_is_a_directory_errors(tmp_path):
    assert str(tmp_path) in _error(["@", str(tmp_path)])


# --------------------------------------------------------------------------- bounds


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--loss.kl_tau", "-0.1"], "loss.kl_tau"),
        (["--generator.top_p", "1.01"], "generator.top_p"),
        (["--generator.top_p", "0"], "generator.top_p"),
        (["--generator.top_p", "0.9"], "top_p 0.9 < 1 is refused for RL"),
        (["--generator.temperature", "0"], "generator.temperature"),
        (["--max_steps", "0"], "max_steps"),
        (["--seed", "-1"], "seed"),
        (["--model.tiny.vocab_size", "10"], "model.tiny.vocab_size"),
        (["--model.dtype", "float64"], "model.dtype"),
        (["--loss.replay.label_smoothing", "0.5"], "loss.replay.label_smoothing"),
        (["--loss.replay.variant", "kto"], "loss.replay.variant"),
        (["--loss.sdpo.token_clip", "0"], "loss.sdpo.token_clip"),
        (["--loss.type", "ipo", "--loss.ipo_threshold", "-1"], "loss.ipo_threshold"),
        (["--trainer.lr", "0"], "trainer.lr"),
        (["--trainer.betas", "[0.9]"], "trainer.betas"),
        (["--teachers.min_agree", "0"], "teachers.min_agree"),
        (["--output_dir", "null"], "output_dir"),
        (["--resume", "maybe"], "resume"),
    ],
)
def test_bounds(args, needle):
    message = _error(args)
    assert needle in message
    assert "command line" in message


def test_hidden_size_must_divide_by_heads():
    message = _error(["--model.tiny.hidden_size", "66"])
    assert "not divisible" in message and "model.tiny" in message
    assert load_config(["--model.tiny.hidden_size", "96", "--model.tiny.num_heads", "3"]).model.tiny.hidden_size == 96


def test_attach_needs_workers():
    assert "needs at least one address" in _error(["--topology.mode", "attach"])
    config = load_config(["--topology.mode", "attach", "--topology.workers", '["tcp://h:1"]'])
    assert config.topology.mode == "attach"


@pytest.mark.parametrize("address", ["h:1", "http://h:1", "udp://h:1", ""])
def test_worker_address_scheme(address):
    message = _error(["--topology.workers", f'["{address}"]'])
    assert "must start with tcp:// or tls://" in message
    assert "topology" in message


def test_valid_worker_addresses():
    config = load_config(["--topology.mode", "attach", "--topology.workers", '["tcp://a:1", "tcp://b:2"]'])
    assert config.topology.workers == ["tcp://a:1", "tcp://b:2"]


# --------------------------------------------------------------------------- round trip


def _round_trip(args: list[str], tmp_path: Path, name: str = "resolved.toml") -> tuple[RunConfig, RunConfig]:
    config = load_config(args)
    path = tmp_path / name
    path.write_text(to_toml(config))
    return config, load_config(["@", str(path)])


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_round_trip_each_preset_with_local(preset, tmp_path):
    config, again = _round_trip(["@", str(LOCAL), "@", str(preset)], tmp_path)
    assert again == config
    config, again = _round_trip(["@", str(preset)], tmp_path, "alone.toml")
    assert again == config


def test_round_trip_rich_config(tmp_path):
    args = [
        "@",
        str(LOCAL),
        "--loss.type",
        "custom",
        "--loss.import_path",
        "pkg.mod:fn",
        "--loss.kwargs",
        '{"a": 1, "b": [1, 2], "c": {"d": "e"}}',
        "--loss.sdpo.token_clip",
        "3.5",
        "--topology.mode",
        "attach",
        "--topology.workers",
        '["tcp://h:1"]',
        "--teachers.members",
        '[{"backend": "oracle"}, {"backend": "openai", "name": "o", "base_url": "http://x/v1", "model": "m"}]',
        "--metrics.wandb_project",
        "proj",
        "--trainer.betas",
        "[0.8, 0.95]",
        "--resume",
    ]
    config, again = _round_trip(args, tmp_path)
    assert again == config.model_copy(update={"resume": False})  # what this invocation does, not the config
    assert again.loss.sdpo.token_clip == 3.5
    assert again.teachers.members[1].backend == "openai"


def test_round_trip_omits_none():
    text = to_toml(RunConfig())
    assert "token_clip" not in text
    assert "wandb_project" not in text


def test_round_trip_keeps_kwargs_keys_verbatim(tmp_path):
    # exposes bug: loader.py _normalise (line 31-33) rewrites kebab-case keys at every depth,
    # including user dicts task.kwargs / loss.kwargs, so {"max-len": 3} reads back from
    # to_toml output as {"max_len": 3} and the round trip is not equal.
    config, again = _round_trip(["--task.kwargs", '{"max-len": 3}'], tmp_path)
    assert again.task.kwargs == {"max-len": 3}
    assert again == config


def test_to_toml_with_null_inside_kwargs():
    # exposes bug: loader.py to_toml (line 175) crashes with TypeError ("Object of type
    # 'NoneType' is not TOML serializable") when a free-form dict holds a null, which the
    # loader accepts (`--task.kwargs '{"x": null}'`); exclude_none does not reach dict values.
    try:
        config = load_config(["--task.kwargs", '{"x": null}'])
    except ConfigError:
        return  # refusing the value up front would also be fine
    text = to_toml(config)
    assert "[task" in text


# --------------------------------------------------------------------------- descriptions


def _models_of(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found = []
    for arg in typing.get_args(annotation):
        found += _models_of(arg)
    return found


def _walk(model: type[BaseModel], prefix: str, seen: set, out: list) -> None:
    for name, field in model.model_fields.items():
        out.append((f"{prefix}{name}", model, name, field))
        for sub in _models_of(field.annotation):
            key = (sub, f"{prefix}{name}")
            if key not in seen:
                seen.add(key)
                _walk(sub, f"{prefix}{name}[{sub.__name__}].", seen, out)


def _all_fields() -> list:
    out: list = []
    _walk(RunConfig, "", set(), out)
    return out


def _is_union_tag(name: str, field) -> bool:
    annotation = field.annotation
    return (
        name in ("type", "backend")
        and typing.get_origin(annotation) is typing.Literal
        and len(typing.get_args(annotation)) == 1
    )


def test_walk_reaches_union_members():
    models = {model for _, model, _, _ in _all_fields()}
    names = {m.__name__ for m in models}
    assert {"DppoKlLoss", "IpoLoss", "RefKlLoss", "CustomLoss"} <= names
    assert {"HfTeacher", "OpenAITeacher", "OracleTeacher"} <= names
    assert {"TinyModelConfig", "RolePlacement", "ReplayChannel", "SdpoChannel"} <= names
    assert len(_all_fields()) > 80


def test_every_field_has_description():
    # union tags (a one-value Literal `type`/`backend`) are checked in the next test
    missing = [
        path
        for path, _, name, field in _all_fields()
        if not _is_union_tag(name, field) and not (field.description or "").strip()
    ]
    assert missing == []


def test_union_tag_fields_have_description():
    # exposes bug: the union tags have no description (configs/schema.py lines 129, 137,
    # 144, 150: `type` of DppoKlLoss/IpoLoss/RefKlLoss/CustomLoss; lines 164, 170, 182:
    # `backend` of HfTeacher/OpenAITeacher/OracleTeacher), though the module docstring says
    # every field carries one; `meshrl config keys` never lists loss.type for that reason.
    missing = [path for path, _, _, field in _all_fields() if not (field.description or "").strip()]
    assert missing == []


# Config traps a user met (issue #11 item 12): each was accepted and silently did the wrong thing.


def test_task_kwargs_merge_over_the_presets_and_start_afresh_for_another_task():
    local = ["@", str(CONFIGS / "local.toml")]
    toy = load_config(local).task.kwargs
    assert toy  # the toy's kwargs
    two = load_config([*local, "--task.kwargs.n_keys", "3", "--task.kwargs.max_turns", "2"]).task.kwargs
    assert two == {**toy, "n_keys": "3", "max_turns": "2"}  # both kept, over the preset's (typed later: make_task)
    assert load_config([*local, "--task.kwargs", "{}"]).task.kwargs == {}
    # nested tables merge too: the preset's sandbox limits stay beside an override of one of them
    code = [*local, "@", str(CONFIGS / "smollm2_code_tools.toml")]
    merged = load_config([*code, "--task.kwargs.sandbox.wall_time_s", "30"]).task.kwargs
    assert merged["sandbox"] == {"pool_size": 2, "wall_time_s": "30"} and merged["max_turns"] == 4
    # the code preset names another factory: the toy's kwargs from local.toml are not merged into it
    assert "guess_rate" not in merged and "n_keys" not in merged
    # over a run's own resolved config too (a resume with another task starts its kwargs afresh)
    resolved = [("run", load_config(local).model_dump(mode="json"))]
    other = load_config(["--task.import-path", "meshrl.tasks.horizon:HorizonTask"], before=resolved)
    assert other.task.kwargs == {}


def test_a_factory_named_anywhere_in_a_run_of_overrides_keeps_that_runs_kwargs(tmp_path):
    local = ["@", str(CONFIGS / "local.toml")]
    horizon = "meshrl.tasks.horizon:HorizonTask"
    for order in (["--task.kwargs.hops", "3", "--task.import_path", horizon],
                  ["--task.import_path", horizon, "--task.kwargs.hops", "3"]):  # fmt: skip
        assert load_config([*local, *order]).task.kwargs == {"hops": "3"}  # the toy's dropped, the run's kept
    kwargs_only = tmp_path / "k.toml"
    kwargs_only.write_text("[task.kwargs]\nn_keys = 2\n")
    toy = "meshrl.tasks.toy:ToolTask"  # the default factory, named: the same function, its kwargs stay
    assert load_config(["@", str(kwargs_only), "--task.import_path", toy]).task.kwargs == {"n_keys": 2}
    # `{}` inside a free-form dict clears that table too
    code = [*local, "@", str(CONFIGS / "smollm2_code_tools.toml")]
    assert load_config([*code, "--task.kwargs.sandbox", "{}"]).task.kwargs["sandbox"] == {}


def test_prime_rl_trainer_loss_names_its_factory_in_its_own_turn(tmp_path):
    first, second = tmp_path / "a.toml", tmp_path / "b.toml"
    first.write_text('[loss]\ntype = "custom"\nimport_path = "pkg.mod:one"\nkwargs = { kl_tau = 0.1 }\n')
    second.write_text('[trainer.loss]\ntype = "custom"\nimport_path = "pkg.mod:two"\nkwargs = { beta = 2 }\n')
    loss = load_config(["@", str(first), "@", str(second)]).loss
    assert loss.import_path == "pkg.mod:two" and loss.kwargs == {"beta": 2}  # not one's kl_tau
    later = load_config(["@", str(second), "--loss.kwargs", "{}"]).loss  # a later source wins over trainer.loss
    assert later.import_path == "pkg.mod:two" and later.kwargs == {}


@pytest.mark.parametrize(
    ("presets", "overrides", "typed"),
    [
        (["local.toml"], ["--task.kwargs.n_keys", "3", "--task.kwargs.max_turns", "2"], {"n_keys": 3, "max_turns": 2}),
        (["local.toml", "repo_fix.toml"], ["--task.kwargs.tries", "8", "--task.kwargs.per_module", "4"],
         {"tries": 8, "per_module": 4, "max_turns": 50}),
    ],
)  # fmt: skip
def test_two_task_kwarg_overrides_merge_and_arrive_typed_as_the_factory_takes_them(presets, overrides, typed):
    from meshrl.tasks.base import task_kwargs

    config = load_config([word for name in presets for word in ("@", str(CONFIGS / name))] + overrides)
    kwargs = task_kwargs(config.task)
    assert kwargs.items() >= typed.items()  # both overrides, as ints, beside the presets' other kwargs
    assert len(kwargs) > len(typed)


def test_no_flag_negates_a_boolean():
    assert load_config(["--resume"]).resume is True
    assert load_config(["--resume", "--no-resume"]).resume is False
    assert load_config(["--trainer.no-warm-start-keep-optimizer"]).trainer.warm_start_keep_optimizer is False


@pytest.mark.parametrize(
    "args, key, words",
    [
        (["--topology.workers", '["tcp://127.0.0.1:1"]'], "topology", "topology.mode attach"),
        (["--generator.samples_per_prompt", "1"], "generator.samples_per_prompt", "greater than or equal to 2"),
        (["--teachers.members", '[{"backend": "oracle"}]'], "teachers", "min_agree 2 > the 1 teacher"),
        (["--generator.max_async_level", "3", "--generator.max_off_policy_steps", "2"], "generator", "stale"),
    ],
)
def test_settings_that_could_never_train_are_refused(args, key, words):
    message = _error(args)
    assert key in message and words in message, message


def test_resume_and_overwrite_together_are_refused_naming_where_they_were_set():
    assert "the command line: overwrite: Value error, resume and overwrite are both set" in _error(
        ["--resume", "--overwrite"]
    )
    # A check across sections names the sources it read, not "the defaults".
    assert "\n  the command line: Value error, deterministic = true needs" in _error(["--deterministic"])


def test_the_humaneval_preset_fits_a_maximal_episode_in_one_micro_batch(tmp_path):
    """The longest prompt, every turn at max_new_tokens and every tool turn at its cap: the
    episode budget (and so one trainer micro-batch) holds it whole, on the preset's own model."""
    from transformers import AutoTokenizer

    from meshrl.models.tiny import ensure_tiny
    from meshrl.rollouts.chat import ChatSettings, make_chat
    from meshrl.rollouts.episodes import EpisodeLimits, cap_tokens
    from meshrl.tasks.humaneval import TOOL, HumanEvalTask

    config = load_config(["@", str(CONFIGS / "humaneval.toml")])
    task = HumanEvalTask(**{**config.task.kwargs, "sandbox": {"pool_size": 1}})
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny(tmp_path / "tiny", config.model.tiny))
    chat = make_chat(tokenizer, ChatSettings.of(config.model), [TOOL])
    limits = EpisodeLimits.of(config)
    prompt = max(len(chat.prompt_ids(task.prompt(problem).messages)) for problem in task.problems)
    call = {"id": "c", "type": "function", "function": {"name": "run_python", "arguments": {"code": "print(1)"}}}
    turn = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    flood = cap_tokens(tokenizer, "0123456789abcdef" * 20_000, limits.max_tool_tokens)
    tool_turn = len(chat.tool_turn_ids([], [], turn, [{"role": "tool", "content": flood, "tool_call_id": "c"}]))
    longest = prompt + task.max_turns * limits.max_new_tokens + (task.max_turns - 1) * tool_turn
    task.sandbox.close()
    assert longest <= limits.max_tokens <= config.model.tiny.max_position_embeddings, (prompt, tool_turn, longest)


def test_eliding_episodes_run_with_outside_workers():
    """The ingress verifier rebuilds each context an outside worker's elided episode was sampled in."""
    ingress = ["--ingress.bind", "tcp://127.0.0.1:5555", "--ingress.server_key", "s.key_secret",
               "--ingress.authorized_keys", "keys"]  # fmt: skip
    assert load_config(["--generator.context_policy", "elide", *ingress]).generator.context_policy == "elide"
