"""Trainer.should_stop: a subclass ends a run before max_steps; the step it names is the last
trained, logged and checkpointed (its reason recorded there and in the RunResult), the run's
settings keep the max_steps asked for, and resuming the run trains on to max_steps with the
losses of a run never stopped, bit for bit."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import make_trainer

from llm_foundry.checkpoint import load_checkpoint
from llm_foundry.rundir import RunDir, read_state
from llm_foundry.train import trainer as trainer_module
from llm_foundry.train.state import resume_point

REASON = "val loss at or below the target"


@pytest.fixture(scope="module")
def data_dir(char_data) -> Path:
    """A small character-level corpus (Shakespeare when the shared copy is there)."""
    return char_data(60_000)


class StopAt(trainer_module.Trainer):
    """Stops after step ``at`` with ``answer`` (a reason, or any value a subclass might return);
    records each step it was asked at, and whether that step's evaluation had run by then."""

    at: int = 0
    answer: object = REASON

    def should_stop(self):
        self.asked.append((self.step, self.best_name))
        return self.answer if self.step == self.at else None


def stop_at(monkeypatch, at: int, answer: object = REASON) -> list:
    """make_trainer builds StopAt(at, answer) from now on; returns the list of its (step, best
    checkpoint then) at each should_stop."""
    asked: list = []
    cls = type("Stop", (StopAt,), dict(at=at, answer=answer, asked=asked))
    monkeypatch.setattr("conftest.Trainer", cls)
    return asked


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in RunDir(run).metrics() if "loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory) -> Path:
    """The run never stopped: 12 steps, evaluated and saved every 4."""
    out = tmp_path_factory.mktemp("whole")
    make_trainer(data_dir, out).run()
    return out


@pytest.mark.parametrize("fmt", ["full", "dcp-async"])
def test_should_stop_ends_the_run_at_that_step_with_its_checkpoint(
    data_dir, uninterrupted, tmp_path, monkeypatch, fmt
):
    """Stopped after step 6 of 12 (no evaluation or checkpoint due there): steps 1-6 are trained
    and logged as in the uninterrupted run, step 6's checkpoint is written (complete when run()
    returns, as the last one is) holding the model trained and the reason; the settings recorded
    (state.json, run.json, what a resume starts from) keep max_steps=12. The hook is asked at
    every step, after that step's evaluation (step 4's best checkpoint is known then)."""
    asked = stop_at(monkeypatch, 6)
    out = tmp_path / "run"
    t = make_trainer(data_dir, out, checkpoint_format=fmt)
    result = t.run()
    assert (result.step, result.stopped_early) == (6, REASON)
    assert not result.interrupted and result.stopped_by is None
    assert asked == [(1, None), (2, None), (3, None), (4, "step_000004"), (5, "step_000004"),
                     (6, "step_000004")]  # fmt: skip
    whole = losses(uninterrupted)
    assert losses(out) == {s: whole[s] for s in range(1, 7)}
    assert [r["step"] for r in RunDir(out).metrics() if "val_loss" in r] == [4]
    ckpt = RunDir(out).latest()
    assert ckpt == out / "checkpoints" / "step_000006" and result.checkpoint == ckpt
    state = read_state(ckpt)
    assert state["step"] == 6 and state["stopped_early"] == {"step": 6, "reason": REASON}
    assert read_state(out / "checkpoints" / "step_000004")["stopped_early"] is None
    saved = load_checkpoint(ckpt).state_dict()
    trained = t.model.state_dict()
    assert all(torch.equal(saved[k], trained[k]) for k in trained)
    assert state["train_config"]["max_steps"] == 12
    assert RunDir(out).info()["train"]["max_steps"] == 12
    assert resume_point(out)[2].max_steps == 12


@pytest.mark.heavy  # two runs and a resume: ~7 s
def test_resuming_a_stopped_run_trains_on_to_max_steps_bit_for_bit(
    data_dir, uninterrupted, tmp_path, monkeypatch, caplog
):
    """The stop is the subclass's, not the run's end: a plain Trainer resuming it says where and
    why it stopped and trains steps 7-12 with the uninterrupted run's losses, exactly; its own
    checkpoints record no stop."""
    stop_at(monkeypatch, 6)
    out = tmp_path / "run"
    make_trainer(data_dir, out).run()
    monkeypatch.undo()
    with caplog.at_level(logging.INFO, logger=trainer_module.__name__):
        result = make_trainer(data_dir, out, resume=True).run()
    assert f"note: the run stopped early at step 6 ({REASON}); resuming trains it on to " \
           "max_steps=12" in caplog.text  # fmt: skip
    assert (result.step, result.stopped_early) == (12, None)
    assert losses(out) == losses(uninterrupted)
    assert read_state(RunDir(out).latest())["stopped_early"] is None


@pytest.mark.parametrize("answer, reason", [(True, "should_stop()"), (False, None), ("", None)])
def test_a_bare_true_stops_and_false_or_empty_goes_on(data_dir, tmp_path, monkeypatch, answer,
                                                      reason):  # fmt: skip
    """A subclass answering a bool (not a reason) is read as meant: True stops, False goes on."""
    stop_at(monkeypatch, 2, answer)
    result = make_trainer(data_dir, tmp_path / "run", max_steps=3).run()
    assert (result.step, result.stopped_early) == ((2, reason) if reason else (3, None))


def test_the_last_step_is_no_early_stop(data_dir, tmp_path, monkeypatch):
    """The hook is not asked at max_steps (the run ends there anyway): a stop it would name
    there is not recorded as an early one."""
    asked = stop_at(monkeypatch, 3)
    result = make_trainer(data_dir, tmp_path / "run", max_steps=3).run()
    assert (result.step, result.stopped_early) == (3, None)
    assert [s for s, _ in asked] == [1, 2]
    assert read_state(RunDir(tmp_path / "run").latest())["stopped_early"] is None


def test_a_signal_at_the_step_the_hook_stops_still_counts(data_dir, tmp_path, monkeypatch):
    """SIGTERM caught during the step the hook ends: the run is interrupted (its caller stops
    as after any signal) and the stop is recorded too."""
    asked: list = []

    class SignalledThenStop(StopAt):
        def should_stop(self):
            if self.step == self.at:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().should_stop()

    cls = type("Stop", (SignalledThenStop,), dict(at=2, answer=REASON, asked=asked))
    monkeypatch.setattr("conftest.Trainer", cls)
    result = make_trainer(data_dir, tmp_path / "run", max_steps=6).run()
    assert (result.step, result.stopped_by, result.stopped_early) == (2, "SIGTERM", REASON)
    assert result.interrupted and [s for s, _ in asked] == [1, 2]


# ----------------------------------------------------------------------------------------------
# Two ranks: one rank's stop ends the run on both

SCRIPT = """
import sys
from llm_foundry.presets import get_preset
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.trainer import Trainer


class RankOneStops(Trainer):
    def should_stop(self):
        return "rank 1's budget" if self.world.rank == 1 and self.step == 3 else None


cfg = get_preset("llama-shakespeare-char", dim=32, n_layers=1, n_heads=2, max_seq_len=16)
tc = TrainConfig(block_size=16, batch_size=2, max_steps=8, eval_interval=4, eval_batches=1,
                 checkpoint_interval=4, sample_tokens=0, progress=False, parallel="ddp")
trainer = RankOneStops(cfg, tc, sys.argv[1], sys.argv[2])
result = trainer.run()
# a file per rank: two ranks' prints share one pipe and can interleave mid-line
with open(f"{sys.argv[3]}.{trainer.world.rank}", "w") as f:
    f.write(f"step {result.step}: {result.stopped_early}")
"""


@pytest.mark.heavy
def test_one_ranks_stop_ends_the_run_on_every_rank(data_dir, tmp_path):
    """Under torchrun (2 gloo ranks) rank 1 alone asks to stop after step 3: both ranks stop
    there (neither waits for the other in a collective), and step 3's checkpoint records rank
    1's reason (rank 0 writes it; its RunResult, the one summary.json is written from, too)."""
    script = tmp_path / "stop.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    run = tmp_path / "run"
    said = tmp_path / "said"
    r = subprocess.run([*launch, str(script), str(data_dir), str(run), str(said)], env=env,
                       capture_output=True, text=True, timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    said = [Path(f"{said}.{rank}").read_text() for rank in (0, 1)]
    # every rank records rank 1's own reason, rank 0's state.json too
    assert said == ["step 3: rank 1: rank 1's budget"] * 2, r.stdout
    state = json.loads((run / "checkpoints" / "step_000003" / "state.json").read_text())
    assert state["stopped_early"] == {"step": 3, "reason": "rank 1: rank 1's budget"}
