"""`ablate` refuses up front what would fail only after some variants trained (what each variant's
trainer checks of the data), and refuses command lines whose flags would be dropped silently: a
second --vary of one field, grid flags given to --report or --list, a one-value --vary that
leaves nothing to compare."""

from __future__ import annotations

import pytest

from llm_foundry.cli import main as cli

MODEL = dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=2, hidden_dim=64, max_seq_len=64)
TRAIN = dict(max_steps=4, batch_size=2, block_size=16, warmup_steps=1, eval_interval=2,
             eval_batches=1, sample_tokens=0, progress=False)  # fmt: skip
SETS = [f"--set=train.{k}={v}" for k, v in TRAIN.items()]
SETS += [f"--set={k}={v}" for k, v in MODEL.items()]


@pytest.fixture
def never_trains(monkeypatch):
    """Any trainer built fails the test: the refusal must come before the first variant."""

    def boom(*a, **k):
        raise AssertionError("a variant's trainer was built")

    monkeypatch.setattr("llm_foundry.train.trainer.Trainer.__init__", boom)


def refused(argv: list[str], capsys) -> str:
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    "flags, variant, message",
    [
        # the second variant's context is shorter than the windows every variant trains on
        (["--vary", "max_seq_len=64,8"], "max_seq_len=8",
         "train.block_size=16 is past model.max_seq_len=8"),
        (["--vary", "norm=layernorm,rmsnorm", "--set", "train.sft_packing=true"],
         "norm=layernorm", "train.sft_packing needs fine-tuning data (prepare --sft)"),
        (["--vary", "pos_encoding=rope,learned", "--set", "train.data_sampling=packed"],
         "pos_encoding=rope", "has no document index"),
        # a window of 1,500 tokens fits the training split, not the validation split
        (["--vary", "train.block_size=16,1500", "--set", "max_seq_len=2048"],
         "block_size=1500", "val.bin has"),
    ],
)  # fmt: skip
def test_what_a_variants_trainer_checks_of_the_data_is_refused_before_any_trains(
    flags, variant, message, char_data, tmp_path, capsys, never_trains
):
    data, out = char_data(15_000), tmp_path / "study"
    err = refused(["ablate", *SETS, *flags, "--data", str(data), "--out", str(out)], capsys)
    assert err.startswith(f"llm-foundry ablate: error: variant {variant!r}: "), err
    assert message in err
    assert not (out / "runs").exists() and not (out / "study.json").exists()


def test_a_recipe_varying_the_context_is_refused_naming_its_short_variant(
    char_data, tmp_path, capsys, never_trains
):
    recipe = tmp_path / "t5.yaml"
    recipe.write_text(
        "name: t5\ntrain: {max_steps: 10, block_size: 64}\nvary: {max_seq_len: [64, 32]}\n"
    )
    out = tmp_path / "out"
    argv = ["ablate", "--recipe", str(recipe), "--data", str(char_data(15_000)), "--out", str(out)]
    err = refused(argv, capsys)
    assert "variant 'max_seq_len=32': train.block_size=64 is past model.max_seq_len=32" in err
    assert not out.exists() or not any(out.iterdir())


def test_a_second_vary_of_one_field_is_refused_naming_both(tmp_path, capsys, never_trains):
    out = tmp_path / "dup"
    err = refused(["ablate", "--vary", "norm=layernorm,rmsnorm", "--vary", "norm=rmsnorm",
                   "--out", str(out)], capsys)  # fmt: skip
    assert ("--vary norm=rmsnorm: norm is varied already by --vary norm=layernorm,rmsnorm; "
            "give each field one --vary with all its values") in err  # fmt: skip
    # a model field named with its section is the same field
    err = refused(["ablate", "--vary", "train.lr=1e-3,3e-3", "--vary", "train.lr=1e-2,3e-2"],
                  capsys)  # fmt: skip
    assert "train.lr is varied already by --vary train.lr=1e-3,3e-3" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--report", "DIR", "--vary", "norm=a,b"], "--report builds no study, so --vary would"),
        (["--list", "--vary", "pos_encoding=bogus,x"], "--list builds no study, so --vary would"),
        (["--list", "--seeds", "2", "--data", "d"], "so --seeds, --data would be ignored"),
        (["--list", "--train.max_steps", "5"], "so --set would be ignored"),
        (["--report", "DIR", "--list"], "--report builds no study, so --list would be ignored"),
    ],
)
def test_report_and_list_refuse_the_flags_they_would_ignore(argv, named, tmp_path, capsys):
    argv = [str(tmp_path) if a == "DIR" else a for a in argv]
    (tmp_path / "results.json").write_text("{}")  # --report would read it: it must not
    err = refused(["ablate", *argv], capsys)
    assert named in err and "give --" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_a_one_value_vary_alone_is_refused(tmp_path, capsys, never_trains):
    err = refused(["ablate", "--vary", "pos_encoding=rope", "--out", str(tmp_path / "o")], capsys)
    assert ("--vary pos_encoding=rope has one value, so the study has one variant "
            "(pos_encoding=rope) and nothing to compare: give two or more, --vary FIELD=A,B") in err  # fmt: skip


def test_a_one_value_vary_beside_another_axis_is_noted(tmp_path, capsys, monkeypatch):
    studies = []

    def stop(study, data, out):  # what would train, without training it
        studies.append(study)
        raise ValueError("stop here")

    monkeypatch.setattr("llm_foundry.cli.ablate.run_study", stop)
    argv = ["ablate", "--vary", "norm=layernorm,rmsnorm", "--vary", "pos_encoding=rope",
            "--out", str(tmp_path / "o")]  # fmt: skip
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("note: --vary pos_encoding=rope: one value, the same in every variant")
    assert studies[0].vary == {"norm": ["layernorm", "rmsnorm"], "pos_encoding": ["rope"]}
