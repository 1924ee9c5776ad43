"""What a training run says besides its losses: a write of the run directory that fails outside a
checkpoint (metrics.jsonl, run.json) is one line naming the file, the step reached, the last
checkpoint and how to go on; steps skipped as non-finite are counted on the evaluation lines and
the last one (a warning when many were), and a stop names which of loss and gradient norm was
not finite; a compiled run says it is compiling before its first step."""

from __future__ import annotations

import errno
import json
import math
import types
from pathlib import Path

import pytest
import torch
from conftest import TINY, cli_status, make_trainer

from llm_foundry.cli import main
from llm_foundry.train import metrics as train_metrics
from llm_foundry.train import state as train_state
from llm_foundry.train.notes import nonfinite
from llm_foundry.train.trainer import Trainer, TrainingDiverged

FLAGS = [f"--model.{k}={v}" for k, v in TINY.items() if k != "vocab_size"] + [
    "--train.block_size=32", "--train.batch_size=4", "--train.eval_batches=1",
    "--train.eval_interval=4", "--train.checkpoint_interval=4", "--train.warmup_steps=2",
    "--train.sample_tokens=0", "--train.progress=false",
]  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(char_data) -> Path:
    return char_data(20_000)


def _train(data_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(data_dir), "--out", str(out), *FLAGS, *extra]


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _disk_full_after(monkeypatch, records: int) -> None:
    """metrics.jsonl's file takes ``records`` records, then its flush fails as a full disk's."""
    real_open = open

    class Full:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, text):
            self.n += 1
            return self.f.write(text)

        def flush(self):
            if self.n > records:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.f.flush()

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(train_metrics, "open", lambda *a, **k: Full(real_open(*a, **k)),
                        raising=False)  # fmt: skip


def test_a_full_disk_while_logging_metrics_names_the_file_the_step_and_how_to_go_on(
    data_dir, tmp_path, capsys
):
    """The 7th record (step 6; the evaluation of step 4 is one) does not fit: one line, exit 1;
    --resume once there is room trains from step 4's checkpoint to the losses of a run never
    stopped."""
    full, run = tmp_path / "full", tmp_path / "run"
    assert main(_train(data_dir, full, "--train.max_steps=8")) == 0
    monkeypatch = pytest.MonkeyPatch()
    _disk_full_after(monkeypatch, 6)
    try:
        rc, err = cli_status(_train(data_dir, run, "--train.max_steps=8"), capsys)
    finally:
        monkeypatch.undo()
    assert rc == 1 and err.count("\n") == 1, err
    assert err == (
        f"llm-foundry train: could not write {run / 'metrics.jsonl'}: no space left on device, "
        f"at step 6; the last checkpoint is {run / 'checkpoints' / 'step_000004'} (steps after it "
        f"train again); free space, then --resume --out {run}\n"
    )
    assert main(["train", "--out", str(run), "--resume"]) == 0
    assert _losses(run) == _losses(full)


def test_a_full_disk_before_the_first_step_says_to_run_the_command_again(
    data_dir, tmp_path, capsys, monkeypatch
):
    """run.json, written before training: no checkpoint to resume, nothing half-written left."""
    run = tmp_path / "run"

    def dump(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(train_state, "json", types.SimpleNamespace(dump=dump, loads=json.loads,
                                                                   dumps=json.dumps))  # fmt: skip
    rc, err = cli_status(_train(data_dir, run, "--train.max_steps=2"), capsys)
    assert rc == 1, err
    assert err == (
        f"llm-foundry train: could not write {run / 'run.json'}: no space left on device, before "
        "the first step; free space, then run the command again\n"
    )
    assert not list(run.glob(".run.json*"))


def _poison(monkeypatch, steps: set[int]) -> None:
    """The training loss of each step in ``steps`` (1-based) NaN; validation untouched."""
    real = Trainer._lm_loss

    def loss(self, batch, split):
        value, stats = real(self, batch, split)
        poisoned = split == "train" and self.step + 1 in steps
        return (value * float("nan") if poisoned else value), stats

    monkeypatch.setattr(Trainer, "_lm_loss", loss)


@pytest.mark.parametrize("poisoned, steps, warned", [({3}, 12, False), ({2, 3, 5, 6, 7}, 8, True)])
def test_skipped_steps_are_counted_where_the_run_reports(data_dir, tmp_path, capsys, monkeypatch,
                                                         poisoned, steps, warned):  # fmt: skip
    """On the evaluation lines and the last line; a warning on stderr past 10% of the steps."""
    _poison(monkeypatch, poisoned)
    run = tmp_path / "run"
    capsys.readouterr()
    argv = _train(data_dir, run, f"--train.max_steps={steps}", "--train.on_nonfinite=skip")
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert json.loads((run / "summary.json").read_text())["skipped_steps"] == len(poisoned)
    lines = out.splitlines()
    step4 = next(line for line in lines if line.startswith("step 4:"))
    assert step4.endswith(
        f"; {len([s for s in poisoned if s <= 4])} of 4 steps skipped (non-finite)"
    )
    done = next(line for line in lines if line.startswith("done:"))
    assert f"; {len(poisoned)} of {steps} steps skipped (non-finite); curves in" in done
    warning = [line for line in err.splitlines() if line.startswith("warning:")]
    share = len(poisoned) / steps
    assert warning == ([f"warning: {share:.0%} of the updates were skipped (non-finite loss or "
                        f"gradient norm): the weights trained on {steps - len(poisoned)} steps; "
                        "lower train.lr or raise train.warmup_steps"] if warned else [])  # fmt: skip


def test_a_run_without_skipped_steps_does_not_mention_them(data_dir, tmp_path, capsys):
    assert main(_train(data_dir, tmp_path / "run", "--train.max_steps=4")) == 0
    out, err = capsys.readouterr()
    assert "steps skipped" not in out and "warning" not in err


def test_a_stop_names_which_of_loss_and_gradient_norm_was_not_finite(
    data_dir, tmp_path, monkeypatch
):
    assert nonfinite(math.nan, 2.0) == "non-finite loss (nan)"
    assert nonfinite(math.inf, math.nan) == "non-finite loss (inf) and gradient norm (nan)"
    assert nonfinite(2.5, math.inf) == "non-finite gradient norm (inf) of a finite loss (2.5)"
    # a finite loss whose gradients overflow: the norm is named, the loss said finite
    t = make_trainer(data_dir, tmp_path / "run")
    real = torch.nn.utils.clip_grad_norm_

    def clip(params, max_norm):
        norm = real(params, max_norm)
        return norm * math.inf if t.step == 2 else norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    with pytest.raises(TrainingDiverged) as err:
        t.run()
    loss = _losses(tmp_path / "run")[2]  # the step before: logged
    assert str(err.value).startswith("non-finite gradient norm (inf) of a finite loss (")
    assert "at step 3; the update was not applied" in str(err.value) and math.isfinite(loss)


def test_a_compiled_run_says_it_is_compiling_before_its_first_step(
    data_dir, tmp_path, monkeypatch, notes
):
    """Said once, before the bar starts (the first step waits for the compiler); not by a run
    that compiles nothing, nor by a resume with nothing left to train."""
    monkeypatch.setattr(torch, "compile", lambda module, **kw: module)  # the note, not the compiler
    run = tmp_path / "run"
    t = make_trainer(data_dir, run, compile=True, max_steps=3)
    notes.clear()
    t.run()
    compiling = [n for n in notes if n.startswith("compiling the model (train.compile)")]
    assert compiling == [notes[0]] and len(compiling) == 1
    notes.clear()
    make_trainer(data_dir, tmp_path / "plain", max_steps=3).run()
    assert not any(n.startswith("compiling") for n in notes)
    t = make_trainer(data_dir, run, resume=True, compile=True, max_steps=3)
    notes.clear()
    t.run()
    assert not any(n.startswith("compiling") for n in notes)
