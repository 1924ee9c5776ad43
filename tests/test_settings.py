"""One settings resolver: preset < config files < overrides, for every command and ablations."""

from __future__ import annotations

import json

import pytest

from llm_foundry import ablation
from llm_foundry.cli import main
from llm_foundry.config import ConfigError
from llm_foundry.presets import get_preset
from llm_foundry.settings import resolve
from llm_foundry.train.config import TrainConfig


def _write(path, text: str):
    path.write_text(text)
    return str(path)


def test_each_field_comes_from_the_latest_source_that_sets_it(tmp_path):
    first = _write(tmp_path / "a.yaml", "model:\n  dim: 96\n  n_layers: 3\ntrain:\n  lr: 3e-3\n")
    second = _write(tmp_path / "b.yaml", "model:\n  n_layers: 5\n")
    s = resolve(
        preset="gpt2-shakespeare-char",
        files=[first, second],
        overrides=[("model", "n_layers", 7), ("train", "max_steps", 9)],
    )
    preset = get_preset("gpt2-shakespeare-char")
    assert s.preset == "gpt2-shakespeare-char"
    assert (s.model.dim, s.model.n_layers) == (96, 7)  # file a, then the override over file b
    assert s.model.norm == preset.norm and s.model.vocab_size == preset.vocab_size  # the preset
    assert (s.train.lr, s.train.max_steps, s.train.batch_size) == (
        3e-3,
        9,
        TrainConfig().batch_size,
    )
    assert s.given == {"model": {"dim": 96, "n_layers": 7}, "train": {"lr": 3e-3, "max_steps": 9}}


def test_a_base_run_changes_only_where_asked_and_a_preset_replaces_it():
    base = get_preset("gpt2-shakespeare-char").replace(dim=48)
    kept = resolve(
        base_model=base,
        default_preset="llama-shakespeare-char",
        overrides={"model": {"dropout": 0.1}},
    )
    assert kept.model == base.replace(dropout=0.1) and kept.preset is None
    fresh = resolve(preset="llama-shakespeare-char", base_model=base)
    assert fresh.model == get_preset("llama-shakespeare-char")
    assert resolve(default_preset="gpt2").model == get_preset("gpt2")


def test_problems_name_the_section_the_field_and_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.n_layers='four' must be a positive integer"):
        resolve(overrides=[("model", "n_layers", "four")])
    with pytest.raises(ConfigError, match=r"train\.lr=-1 must be a number > 0"):
        resolve(overrides={"train": {"lr": -1}})
    bad = _write(tmp_path / "c.yaml", "model:\n  n_layer: 2\n")
    with pytest.raises(
        ConfigError, match=r"c\.yaml: model\.n_layer is not a field \(did you mean 'n_layers'\?\)"
    ):
        resolve(files=[bad])
    listed = _write(tmp_path / "d.yaml", "model: [1, 2]\n")
    with pytest.raises(ConfigError, match=r"d\.yaml: the model section must be a mapping"):
        resolve(files=[listed])
    with pytest.raises(
        ValueError, match=r"'train.lrr': train has no field 'lrr' \(did you mean 'lr'\?\)"
    ):
        resolve(overrides=[("train", "lrr", 1.0)])
    # a file's problem is the file's, not ModelConfig's; other projects' names get ours
    other = _write(tmp_path / "e.yaml", "train:\n  learning_rate: 0.1\n  max_iters: 5\n")
    with pytest.raises(ConfigError) as e:
        resolve(files=[other])
    assert str(e.value) == (
        f"invalid config file (2 problem(s)):\n  - {other}: train.learning_rate is not a field "
        f"(did you mean 'lr'?)\n  - {other}: train.max_iters is not a field (did you mean "
        "'max_steps'?)"
    )
    with pytest.raises(ValueError, match=r"no field 'n_embd' \(did you mean 'dim'\?\)"):
        resolve(overrides=[("model", "n_embd", 64)])


def test_the_command_line_and_an_ablation_variant_resolve_alike(tmp_path, capsys):
    """`params --preset P --model.F V` and a study variant {F: V} on preset P are one config."""
    conf = _write(tmp_path / "m.yaml", "model:\n  n_layers: 2\n")
    assert (
        main(
            [
                "params",
                "--preset",
                "gpt2-shakespeare-char",
                "--config",
                conf,
                "--model.mlp",
                "swiglu",
                "--json",
            ]
        )
        == 0
    )
    cli_cfg = json.loads(capsys.readouterr().out)["config"]
    study = ablation.Study(preset="gpt2-shakespeare-char", model={"n_layers": 2})
    variant = ablation.Variant(name="swiglu", model={"mlp": "swiglu"})
    model, _ = ablation.configs(study, variant, 0)
    assert cli_cfg == json.loads(json.dumps(model.to_dict()))


def test_unknown_top_level_keys_of_a_config_file_are_refused(tmp_path, capsys):
    conf = _write(tmp_path / "x.yaml", "model:\n  dim: 64\nepochs: 3\n")
    assert main(["params", "--config", conf]) == 2
    err = capsys.readouterr().err
    assert "x.yaml: unknown top-level key(s) epochs; valid: model, train, preset" in err


def test_help_shows_each_fields_meaning_and_default(capsys):
    with pytest.raises(SystemExit):
        main(["train", "-h"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--model.n_heads V query heads (default 8)" in out
    assert "--train.lr V peak learning rate (default 0.001)" in out
    assert (
        "--model.tie_embeddings V output head shares the token-embedding matrix (default false)"
        in out
    )


def test_the_command_line_preset_wins_over_a_config_files_preset(tmp_path, capsys):
    conf = _write(tmp_path / "p.yaml", "preset: gpt2-shakespeare-char\nmodel:\n  n_layers: 2\n")
    assert main(["params", "--config", conf, "--json"]) == 0
    from_file = json.loads(capsys.readouterr().out)["config"]
    assert from_file["norm"] == "layernorm" and from_file["n_layers"] == 2
    assert main(["params", "--config", conf, "--preset", "llama-shakespeare-char", "--json"]) == 0
    from_cli = json.loads(capsys.readouterr().out)["config"]
    assert from_cli["norm"] == "rmsnorm" and from_cli["n_layers"] == 2


def test_out_and_resume_come_from_the_last_config_file_that_sets_them(tmp_path):
    """As every other setting does: later files override earlier ones, the command line both."""
    from llm_foundry.cli.train import _config_value, parser

    a = _write(tmp_path / "a.yaml", "out: runs/a\nresume: true\n")
    b = _write(tmp_path / "b.yaml", "out: runs/b\n")
    ns = parser().parse_args(["--config", a, "--config", b])
    assert (_config_value(ns, "out"), _config_value(ns, "resume")) == ("runs/b", True)
    ns = parser().parse_args(["--config", a, "--config", b, "--out", "runs/c"])
    assert _config_value(ns, "out") == "runs/c"


# ----------------------------------------------------------------------------------------------
# misuse: values that are not values, and values that pass a type check but break a run later


@pytest.mark.parametrize(
    "flag, text", [("--train.lr", "{"), ("--model.dim", "[1,"), ("--train.seed", "!!python/none")]
)
def test_invalid_yaml_in_a_flag_value_is_one_line_naming_the_flag(tmp_path, capsys, flag, text):
    argv = ["train", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "r"), flag, text]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(
        f"llm-foundry train: error: argument {flag}: {text!r} is not a valid value"
    )


def test_invalid_yaml_in_an_ablation_assignment_is_one_line_naming_the_field(capsys):
    with pytest.raises(ValueError, match=r"^train\.lr: '\{' is not a valid value \(") as e:
        ablation.parse_assignment("train.lr={")
    assert "\n" not in str(e.value)
    assert main(["ablate", "--vary", "dim=[1,", "--data", "nowhere"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dim: '[1' is not a valid value" in err, err


@pytest.mark.parametrize(
    "text, shown",
    [
        ("1e23", "1e+23"),  # a float, however whole
        ("100000000000000000000000", "100000000000000000000000"),  # past what torch can seed
        ("-1", "-1"),
        ("2.5", "2.5"),
        ("true", "True"),
    ],
)
def test_a_seed_torch_cannot_take_is_refused_on_one_line(tmp_path, capsys, text, shown):
    argv = ["train", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "r")]
    assert main([*argv, f"--train.seed={text}"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"llm-foundry train: error: invalid train settings (1 problem): train.seed={shown} must be an "
        "integer in [0, 2**62]\n"
    )


def test_the_largest_seed_allowed_seeds_torch_and_numpy_with_room_for_offsets():
    import numpy as np
    import torch

    from llm_foundry.train.config import SEED_MAX

    for seed in (SEED_MAX, SEED_MAX + 1000):  # + an ablation's seed index, + 1 for validation
        torch.manual_seed(seed)
        np.random.Generator(np.random.PCG64(seed))
    assert TrainConfig(seed=SEED_MAX).seed == SEED_MAX


def test_a_config_file_holding_a_huge_value_is_named_with_the_value_cut(tmp_path):
    listed = _write(tmp_path / "big.yaml", json.dumps(list(range(10_000))))
    with pytest.raises(ConfigError) as e:
        resolve(files=[listed])
    assert "\n" not in str(e.value) and "(10,000 items)" in str(e.value)
    assert len(str(e.value)) < 250
    section = _write(tmp_path / "sec.yaml", json.dumps({"model": list(range(10_000))}))
    with pytest.raises(ConfigError, match=r"the model section must be a mapping of fields, got "):
        resolve(files=[section])
    with pytest.raises(ConfigError) as e:
        resolve(overrides={"model": {"dim": list(range(10_000))}})
    assert "model.dim=[0, 1, 2" in str(e.value) and "(10,000 items)" in str(e.value)
    assert len(str(e.value)) < 250


def test_every_setting_has_its_comment_as_help(capsys):
    """``train --help`` shows each field's comment: the one after it, or the lines above it (a
    section heading such as ``# --- training-time`` is not a field's help)."""
    import dataclasses

    from llm_foundry.cli import main
    from llm_foundry.cli.options import field_comments
    from llm_foundry.config import ModelConfig
    from llm_foundry.train.config import TrainConfig

    train, model = field_comments(TrainConfig), field_comments(ModelConfig)
    assert train["sdpa_backend"].startswith("the kernel attention runs in training: auto")
    assert train["dtype"].startswith("fp32 | bf16 (autocast)")  # the lines above it
    assert train["lr"] == "peak learning rate"  # the one after it
    assert "nf4" in train["lora_base_dtype"]
    assert not any(v.startswith("---") for v in (*train.values(), *model.values()))
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "--train.sdpa_backend V the kernel attention runs in training: auto (PyTorch picks)" in out
    )
    documented = sum(f.name in train for f in dataclasses.fields(TrainConfig))
    assert documented >= len(dataclasses.fields(TrainConfig)) - 8, documented


def test_a_config_file_with_a_model_is_the_model_and_one_without_keeps_the_default(tmp_path):
    """`train --config FILE` as `params --config FILE` counts it: a model: section over
    ModelConfig's defaults (or over its own preset:), none of the default preset's fields; a
    file of training settings alone leaves the default preset's model."""
    from llm_foundry.cli.train import DEFAULT_PRESET
    from llm_foundry.config import ModelConfig

    (model := tmp_path / "model.yaml").write_text("model:\n  n_layers: 3\n")
    (named := tmp_path / "named.yaml").write_text(
        "preset: gpt2-shakespeare-char\nmodel:\n  n_layers: 3\n"
    )
    (train := tmp_path / "train.yaml").write_text("train:\n  max_steps: 7\n")
    assert resolve(files=[model], default_preset=DEFAULT_PRESET).model == ModelConfig(n_layers=3)
    assert resolve(files=[named], default_preset=DEFAULT_PRESET).model == get_preset(
        "gpt2-shakespeare-char", n_layers=3
    )
    settings = resolve(files=[train], default_preset=DEFAULT_PRESET)
    assert settings.model == get_preset(DEFAULT_PRESET) and settings.train.max_steps == 7
