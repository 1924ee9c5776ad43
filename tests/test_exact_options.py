"""Options are taken by their exact names: argparse would complete a prefix (--train.decay into
--train.decay_frac), so a typo could set another field than the one meant."""

from __future__ import annotations

import argparse

import pytest

from llm_foundry.cli import main
from llm_foundry.cli.options import SettingsParser, flag_hint


@pytest.mark.parametrize(
    "argv, named, hint",
    [
        # a prefix of decay_frac, though a user writing "decay" may mean weight_decay: both named
        (["inspect", "lr", "--train.decay", "0.5", "--out", "lr.png"], "--train.decay 0.5",
         "did you mean --train.decay_frac, --train.weight_decay or --train.muon_weight_decay?"),
        (["train", "--train.max_step", "10"], "--train.max_step 10",
         "did you mean --train.max_steps?"),
        (["params", "--preset", "gpt2", "--model.hidden", "100"], "--model.hidden 100",
         "did you mean --model.hidden_dim or --model.expert_hidden_dim?"),
        (["bench", "attention", "--seq", "16"], "--seq 16", "did you mean --seq-lens?"),
        # ablate's way of setting a field, given to train: its own flag, not --preset
        (["train", "--set", "train.max_steps=3"], "--set train.max_steps=3",
         "did you mean --train.max_steps 3?"),
        (["train", "--set=model.n_layers=4"], "--set=model.n_layers=4",
         "did you mean --model.n_layers 4?"),
    ],
)  # fmt: skip
def test_a_prefix_of_an_option_is_refused_naming_it_and_the_options_meant(
    argv, named, hint, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # nothing may be written; if it were, not into the repository
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {named} ({hint})" in err
    assert len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_ablate_refuses_the_prefix_train_refuses(tmp_path, capsys):
    assert main(["ablate", "--vary", "norm=layernorm,rmsnorm", "--train.max_step", "10",
                 "--out", str(tmp_path / "a")]) == 2  # fmt: skip
    assert "train has no field 'max_step' (did you mean 'max_steps'?)" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_the_exact_name_and_its_equals_form_still_parse():
    p = SettingsParser(prog="x")
    p.add_argument("--seq-lens")
    p.add_argument("--train.max_steps")
    ns = p.parse_args(["--seq-lens", "4", "--train.max_steps=10"])
    assert (ns.seq_lens, ns.__dict__["train.max_steps"]) == ("4", "10")
    with pytest.raises(argparse.ArgumentError, match=r"--seq 4 \(did you mean --seq-lens\?\)"):
        p.parse_args(["--seq", "4"])


@pytest.mark.parametrize(
    "argv, prefix",
    [
        (["quantize", "--checkpoint", "c", "--to", "int8", "--out", "q", "--js"], "--js"),
        (["prepare", "--text", "t.txt", "--out", "d", "--work", "2"], "--work"),
        (["generate", "--checkpoint", "c", "--max-new", "5"], "--max-new"),
        (["serve", "--checkpoint", "c", "--max-q", "5"], "--max-q"),
        (["eval", "--checkpoint", "c", "--text", "t", "--max-win", "5"], "--max-win"),
        (["convert", "--from-hf", "c", "--out", "o", "--out-t", "q8_0"], "--out-t"),
    ],
)
def test_the_other_commands_take_exact_names_too(argv, prefix, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:  # these commands' parsers are argparse's own
        main(argv)
    assert e.value.code == 2
    assert f"error: unrecognized arguments: {prefix}" in capsys.readouterr().err


def test_flag_hint_names_the_fields_a_word_is_part_of():
    assert flag_hint("unrecognized arguments: --train.lrr 3") == " (did you mean --train.lr?)"
    assert flag_hint("unrecognized arguments: --train.zzzz 3") == ""
    assert flag_hint("unrecognized arguments: --seq 3") == ""
