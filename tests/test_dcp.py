"""Sharded checkpoints (train.checkpoint_format dcp | dcp-async, train/dcp.py) in one process:
exact resume, the same tensors as a full checkpoint, background saves that are snapshots and
never look complete before they are, loading for generation, ``convert --from-dcp / --to-dcp``,
and a metadata pickle that can only build DCP's own classes. More than one process (2 -> 4 -> 1
ranks): tests/test_distributed.py."""

from __future__ import annotations

import errno
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from conftest import TINY, cli_status, make_trainer
from safetensors.torch import load_file

from llm_foundry.checkpoint import DCP_DIR, load_checkpoint, read_dcp_tensors
from llm_foundry.cli import main
from llm_foundry.config import ConfigError
from llm_foundry.loading import load_any
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.distributed import World

# a constant schedule, so a run stopped at step 4 is the first 4 steps of one of 6; saves every
# 2 steps (a dcp-async run's at step 2 written while steps 3 and 4 train), evaluation at the end
RUN = dict(schedule="constant", max_steps=6, checkpoint_interval=2, eval_interval=0)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no_dist notice


@pytest.fixture(scope="module")
def data_dir(char_data) -> Path:
    return char_data(30_000)


def losses(run: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


@pytest.fixture(scope="module")
def full_run(data_dir, tmp_path_factory) -> Path:
    """6 steps saved the default way (checkpoints at 2, 4, 6; the last 2 kept); TINY has
    dropout, so the RNG states matter to an exact resume."""
    out = tmp_path_factory.mktemp("full") / "run"
    make_trainer(data_dir, out, **RUN).run()
    return out


@pytest.fixture(scope="module")
def dcp_run(data_dir, tmp_path_factory) -> Path:
    """The same run saved as dcp-async, stopped at step 4 and resumed to 6."""
    out = tmp_path_factory.mktemp("dcp") / "run"
    make_trainer(data_dir, out, **{**RUN, "max_steps": 4}, checkpoint_format="dcp-async").run()
    make_trainer(data_dir, out, resume=True, **RUN, checkpoint_format="dcp-async").run()
    return out


def test_dcp_checkpoints_hold_a_full_checkpoints_tensors_and_resume_exactly(full_run, dcp_run):
    assert losses(dcp_run) == losses(full_run) and len(losses(dcp_run)) == 6
    for step in ("step_000004", "step_000006"):
        ckpt, ref = dcp_run / "checkpoints" / step, full_run / "checkpoints" / step
        assert sorted(p.name for p in ckpt.iterdir()) == [
            "config.json", "dcp", "state.json", "tokenizer.json"
        ]  # fmt: skip
        tensors = read_dcp_tensors(ckpt / DCP_DIR)
        expected = {f"model.{k}": v for k, v in load_file(str(ref / "model.safetensors")).items()}
        expected |= {f"optim.{k}": v for k, v in load_file(str(ref / "optimizer.safetensors")).items()}  # fmt: skip
        assert tensors.keys() == expected.keys()
        assert all(torch.equal(tensors[k], expected[k]) for k in expected)
        state, ref_state = (json.loads((d / "state.json").read_text()) for d in (ckpt, ref))
        for st, fmt in ((ref_state, "full"), (state, "dcp-async")):
            assert st["train_config"].pop("checkpoint_format") == fmt
            st["train_config"].pop("max_steps")  # 4 where the dcp run was stopped, and
            st.pop("best_val"), st.pop("best_name")  # evaluated: its last step
            st.pop("elapsed")  # seconds trained: a measured time, not a state to match
        assert state == ref_state  # optimizer hyper-parameters, RNG, sampler: the same JSON


def test_generate_and_load_any_read_a_run_whose_latest_checkpoint_is_dcp(
    dcp_run, full_run, monkeypatch, capsys
):
    real_load = torch.load

    def weights_only(*args, **kwargs):  # DCP reads each tensor with torch.load: never pickle
        assert kwargs.get("weights_only") is True, kwargs
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", weights_only)
    model = load_any(dcp_run).model
    ref = load_checkpoint(full_run / "checkpoints" / "step_000006")
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())
    args = ["generate", "--checkpoint", str(dcp_run), "--prompt-ids", "1,2", "--temperature", "0"]
    assert main([*args, "--max-new-tokens", "3"]) == 0


def test_convert_round_trips_both_ways(full_run, dcp_run, tmp_path):
    """full -> dcp -> full gives the same files' tensors and state; dcp -> full -> dcp the same
    sharded tensors. The full copy of a dcp checkpoint is a full checkpoint of that step."""
    src = full_run / "checkpoints" / "step_000006"
    assert main(["convert", "--to-dcp", str(src), "--out", str(tmp_path / "d")]) == 0
    assert main(["convert", "--from-dcp", str(tmp_path / "d"), "--out", str(tmp_path / "f")]) == 0
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(str(src / name)), load_file(str(tmp_path / "f" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("state.json", "config.json", "tokenizer.json"):
        assert (src / name).read_bytes() == (tmp_path / "f" / name).read_bytes()
    assert main(["convert", "--from-dcp", str(dcp_run), "--out", str(tmp_path / "f2")]) == 0
    assert main(["convert", "--to-dcp", str(tmp_path / "f2"), "--out", str(tmp_path / "d2")]) == 0
    a = read_dcp_tensors(dcp_run / "checkpoints" / "step_000006" / DCP_DIR)
    b = read_dcp_tensors(tmp_path / "d2" / DCP_DIR)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(str(src / name)), load_file(str(tmp_path / "f2" / name))
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_tied_embeddings_are_stored_once_and_come_back_tied(tmp_path):
    """A model checkpoint (no optimizer, no state) with tied embeddings: --to-dcp stores the
    shared matrix once, as safetensors does; --from-dcp and loading give it both names again."""
    from llm_foundry.checkpoint import save_checkpoint
    from llm_foundry.config import ModelConfig
    from llm_foundry.models import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=65, dim=32, n_layers=2, n_heads=2, tie_embeddings=True)
    src = save_checkpoint(Transformer(cfg), tmp_path / "src")
    assert main(["convert", "--to-dcp", str(src), "--out", str(tmp_path / "d")]) == 0
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json", "dcp"]
    stored = read_dcp_tensors(tmp_path / "d" / DCP_DIR)
    assert "model.tok_emb.weight" in stored and "model.lm_head.weight" not in stored
    assert main(["convert", "--from-dcp", str(tmp_path / "d"), "--out", str(tmp_path / "f")]) == 0
    for model in (load_checkpoint(tmp_path / "d"), load_checkpoint(tmp_path / "f")):
        assert model.lm_head.weight is model.tok_emb.weight
        ref = load_checkpoint(src).state_dict()
        assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
    assert (
        load_file(str(src / "model.safetensors")).keys()
        == load_file(str(tmp_path / "f" / "model.safetensors")).keys()
    )


def test_convert_refuses_the_wrong_direction_in_one_line(full_run, dcp_run, tmp_path, capsys):
    cases = [
        (["--from-dcp", str(full_run)], "is a full checkpoint already; --to-dcp shards one"),
        (["--to-dcp", str(dcp_run)], "is a sharded (DCP) checkpoint already; --from-dcp"),
    ]
    for args, says in cases:
        status, err = cli_status(["convert", *args, "--out", str(tmp_path / "x")], capsys)
        assert status == 2 and says in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "x").exists()


def test_metadata_naming_anything_but_dcp_classes_is_refused(dcp_run, tmp_path):
    """DCP's index is a pickle: one that would call os.system is refused, and nothing runs."""
    import shutil

    ckpt = shutil.copytree(dcp_run / "checkpoints" / "step_000006", tmp_path / "ckpt")
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (ckpt / DCP_DIR / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ValueError, match=r"refers to posix\.system|refers to os\.system") as e:
        load_checkpoint(ckpt)
    assert "\n" not in str(e.value) and not marker.exists()
    (ckpt / DCP_DIR / ".metadata").unlink()  # a writer that stopped before the end
    with pytest.raises(FileNotFoundError, match="not a complete sharded"):
        load_checkpoint(ckpt)


def test_a_missing_or_cut_data_file_is_an_incomplete_checkpoint_named_in_one_line(
    dcp_run, tmp_path, capsys
):
    """A shard file lost (or cut short) after the save: the error says the checkpoint is
    incomplete and names the file, not that it does not fit the model."""
    import shutil

    ckpt = shutil.copytree(dcp_run / "checkpoints" / "step_000006", tmp_path / "ckpt")
    shard = ckpt / DCP_DIR / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:100])  # the model's tensors come first: cut into them
    args = ["generate", "--checkpoint", str(ckpt), "--prompt-ids", "1,2", "--max-new-tokens", "1"]
    code, err = cli_status(args, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"the sharded checkpoint is incomplete: {shard} holds 100 bytes" in err
    shard.unlink()
    code, err = cli_status(args, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"the sharded checkpoint is incomplete: {shard} is missing (1 of the 1 data files" in err


def test_a_background_save_is_a_snapshot_and_complete_only_once_committed(data_dir, tmp_path):
    from llm_foundry.train.dcp import ShardedCheckpoints

    t = make_trainer(data_dir, tmp_path / "run", **{**RUN, "max_steps": 1})
    t.run()
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    saver = ShardedCheckpoints(t.ckpt_root, World(), background=True, keep_last=2)
    path = saver.save(2, t.model, t.model, t.optimizer, {}, None, set(), blocking=False)
    with torch.no_grad():  # training goes on and changes the weights while it is written
        for p in t.model.parameters():
            p.add_(1.0)
    assert not path.exists()  # not in place, nor named by latest.json, before it is committed
    assert json.loads((t.ckpt_root / "latest.json").read_text())["step"] == 1
    assert saver.finish() == path and path.exists()
    assert json.loads((t.ckpt_root / "latest.json").read_text())["step"] == 2
    saved = read_dcp_tensors(path / DCP_DIR)
    assert all(torch.equal(saved[f"model.{k}"], v) for k, v in before.items())


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


CLI_MODEL = [f"--model.{k}={v}" for k, v in TINY.items()]
CLI_RUN = ["--train.schedule=constant", "--train.eval_interval=0", "--train.batch_size=4",
           "--train.block_size=32", "--train.sample_tokens=0", "--train.progress=false",
           "--train.checkpoint_interval=2", "--train.keep_last=1", "--train.eval_batches=2"]  # fmt: skip


@pytest.mark.parametrize("fmt", ["dcp", "dcp-async"])
@pytest.mark.parametrize("where", ["shards", "state.json"])
def test_a_full_disk_while_saving_shards_is_one_line_and_leaves_nothing_behind(
    fmt, where, data_dir, tmp_path, capsys, monkeypatch
):
    """A sharded checkpoint that does not fit (DCP's shard files, or rank 0's state.json before
    them): exit 1 with the gathered save's line (the checkpoint, the reason, the last complete
    checkpoint, what to do); its temporary directory removed; --resume goes on once there is
    room."""
    from torch.distributed.checkpoint import FileSystemWriter

    import llm_foundry.train.dcp as train_dcp

    if where == "shards":
        original = FileSystemWriter.write_data

        def full_from_step_4(self, plan, planner):
            if ".tmp-step_000004" in str(self.path):
                _enospc()
            return original(self, plan, planner)

        monkeypatch.setattr(FileSystemWriter, "write_data", full_from_step_4)
    else:
        original = train_dcp.write_state

        def full_from_step_4(tmp, step, *args, **kwargs):
            if step == 4:
                _enospc()
            return original(tmp, step, *args, **kwargs)

        monkeypatch.setattr(train_dcp, "write_state", full_from_step_4)
    run = tmp_path / "run"
    argv = ["train", "--data", str(data_dir), "--out", str(run), *CLI_MODEL]
    argv += [*CLI_RUN, "--train.max_steps=6", f"--train.checkpoint_format={fmt}"]
    status, err = cli_status(argv, capsys)
    root = run / "checkpoints"
    assert status == 1, err
    assert err.strip().splitlines()[-1] == (
        f"llm-foundry train: could not write checkpoint {root / 'step_000004'}: no space left on "
        f"device; the last complete checkpoint is {root / 'step_000002'}; free space, then "
        f"--resume --out {run}"
    )
    assert "Traceback" not in err and not list(root.glob(".tmp-*"))
    assert sorted(p.name for p in root.iterdir()) == ["latest.json", "step_000002"]
    monkeypatch.undo()  # space freed
    assert main(["train", "--out", str(run), "--resume"]) == 0
    assert json.loads((root / "latest.json").read_text())["step"] == 6
    assert sorted(losses(run)) == list(range(1, 7))


@pytest.mark.parametrize("fmt", ["dcp", "dcp-async"])
def test_a_failed_write_stops_the_run_in_one_line_and_never_becomes_latest(
    fmt, data_dir, tmp_path, monkeypatch
):
    from torch.distributed.checkpoint import FileSystemWriter

    from llm_foundry.train.state import CheckpointNotWritten

    def full_disk(self, plan, planner):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    run = tmp_path / "run"
    with pytest.raises(CheckpointNotWritten) as e:  # dcp-async: at step 3, the first look
        make_trainer(data_dir, run, **RUN, checkpoint_format=fmt).run()
    root = run / "checkpoints"
    assert str(e.value) == (
        f"could not write checkpoint {root / 'step_000002'}: OSError: disk full (simulated); "
        "the last complete checkpoint is none (the run has saved none yet)"
    )
    assert e.value.last is None and not e.value.no_space
    assert not (root / "latest.json").exists() and not list(root.glob("step_*"))
    assert not list(root.glob(".tmp-*"))  # what it wrote is removed


def test_a_save_that_fails_otherwise_is_one_line_and_not_a_full_disk(data_dir, tmp_path,
                                                                     monkeypatch):  # fmt: skip
    """A DCP failure that is not a write (a bug): not reworded as a disk problem, but said in
    one line naming the step and the rank's error (DCP's own message is a traceback a rank)."""
    from torch.distributed.checkpoint import FileSystemWriter

    def broken(self, plan, planner):
        raise ValueError("a bug (simulated)")

    monkeypatch.setattr(FileSystemWriter, "write_data", broken)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError) as e:
        make_trainer(data_dir, run, **RUN, checkpoint_format="dcp").run()
    assert str(e.value).startswith("the checkpoint of step 2 was not written")
    assert "rank 0: ValueError: a bug (simulated)" in str(e.value) and "\n" not in str(e.value)
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_a_stop_signal_during_a_background_write_leaves_both_checkpoints_complete(
    data_dir, full_run, tmp_path
):
    """SIGTERM at step 3, while step 2's checkpoint is written in the background: the stop
    waits for it, saves step 3 and returns with both in place; the resume is exact."""
    import signal

    run = tmp_path / "run"
    t = make_trainer(data_dir, run, **RUN, checkpoint_format="dcp-async")
    step = t._train_step

    def signalled(*args, **kwargs):
        if t.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(*args, **kwargs)

    t._train_step = signalled
    result = t.run()
    assert result.stopped_by == "SIGTERM" and result.step == 3
    root = run / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000002", "step_000003"]
    assert json.loads((root / "latest.json").read_text())["step"] == 3
    assert not list(root.glob(".tmp-*"))
    make_trainer(data_dir, run, resume=True, **RUN, checkpoint_format="dcp-async").run()
    assert losses(run) == losses(full_run)


def test_checkpoint_format_is_checked_in_one_line():
    with pytest.raises(ConfigError) as e:
        TrainConfig(checkpoint_format="sharded")
    assert "checkpoint_format='sharded' is not one of full, dcp, dcp-async" in str(e.value)
