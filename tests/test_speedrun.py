"""benchmarks/speedrun.py on tiny settings: its options are checked up front (one line each), its
help names the entrants, Ctrl-C (or SIGTERM) in any entrant stops the whole run with one line and
128 + the signal's number and writes no report, and its working folder never stays behind.

The runs here use ``--quick``, a 40,000-character corpus, a 24-window validation set and a
stand-in for nanoGPT's ``model.py`` (a bigram table with its interface), so no nanoGPT checkout
or tiny Shakespeare download is needed."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import speedrun  # noqa: E402

ADAMW, MUON = "llama AdamW 2000-step cosine", "llama Muon 800-step wsd"
SMALL = dict(dim=32, n_layers=1, n_heads=2)  # our entrants' model, shrunk: steps of a few ms

# nanoGPT's interface as speedrun.py calls it (GPTConfig, GPT(config), forward(idx, targets) ->
# (logits, loss), configure_optimizers), around a bigram table: quick, and no nanoGPT code
STAND_IN = """
from dataclasses import dataclass

import torch


@dataclass
class GPTConfig:
    block_size: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float
    bias: bool


class GPT(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.table = torch.nn.Embedding(config.vocab_size, config.vocab_size)

    def forward(self, idx, targets):
        logits = self.table(idx)
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        return torch.optim.AdamW(self.parameters(), lr=learning_rate, betas=betas,
                                 weight_decay=weight_decay)
"""


@pytest.fixture
def nanogpt(tmp_path) -> Path:
    (tmp_path / "nanogpt").mkdir()
    (tmp_path / "nanogpt" / "model.py").write_text(STAND_IN)
    return tmp_path / "nanogpt"


@pytest.fixture
def tiny(tmp_path, monkeypatch, char_data):
    """Small models, data and validation set, results and temporary folders under tmp_path;
    returns (results folder, temporary folder)."""
    small = [dataclasses.replace(e, model={**e.model, **SMALL}) for e in speedrun.ENTRANTS]
    monkeypatch.setattr(speedrun, "ENTRANTS", small)
    monkeypatch.setattr(speedrun, "data_dir", lambda root: char_data(40_000))
    monkeypatch.setattr(
        speedrun, "fixed_val_set", functools.partial(speedrun.fixed_val_set, batches=2)
    )
    results, tmp = tmp_path / "results", tmp_path / "tmp"
    results.mkdir()
    tmp.mkdir()
    monkeypatch.setattr(speedrun, "RESULTS", results)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return results, tmp


def work_folders(tmp: Path) -> list[Path]:
    """The speedrun's working folders in the temporary folder (torch may keep caches there)."""
    return sorted(tmp.glob("speedrun-*"))


def run(argv: list[str], capsys) -> tuple[int | str, str, str]:
    """(exit status, stdout, stderr) of the speedrun in this process, on one thread (tiny steps
    on a busy machine's threads wait on each other); a KeyboardInterrupt getting out is reported,
    not passed on to end the session."""
    capsys.readouterr()
    threads = torch.get_num_threads()
    try:
        rc = speedrun.main([*argv, "--threads", "1"])
    except KeyboardInterrupt:
        rc = "KeyboardInterrupt escaped"
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--seeds", "0"], ["argument --seeds: 0 must be at least 1"]),
        (["--eval-interval", "0"], ["argument --eval-interval: 0 must be at least 1"]),
        (["--only", "bogus"], ["--only 'bogus'", f"'{ADAMW}'", f"'{MUON}'", "'nanoGPT'"]),
        (["--only", ADAMW, "--only", "llama muon"], ["--only 'llama muon'", f"'{MUON}'"]),
    ],
)
def test_misuse_is_one_line_naming_the_value_and_the_choices(argv, names, nanogpt, tiny, capsys):
    rc, out, err = run(["--nanogpt", str(nanogpt), "--quick", *argv], capsys)
    assert rc == 2 and out == "", err
    assert err.startswith("speedrun.py: error: ") and err.count("\n") == 1, err
    for name in names:
        assert name in err, (name, err)
    assert work_folders(tiny[1]) == []  # refused before any work folder was made


def test_a_checkout_without_model_py_is_refused_on_one_line(tmp_path, tiny, capsys):
    rc, _, err = run(["--nanogpt", str(tmp_path)], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith(f"speedrun.py: error: --nanogpt {tmp_path}: no model.py there")


def test_help_names_every_entrant(capsys):
    with pytest.raises(SystemExit) as exc:
        speedrun.main(["--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    for e in speedrun.ENTRANTS:
        assert f'"{e.name}"' in help_text, e.name
    assert "--keep" in help_text


def test_the_summary_of_no_runs_has_no_median():
    rows, refs = speedrun.summarise([], speedrun.ENTRANTS, [1337])
    assert refs == {} and [r["median_ms_per_step"] for r in rows] == [None] * len(rows)
    assert all(r["seeds_reaching_target"] == "0/0" for r in rows)


def interrupt_at_first_evaluation(monkeypatch, sig: signal.Signals) -> None:
    """Our entrants' first evaluation sends ``sig`` to this process, as Ctrl-C or a scheduler
    would during a step (the trainer catches it and stops at the step's end)."""
    evaluate = speedrun.SpeedrunTrainer.evaluate

    def interrupting(self):
        v = evaluate(self)
        if len(self.curve) == 1:
            os.kill(os.getpid(), sig)
        return v

    monkeypatch.setattr(speedrun.SpeedrunTrainer, "evaluate", interrupting)


@pytest.mark.parametrize(
    "sig, target",
    [
        (signal.SIGINT, speedrun.TARGET),  # the target is never reached: mid-run
        (signal.SIGTERM, 100.0),  # reached at that same evaluation: the signal still counts
    ],
)
def test_a_signal_in_our_entrant_stops_the_whole_run(
    sig, target, nanogpt, tiny, monkeypatch, capsys
):
    """The trainer saves and stops at the step's end: the speedrun stops there too, with one
    line (no 'continue with --resume': nothing can resume it), exit 128 + the signal's number,
    the next entrant not started, no report or results file, the work folder removed."""
    monkeypatch.setattr(speedrun, "TARGET", target)
    interrupt_at_first_evaluation(monkeypatch, sig)
    results, tmp = tiny
    argv = ["--nanogpt", str(nanogpt), "--quick", "--json", "--only", ADAMW, "--only", MUON]
    rc, out, err = run(argv, capsys)
    assert rc == 128 + sig.value, err
    assert out == ""  # no report
    lines = err.splitlines()
    assert lines[-1] == (
        f"speedrun.py: stopped by {sig.name}: {ADAMW}, seed 1337, at step 20; no report written"
    ), err
    assert f"[seed 1337] {ADAMW} ..." in lines and f"[seed 1337] {MUON} ..." not in lines
    assert "--resume" not in err and "final val None" not in err
    assert os.listdir(results) == [] and work_folders(tmp) == []


def test_ctrl_c_in_the_reference_stops_at_once(nanogpt, tiny, monkeypatch, capsys):
    """SIGINT in nanoGPT's loop (Python's own KeyboardInterrupt): one line, exit 130, nothing
    else run or written, the work folder removed."""
    build = speedrun.nanogpt_model

    def interrupting_model(module, vocab):
        model = build(module, vocab)
        forward, calls = model.forward, []

        def counting(idx, targets):
            calls.append(1)
            if len(calls) == 5:
                os.kill(os.getpid(), signal.SIGINT)
            return forward(idx, targets)

        model.forward = counting
        return model

    monkeypatch.setattr(speedrun, "nanogpt_model", interrupting_model)
    results, tmp = tiny
    rc, out, err = run(["--nanogpt", str(nanogpt), "--quick", "--json"], capsys)
    assert rc == 130 and out == "", err
    assert err.splitlines()[-1] == (
        "speedrun.py: stopped by SIGINT: nanoGPT, seed 1337; no report written"
    )
    assert f"[seed 1337] {ADAMW} ..." not in err
    assert os.listdir(results) == [] and work_folders(tmp) == []


def test_a_quick_run_reports_and_cleans_up(nanogpt, tiny, capsys):
    """A whole --quick run: exit 0, the report and results file, every median a number; the
    work folder removed, or kept and named with --keep."""
    results, tmp = tiny
    argv = ["--nanogpt", str(nanogpt), "--quick", "--json", "--only", ADAMW]
    rc, out, err = run(argv, capsys)
    assert rc == 0, err
    assert "median nan" not in out and "median - ms/step" not in out
    (written,) = results.glob("*.json")
    report = json.loads(written.read_text())
    assert [r["entrant"] for r in report["entrants"]] == ["nanoGPT", ADAMW]
    assert all(r["median_ms_per_step"] > 0 for r in report["entrants"])
    assert [r["steps_run"] for r in report["runs"]] == [60, 60]  # the target is out of reach
    assert report["runs"][1]["recipe_steps"] == 60
    assert work_folders(tmp) == []
    rc, _, err = run([*argv, "--keep"], capsys)
    assert rc == 0
    (kept,) = work_folders(tmp)
    assert f"kept the working folder {kept}" in err
    assert (kept / f"{ADAMW.replace(' ', '_')}-1337" / "metrics.jsonl").is_file()


def test_reaching_the_target_ends_the_run_at_that_step_and_keeps_its_settings(
    nanogpt, tiny, monkeypatch, capsys
):
    """Our entrant stops at the first evaluation at or below the target (step 20 of 60 here):
    the report counts 20 steps, to the target, of a 60-step recipe; the run's checkpoint at that
    step records the stop, and its settings (state.json, run.json, what --resume would start
    from) keep max_steps=60: the stop is no change of the recipe."""
    from llm_foundry.rundir import RunDir, read_state
    from llm_foundry.train.state import resume_point

    monkeypatch.setattr(speedrun, "TARGET", 100.0)  # reached at the first evaluation
    results, tmp = tiny
    argv = ["--nanogpt", str(nanogpt), "--quick", "--json", "--only", ADAMW, "--keep"]
    rc, out, err = run(argv, capsys)
    assert rc == 0, err
    (written,) = results.glob("*.json")
    ours = json.loads(written.read_text())["runs"][1]
    assert ours["entrant"] == ADAMW
    assert (ours["steps_run"], ours["target_step"], ours["recipe_steps"]) == (20, 20, 60)
    assert [c["step"] for c in ours["curve"]] == [20]
    assert ours["target_train_s"] == ours["train_s"]  # the clock stopped at the target's step
    (kept,) = work_folders(tmp)
    run_dir = RunDir(kept / f"{ADAMW.replace(' ', '_')}-1337")
    ckpt = run_dir.latest()
    state = read_state(ckpt)
    assert state["step"] == 20 and state["stopped_early"]["step"] == 20
    assert "target" in state["stopped_early"]["reason"]
    assert state["train_config"]["max_steps"] == 60
    assert run_dir.info()["train"]["max_steps"] == 60
    assert resume_point(run_dir.path)[2].max_steps == 60
