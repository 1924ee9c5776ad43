"""What a resumed run does with the settings given with ``--resume``: the optimizer's betas,
weight decay and Muon's settings given now are the ones it trains with (unchanged ones resume bit
for bit); what cannot change (the optimizer, the starting model, the architecture, a preset's
architecture) is refused in one line; model fields no weight depends on (dropout, the attention
kernel, init_std) are taken and named; a schedule stretched by a larger max_steps says what it
does to the lr; metrics.jsonl's time runs on; a run training now is said to be in use."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY, cli_status, make_trainer

from llm_foundry.cli import main
from llm_foundry.rundir import read_state
from llm_foundry.train import state as train_state
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.optim import build_optimizer, group_settings
from llm_foundry.train.schedule import lr_at


@pytest.fixture(scope="module")
def data_dir(char_data) -> Path:
    return char_data(20_000)


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _cut_at_8(run: Path, copy: Path) -> Path:
    """A copy of the 12-step run ``run`` as a crash right after step 8 would have left it."""
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "step_000012")
    train_state.write_json_atomic(
        copy / "checkpoints" / "latest.json", {"step": 8, "path": "step_000008"}
    )
    return copy


@pytest.fixture(scope="module", params=[("adamw", "full"), ("muon", "full"), ("adamw", "dcp")])
def full_run(request, data_dir, tmp_path_factory):
    """(optimizer, checkpoint format, a finished 12-step run with checkpoints at 4, 8, 12)."""
    optimizer, form = request.param
    out = tmp_path_factory.mktemp(f"full-{optimizer}-{form}") / "run"
    make_trainer(data_dir, out, optimizer=optimizer, checkpoint_format=form, keep_last=3).run()
    return optimizer, form, out


# settings given on resume, per optimizer: each one a group of the saved run holds otherwise
CHANGED = {
    "adamw": dict(beta1=0.5, beta2=0.5, weight_decay=5.0),
    "muon": dict(
        beta2=0.5, weight_decay=5.0, muon_momentum=0.5, muon_weight_decay=0.5, muon_lr=0.05
    ),  # fmt: skip
}


def test_settings_given_on_resume_are_the_ones_the_optimizer_trains_with(
    full_run, data_dir, tmp_path
):
    """Unchanged, a resume is the run never stopped, bit for bit. With other betas, weight decay
    or Muon settings, every parameter group holds what an optimizer built for the new settings
    holds (moments and step counts stay the checkpoint's), the next checkpoint records them, and
    the losses part from the unchanged run's after the first resumed update."""
    optimizer, form, full = full_run
    kept = dict(optimizer=optimizer, checkpoint_format=form, keep_last=3)
    same = _cut_at_8(full, tmp_path / "same")
    make_trainer(data_dir, same, resume=True, **kept).run()
    assert _losses(same) == _losses(full)

    other = _cut_at_8(full, tmp_path / "other")
    t = make_trainer(data_dir, other, resume=True, **kept, **CHANGED[optimizer])
    fresh = build_optimizer(t.model, t.tc, t.device, ns_dtype=t.muon_ns_dtype() or "bf16")
    assert group_settings(t.optimizer) == group_settings(fresh)
    saved = read_state(full / "checkpoints" / "step_000008")["optimizer"]["param_groups"]
    decays = [g["weight_decay"] for g in t.optimizer.param_groups]
    assert [g["weight_decay"] for g in saved] != decays
    steps = [int(s["step"]) for s in t.optimizer.state_dict()["state"].values() if "step" in s]
    assert steps and set(steps) == {8}  # the moments and step counts are the checkpoint's
    t.run()
    recorded = read_state(other / "checkpoints" / "step_000012")["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in recorded] == [g["weight_decay"] for g in fresh.param_groups]
    if optimizer == "muon":
        muon = next(g for g in recorded if g["kind"] == "muon")
        assert (muon["momentum"], muon["weight_decay"]) == (0.5, 0.5)
        assert muon["lr_scale"] == 0.05 / t.tc.lr
    else:
        assert all(tuple(g["betas"]) == (0.5, 0.5) for g in recorded)
    a, b = _losses(same), _losses(other)
    assert all(a[s] == b[s] for s in range(1, 10))  # step 9's loss is before its update
    assert all(a[s] != b[s] for s in (10, 11, 12))


def test_another_optimizer_on_resume_is_refused_in_one_line(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "--data", str(data_dir), "--out", str(run), *_TINY, "--train.max_steps=4"]
    assert main(argv) == 0
    rc, err = cli_status(["train", "--out", str(run), "--resume", "--train.max_steps=6",
                          "--train.optimizer", "muon"], capsys)  # fmt: skip
    assert rc == 2 and err.count("\n") == 1, err
    assert "train.optimizer is 'muon'" in err and "holds the state of 'adamw'" in err
    assert f"resume with --train.optimizer adamw, or start a new run from its weights: " \
           f"--train.init_from {run} --train.optimizer muon --out NEW_DIR" in err  # fmt: skip

    # finding 5: a starting model given on resume is never loaded: refused, not recorded
    rc, err = cli_status(["train", "--out", str(run), "--resume", "--train.max_steps=6",
                          "--train.init_from", str(tmp_path)], capsys)  # fmt: skip
    assert rc == 2 and err.count("\n") == 1, err
    assert f"train.init_from '{tmp_path}', but the run was trained from scratch" in err
    assert "drop --train.init_from" in err
    info = json.loads((run / "run.json").read_text())
    assert info["train"]["init_from"] is None and info["train"]["max_steps"] == 4
    # the same start spelled another way is the same start
    tuned = tmp_path / "tuned"
    argv = ["finetune", "--checkpoint", str(run), "--data", str(data_dir), "--out", str(tuned),
            *_QUIET, "--train.max_steps=2"]  # fmt: skip
    assert main(argv) == 0
    again = ["train", "--out", str(tuned), "--resume", "--train.max_steps=3", "--train.init_from",
             f"{run}/../{run.name}"]  # fmt: skip
    rc, err = cli_status(again, capsys)
    assert rc == 0, err


_QUIET = ["--train.block_size=32", "--train.batch_size=4", "--train.eval_batches=1",
          "--train.warmup_steps=1", "--train.sample_tokens=0", "--train.progress=false"]  # fmt: skip
_TINY = [f"--model.{k}={v}" for k, v in TINY.items() if k != "vocab_size"] + _QUIET


@pytest.mark.parametrize("flag, value", [("dropout", "0.3"), ("attn_impl", "manual"),
                                         ("init_std", "0.01")])  # fmt: skip
def test_model_fields_no_weight_depends_on_may_change_on_resume(data_dir, tmp_path, capsys,
                                                                flag, value):  # fmt: skip
    run = tmp_path / "run"
    argv = ["train", "--data", str(data_dir), "--out", str(run), *_TINY, "--train.max_steps=2"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--train.max_steps=3",
                 f"--model.{flag}", value]) == 0  # fmt: skip
    out = capsys.readouterr().out
    saved = TINY[flag] if flag in TINY else {"attn_impl": "sdpa", "init_std": 0.02}[flag]
    assert f"changed training settings: max_steps 2 -> 3, model.{flag} {saved!r} -> " in out
    assert str(json.loads((run / "run.json").read_text())["model"][flag]) == value


def test_architecture_and_preset_changes_on_resume_are_refused_naming_their_source(
    data_dir, tmp_path, capsys
):
    run = tmp_path / "run"
    argv = ["train", "--data", str(data_dir), "--out", str(run), *_TINY, "--train.max_steps=2"]
    assert main(argv) == 0
    rc, err = cli_status(["train", "--out", str(run), "--resume", "--model.n_layers=3"], capsys)
    assert rc == 2 and "n_layers: saved 2, now 3" in err and "--model flags" in err
    rc, err = cli_status(["train", "--out", str(run), "--resume", "--preset",
                          "gpt2-shakespeare-char"], capsys)  # fmt: skip
    assert rc == 2 and err.count("\n") == 1, err
    assert "--preset gpt2-shakespeare-char would change" in err and "drop --preset" in err
    assert "--model" not in err and "dim 32 -> " in err


def test_a_longer_schedule_on_resume_says_the_lr_it_jumps_to_and_how_to_stay_at_the_floor(
    data_dir, tmp_path, notes
):
    run = tmp_path / "run"
    make_trainer(data_dir, run, max_steps=8).run()
    t = make_trainer(data_dir, run, resume=True, max_steps=16)
    t.release()
    old, new = TrainConfig(**{**t.tc.to_dict(), "max_steps": 8}), t.tc
    was, now = lr_at(8, old), lr_at(8, new)
    assert was == old.min_lr and now > 3 * was  # the cosine starts over from higher up
    note = next(n for n in notes if "learning-rate schedule changed" in n)
    assert f"(max_steps 8 -> 16): step 9 trains at lr {now:.3g}, where the saved schedule gives " \
           f"{was:.3g} ({now / was:.3g}x)" in note  # fmt: skip
    keep = "--train.schedule constant --train.lr 0.0001"
    assert note.endswith(f"to go on at that floor instead: {keep}")
    # those flags do: the lr of every further step is the floor the run had reached
    notes.clear()
    t = make_trainer(data_dir, run, resume=True, max_steps=16, schedule="constant", lr=1e-4)
    t.release()
    assert all(lr_at(s, t.tc) == was for s in range(8, 16))
    assert not any("learning-rate schedule changed" in n for n in notes)


def test_metrics_time_goes_on_across_a_resume(data_dir, tmp_path):
    """The run's elapsed time is in each checkpoint: a resumed run's first record comes after
    its checkpoint's; a checkpoint saved before it was recorded resumes from 0, as it did."""
    run = tmp_path / "run"
    make_trainer(data_dir, run, max_steps=8).run()
    elapsed = read_state(run / "checkpoints" / "step_000008")["elapsed"]
    times = {r["step"]: r["time"] for r in map(json.loads, (run / "metrics.jsonl").open())
             if "time" in r}  # fmt: skip
    assert times[8] <= elapsed < times[8] + 60
    make_trainer(data_dir, run, resume=True, max_steps=10).run()
    resumed = {r["step"]: r["time"] for r in map(json.loads, (run / "metrics.jsonl").open())
               if "time" in r}  # fmt: skip
    assert resumed[9] > elapsed and list(resumed.values()) == sorted(resumed.values())

    def resume_with(step: int, elapsed: float | None) -> dict:
        """The last timed record after resuming from ``step`` with its state's ``elapsed``
        replaced (None: removed, as in a checkpoint saved before it was recorded)."""
        path = run / "checkpoints" / f"step_{step:06d}" / "state.json"
        state = json.loads(path.read_text())
        state.pop("elapsed")
        if elapsed is not None:
            state["elapsed"] = elapsed
        path.write_text(json.dumps(state))
        make_trainer(data_dir, run, resume=True, max_steps=step + 1).run()
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if "time" in r][-1]

    # a day already spent goes on from a day; none recorded goes on from 0 (no timing luck)
    last = resume_with(10, 86_400.0)
    assert last["step"] == 11 and 86_400 < last["time"] < 86_400 + 600
    last = resume_with(11, None)
    assert last["step"] == 12 and last["time"] < 600


def test_resume_of_a_run_training_now_says_it_is_in_use(tmp_path, capsys):
    """Before its first checkpoint a run that is training holds its directory (another process
    holds its lock here): --resume says so, as a second start does, not that it never saved."""
    run = tmp_path / "run"
    holder = ("import sys, time; from llm_foundry import lock; lock.acquire(sys.argv[1], 'run "
              "directory'); print('held', flush=True); time.sleep(120)")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", holder, str(run)], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout.readline() == "held\n"
        rc, err = cli_status(["train", "--out", str(run), "--resume"], capsys)
    finally:
        proc.kill()
        proc.wait(60)
    assert rc == 1 and err.count("\n") == 1, err  # as a second start is answered
    assert f"run directory {run} is in use by process {proc.pid}" in err
    assert "never saved" not in err


def test_resume_of_a_run_that_never_saved_still_says_so(tmp_path, capsys):
    """No process holds it: the advice to run its command again, as before."""
    run = tmp_path / "run"
    run.mkdir()
    rc, err = cli_status(["train", "--out", str(run), "--resume"], capsys)
    assert rc == 2 and "--resume: no checkpoint in" in err and "in use" not in err
    assert sorted(p.name for p in run.iterdir()) == []  # the lock taken to look is gone


@pytest.mark.heavy
def test_settings_given_on_resume_reach_the_groups_of_fsdp_ranks(char_data, tmp_path):
    """A run saved by one process, resumed by 2 FSDP2 ranks (the full-state load that shards it)
    with other betas and weight decay: the losses of one process resumed with the same settings,
    not those of the unchanged resume."""
    from test_distributed import (
        TRAIN,
        _flags,
        _per_rank_batch,
        assert_close,
        losses,
        one_process,
        torchrun,
    )

    data = char_data(30_000)
    changed = dict(beta2=0.5, weight_decay=5.0)
    runs = {name: tmp_path / name for name in ("same", "changed", "fsdp")}
    for run in runs.values():
        one_process(data, run, max_steps=5)
    one_process(data, runs["same"], resume=True, max_steps=10)
    one_process(data, runs["changed"], resume=True, max_steps=10, **changed)
    args = ["train", "--data", str(data), "--out", str(runs["fsdp"]), "--resume"]
    flags = _flags(**TRAIN, **changed, batch_size=_per_rank_batch("fsdp", 2), max_steps=10,
                   parallel="fsdp")  # fmt: skip
    r = torchrun(args + flags)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_close(losses(runs["fsdp"]), losses(runs["changed"]))
    gap = max(abs(losses(runs["same"])[s] - losses(runs["changed"])[s]) for s in range(7, 11))
    assert gap > 1e-3  # far outside the ranks' rounding (assert_close's 2e-4)
