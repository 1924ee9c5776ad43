"""Ctrl-C in a fine-tune at the moments around its training steps, each ending in one line that
says what was saved and how to go on: a second Ctrl-C while the stopped run writes its checkpoint,
plot and summary; a Ctrl-C after the last step; a Ctrl-C while the DPO reference is precomputed
(which shows a progress bar). The presses are this process's own SIGINTs, sent at those moments."""

from __future__ import annotations

import json
import os
import signal

import pytest
from conftest import cli_status

from llm_foundry.rundir import RunDir
from llm_foundry.train.trainer import Trainer

TINY = ["--model.dim", "16", "--model.n_layers", "1", "--model.n_heads", "2",
        "--model.max_seq_len", "32"]  # fmt: skip
QUIET = ["--train.block_size", "16", "--train.batch_size", "2", "--train.eval_batches", "1",
         "--train.warmup_steps", "1", "--train.sample_tokens", "0", "--train.progress", "false",
         "--train.checkpoint_interval", "0", "--train.eval_interval", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def base(char_data, tmp_path_factory):
    from llm_foundry.cli import main

    out = tmp_path_factory.mktemp("interrupts") / "base"
    argv = ["train", "--data", str(char_data(20_000)), "--out", str(out), *TINY, *QUIET,
            "--train.max_steps", "2"]  # fmt: skip
    assert main(argv) == 0
    return out


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def _press_at_step(monkeypatch, step: int) -> None:
    """A Ctrl-C once the run's step ``step`` is trained."""
    real = Trainer._train_step

    def train_step(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if self.step + 1 == step:
            _ctrl_c()
        return out

    monkeypatch.setattr(Trainer, "_train_step", train_step)


def _press_while_plotting(monkeypatch) -> list:
    """A Ctrl-C as the loss plot is drawn (after the training steps)."""
    import llm_foundry.plots

    real, pressed = llm_foundry.plots.plot_losses, []

    def plot_losses(*args, **kwargs):
        pressed.append(True)
        _ctrl_c()
        return real(*args, **kwargs)

    monkeypatch.setattr(llm_foundry.plots, "plot_losses", plot_losses)
    return pressed


def _finetune(base, data, out, steps: int) -> list[str]:
    return ["finetune", "--checkpoint", str(base), "--data", str(data), "--out", str(out),
            *QUIET, "--train.lora_r", "2", "--train.max_steps", str(steps)]  # fmt: skip


def test_a_second_ctrl_c_while_the_stopped_run_is_wrapped_up_keeps_its_one_ending(
    base, char_data, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "run"
    _press_at_step(monkeypatch, 3)
    pressed = _press_while_plotting(monkeypatch)
    rc, err = cli_status(_finetune(base, char_data(20_000), out, 1000), capsys)
    saved = RunDir(out).latest()
    assert pressed and rc == 130 and saved.name == "step_000003", err
    assert err == (f"llm-foundry finetune: stopped by SIGINT: 3 of 1000 steps done; saved {saved}; "
                   f"continue with --resume --out {out}\n")  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["step"] == 3


def test_a_ctrl_c_after_the_last_step_says_the_run_was_saved(
    base, char_data, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "run"
    _press_while_plotting(monkeypatch)
    rc, err = cli_status(_finetune(base, char_data(20_000), out, 2), capsys)
    saved = RunDir(out).latest()
    assert rc == 130 and saved.name == "step_000002", err
    assert err == (f"llm-foundry finetune: stopped by SIGINT: after the training steps (2 of 2 "
                   f"done; saved {saved}): the loss plot, sample or summary.json may be "
                   "missing\n")  # fmt: skip


def test_the_precomputed_dpo_reference_shows_progress_and_a_ctrl_c_there_says_what_was_lost(
    base, tmp_path, monkeypatch, capsys
):
    from llm_foundry.train.reference import ModelReference

    rows = [{"prompt": "ROMEO: ", "chosen": "But soft", "rejected": "soft But"}] * 40
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["finetune", "--task", "dpo", "--checkpoint", str(base), "--data",
            str(tmp_path / "rows.jsonl"), *QUIET, "--train.max_steps", "1",
            "--train.dpo_reference", "precomputed"]  # fmt: skip
    argv[argv.index("--train.progress") + 1] = "true"
    rc, err = cli_status([*argv, "--out", str(tmp_path / "whole")], capsys)
    assert rc == 0, err
    assert "DPO reference: 100%" in err and "40/40" in err, err  # 36 train + 4 val pairs
    real, calls = ModelReference.logps, []

    def logps(self, *args, **kwargs):
        calls.append(True)
        if len(calls) == 3:
            _ctrl_c()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ModelReference, "logps", logps)
    out = tmp_path / "cut"
    rc, err = cli_status([*argv, "--out", str(out), "--train.progress", "false"], capsys)
    assert rc == 130, err
    assert err == ("llm-foundry finetune: stopped by SIGINT: while precomputing the DPO "
                   "reference log-probabilities (4 of 40 pairs scored; "
                   "train.dpo_reference=precomputed): nothing was trained or saved; run the "
                   "command again (the scoring starts over)\n"), err  # fmt: skip
    assert RunDir(out).latest() is None and not (out / "reference_logps.safetensors").exists()
