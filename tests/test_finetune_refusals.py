"""What `llm-foundry finetune` (and `train`) refuse before training, each in one line that says
what to do instead: resuming with LoRA settings the saved adapters were not built with, or with
another --checkpoint; train.dpo_* settings without --task dpo; an --out that is a prepared data
directory; a JSONL file of rows given as --data (the command that takes it, followed here)."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from conftest import cli_status

from llm_foundry.rundir import RunDir

TINY = ["--model.dim", "16", "--model.n_layers", "1", "--model.n_heads", "2",
        "--model.max_seq_len", "32"]  # fmt: skip
QUIET = ["--train.block_size", "16", "--train.batch_size", "2", "--train.eval_batches", "1",
         "--train.warmup_steps", "1", "--train.sample_tokens", "0", "--train.progress", "false"]  # fmt: skip
LORA = ["--train.lora_r", "4", "--train.lora_targets", "wq,wv", "--train.lora_alpha", "8"]


@pytest.fixture(scope="module")
def runs(char_data, tmp_path_factory):
    """(data, a base run, another base, a LoRA run of 2 steps on the first) in one directory."""
    from llm_foundry.cli import main

    root = tmp_path_factory.mktemp("finetune-refusals")
    data = char_data(20_000)
    for name in ("base", "other"):
        argv = ["train", "--data", str(data), "--out", str(root / name), *TINY, *QUIET,
                "--train.max_steps", "2", "--train.seed", str(len(name))]  # fmt: skip
        assert main(argv) == 0
    argv = ["finetune", "--checkpoint", str(root / "base"), "--data", str(data), "--out",
            str(root / "tuned"), *QUIET, *LORA, "--train.max_steps", "2"]  # fmt: skip
    assert main(argv) == 0
    return data, root / "base", root / "other", root / "tuned"


def _resume(tuned, *flags, steps=3):
    return ["finetune", "--resume", "--out", str(tuned), *QUIET, "--train.max_steps", str(steps),
            *flags]  # fmt: skip


def _one_line(err: str) -> str:
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    "flag, value, saved",
    [
        ("lora_r", "2", "4"),
        ("lora_alpha", "64", "8"),
        ("lora_targets", "wq,wk", "wq,wv"),
        ("lora_rslora", "true", "false"),
        ("lora_base_dtype", "int8", "fp32"),
    ],
)
def test_resume_refuses_lora_settings_the_adapters_were_not_built_with(
    runs, flag, value, saved, capsys
):
    _, _, _, tuned = runs
    rc, err = cli_status(_resume(tuned, f"--train.{flag}", value), capsys)
    assert rc != 0 and "a resumed run keeps them" in _one_line(err), err
    assert f"resume with --train.{flag} {saved}," in err and f"{flag}: saved " in err
    assert RunDir(tuned).latest().name == "step_000002"  # nothing trained


def test_resume_takes_the_same_targets_in_another_order_and_another_dropout(runs, tmp_path, capsys):
    import shutil

    _, _, _, tuned = runs
    copy = tmp_path / "tuned"
    shutil.copytree(tuned, copy)
    flags = ("--train.lora_targets", "wv,wq", "--train.lora_dropout", "0.1")
    rc, err = cli_status(_resume(copy, *flags), capsys)
    assert rc == 0, err
    assert RunDir(copy).latest().name == "step_000003"


def test_resume_with_another_checkpoint_is_refused_and_with_its_own_noted(runs, tmp_path, capsys):
    import shutil

    _, base, other, tuned = runs
    rc, err = cli_status(_resume(tuned, "--checkpoint", str(other)), capsys)
    assert rc != 0 and f"(it started from {base})" in _one_line(err), err
    assert f"--checkpoint {other} is another model: drop --checkpoint" in err
    copy = tmp_path / "tuned"
    shutil.copytree(tuned, copy)
    from llm_foundry.cli import main

    capsys.readouterr()
    assert main(_resume(copy, "--checkpoint", str(base))) == 0
    assert f"note: --checkpoint {base} is the base {copy} started from" in capsys.readouterr().out
    assert RunDir(copy).latest().name == "step_000003"


@pytest.mark.parametrize("command", ["finetune", "train"])
def test_dpo_settings_without_task_dpo_are_refused(runs, command, tmp_path, capsys):
    data, base, _, _ = runs
    start = ["--checkpoint", str(base)] if command == "finetune" else TINY
    argv = [command, *start, "--data", str(data), "--out", str(tmp_path / "run"), *QUIET,
            "--train.max_steps", "1", "--train.dpo_beta", "0.5", "--train.dpo_loss", "ipo"]  # fmt: skip
    rc, err = cli_status(argv, capsys)
    assert rc != 0 and "train.dpo_beta applies to preference tuning only" in _one_line(err), err
    assert "--task dpo" in err and "drop --train.dpo_beta, --train.dpo_loss" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["finetune", "train"])
def test_an_out_that_is_a_prepared_data_directory_is_refused(runs, command, capsys):
    data, base, _, _ = runs
    before = sorted(p.name for p in data.iterdir())
    start = ["--checkpoint", str(base)] if command == "finetune" else TINY
    argv = [command, *start, "--data", str(data), "--out", str(data), *QUIET,
            "--train.max_steps", "1"]  # fmt: skip
    rc, err = cli_status(argv, capsys)
    assert rc != 0 and f"--out {data} is a data directory" in _one_line(err), err
    assert sorted(p.name for p in data.iterdir()) == before


def _rows(tmp_path, rows: list[dict]):
    file = tmp_path / "rows.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return file


def test_sft_rows_given_as_data_name_the_prepare_command_and_it_works(runs, tmp_path, capsys):
    from llm_foundry.cli import main

    _, base, _, _ = runs
    rows = [{"prompt": "ROMEO: ", "completion": "But soft, what light"} for _ in range(20)]
    file = _rows(tmp_path, rows)
    argv = ["finetune", "--checkpoint", str(base), "--data", str(file), "--out",
            str(tmp_path / "run"), *QUIET, "--train.max_steps", "1"]  # fmt: skip
    rc, err = cli_status(argv, capsys)
    assert rc != 0 and "a file of fine-tuning rows (prompt, completion)" in _one_line(err), err
    (command,) = re.findall(r"`(llm-foundry prepare --sft [^`]+)`", err)  # DIR filled in below
    prepared = tmp_path / "prepared"
    assert main(shlex.split(command.replace(" DIR", f" {prepared}"))[1:]) == 0
    argv[argv.index("--data") + 1] = str(prepared)
    assert main(argv) == 0
    messages = _rows(tmp_path, [{"messages": [{"role": "user", "content": "a"},
                                              {"role": "assistant", "content": "b"}]}])  # fmt: skip
    argv[argv.index("--data") + 1] = str(messages)
    rc, err = cli_status(argv, capsys)
    assert "a file of fine-tuning rows (messages)" in _one_line(err), err


def test_preference_rows_given_as_data_name_finetune_task_dpo_and_it_works(runs, tmp_path, capsys):
    from llm_foundry.cli import main

    _, base, _, _ = runs
    rows = [{"prompt": "ROMEO: ", "chosen": "But soft", "rejected": "soft But"} for _ in range(8)]
    file = _rows(tmp_path, rows)
    argv = ["finetune", "--checkpoint", str(base), "--data", str(file), "--out",
            str(tmp_path / "run"), *QUIET, "--train.max_steps", "1"]  # fmt: skip
    rc, err = cli_status(argv, capsys)
    assert rc != 0 and "a file of preference rows" in _one_line(err), err
    (command,) = re.findall(r"`(llm-foundry finetune [^`]+)`", err)
    command = shlex.split(command.replace(" RUN", f" {tmp_path / 'dpo'}"))
    assert command[:3] == ["llm-foundry", "finetune", "--task"]
    assert main([*command[1:], *QUIET, "--train.max_steps", "1"]) == 0


def test_an_unknown_task_is_said_by_finetune_with_its_usage(runs, capsys):
    from llm_foundry.cli import main

    _, base, _, _ = runs
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["finetune", "--task", "sft", "--checkpoint", str(base)])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith("usage: llm-foundry finetune [--task {lm,dpo}]"), err
    assert "llm-foundry finetune: error: argument --task: invalid choice: 'sft'" in err


def test_finetune_task_dpo_into_a_data_directory_is_refused_before_preparing(runs, capsys):
    data, base, _, _ = runs
    before = sorted(p.name for p in data.iterdir())
    argv = ["finetune", "--task", "dpo", "--checkpoint", str(base), "--data",
            "shakespeare_prefer_next_line", "--out", str(data), *QUIET]  # fmt: skip
    rc, err = cli_status(argv, capsys)
    assert rc != 0 and f"--out {data} is a data directory" in _one_line(err), err
    assert sorted(p.name for p in data.iterdir()) == before


@pytest.mark.parametrize("data", ["pairs.jsonl", "shakespeare_prefer_next_line"])
def test_a_dpo_resume_given_rows_says_it_goes_on_with_the_pairs_it_prepared(runs, data, capsys):
    """The command a DPO run started with, plus --resume: its rows are not prepared again; one
    line says the run's own prepared pairs are what it goes on with."""
    _, _, tuned, _ = runs
    argv = ["finetune", "--task", "dpo", "--resume", "--out", str(tuned), "--data", data, *QUIET]
    rc, err = cli_status(argv, capsys)
    said = (f"--resume: a DPO run goes on with the pairs it prepared ({tuned}/data), not --data "
            f"{data}: drop --data, or give --data {tuned}/data")  # fmt: skip
    assert rc != 0 and said in _one_line(err), err


def test_finetune_help_lists_task_among_its_options(capsys):
    """--task is in the usage and the option list (was a line printed above the usage)."""
    from llm_foundry.cli import main

    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: llm-foundry finetune [-h] [--checkpoint DIR] [--task {lm,dpo}]")
    assert "dpo on preference rows {prompt, chosen, rejected}" in " ".join(out.split())


def test_data_of_another_vocabulary_is_refused_without_a_note_saying_it_was_taken(
    runs, tmp_path, capsys
):
    """Data prepared with another tokenizer (another number of ids) under a fine-tune: the one
    line refusing it names the model to prepare with, and no note first claims the model took
    the data's vocabulary."""
    from llm_foundry.data import prepare

    _, base, _, _ = runs
    (tmp_path / "t.txt").write_text("abcdefg hij\n" * 300)
    prepare(tmp_path / "d", text_files=[tmp_path / "t.txt"], tokenizer="char", progress=False)
    argv = ["finetune", "--checkpoint", str(base), "--data", str(tmp_path / "d"), "--out",
            str(tmp_path / "x"), *QUIET, "--train.max_steps", "1"]  # fmt: skip
    from llm_foundry.cli import main

    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc != 0 and "model.vocab_size set to" not in out + err, out + err
    assert f"train.init_from {base} holds another model" in err
    assert f"--tokenizer-from {base}" in err
