"""How a run was launched (run.json's ``launch``, from torchrun's environment) and the command
that launches it again the same way; a sharded parallel mode in one process says it needs
torchrun; resuming a run whose data directory moved says that --data gives where it is now.
Launches of real torchrun jobs: tests/test_distributed_messages.py."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
from conftest import cli_status, make_trainer

from llm_foundry.train.launch import launch_record, launched_command

ARGV = ["/venv/lib/llm_foundry/__main__.py", "train", "--out", "runs/x", "--train.lr", "3e-3 "]


@pytest.mark.parametrize(
    "env, record",
    [
        ({}, dict(world_size=1)),
        ({"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}, dict(world_size=1)),
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "1"},
         dict(world_size=8, torchrun=dict(nproc_per_node=8, nnodes=1))),
        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2"},
         dict(world_size=16, torchrun=dict(nproc_per_node=8, nnodes=2))),
        ({"WORLD_SIZE": "4"}, dict(world_size=4)),  # another launcher: no torchrun numbers
    ],
)  # fmt: skip
def test_the_launch_is_read_from_torchruns_environment(env, record, monkeypatch):
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launch_record() == record


def test_a_recorded_command_is_launched_again_as_it_was():
    rest = "train --out runs/x --train.lr '3e-3 '"
    assert launched_command(ARGV, None) == f"llm-foundry {rest}"
    assert launched_command(ARGV, dict(world_size=1)) == f"llm-foundry {rest}"
    one_node = dict(world_size=2, torchrun=dict(nproc_per_node=2, nnodes=1))
    assert launched_command(ARGV, one_node) == f"torchrun --nproc-per-node 2 -m llm_foundry {rest}"
    two_nodes = dict(world_size=16, torchrun=dict(nproc_per_node=8, nnodes=2))
    assert launched_command(ARGV, two_nodes) == (
        f"torchrun --nnodes 2 --nproc-per-node 8 -m llm_foundry {rest} (on each of its 2 nodes, "
        "with the rendezvous flags it had)"
    )
    other = dict(world_size=4)  # several processes, not launched by torchrun
    assert launched_command(ARGV, other) == (
        f"llm-foundry {rest} (it ran as 4 processes: launch it as it was launched)"
    )


@pytest.fixture(scope="module")
def data_dir(char_data) -> Path:
    return char_data(20_000)


@pytest.mark.parametrize("parallel, said", [("fsdp", True), ("tp", True), ("ddp", False)])
def test_a_sharded_mode_in_one_process_says_it_needs_torchrun(parallel, said, data_dir, tmp_path,
                                                               caplog):  # fmt: skip
    with caplog.at_level(logging.INFO, logger="llm_foundry"):
        make_trainer(data_dir, tmp_path / "run", parallel=parallel).release()
    note = (f"note: train.parallel={parallel} splits the model over the processes torchrun "
            "starts (torchrun --nproc-per-node N -m llm_foundry train ...); this one process "
            "holds and trains it whole")  # fmt: skip
    assert (note in caplog.text) is said, caplog.text


def test_resuming_a_run_whose_data_moved_says_to_give_where_it_is(data_dir, tmp_path, capsys,
                                                                  monkeypatch):  # fmt: skip
    data = shutil.copytree(data_dir, tmp_path / "d1")
    run = tmp_path / "run"
    flags = ["--model.dim=16", "--model.n_layers=1", "--model.n_heads=2", "--model.max_seq_len=16",
             "--train.block_size=16", "--train.batch_size=2", "--train.max_steps=2",
             "--train.eval_batches=1", "--train.sample_tokens=0", "--train.progress=false",
             "--train.warmup_steps=1"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["llm-foundry", "train"])
    code, err = cli_status(["train", "--data", str(data), "--out", str(run), *flags], capsys)
    assert code == 0, err
    moved = data.rename(tmp_path / "d2")
    code, err = cli_status(["train", "--out", str(run), "--resume", "--train.max_steps=3"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.rstrip("\n").endswith(
        f"data directory {data} (the run's, in {run / 'run.json'}) does not exist: if the "
        f"prepared data moved, give where it is now: --resume --out {run} --data NEWDIR; else "
        "prepare it there again with `llm-foundry prepare`"
    )
    resume = ["train", "--out", str(run), "--resume", "--data", str(moved), "--train.max_steps=3"]
    code, err = cli_status(resume, capsys)
    assert code == 0, err
    assert json.loads((run / "summary.json").read_text())["step"] == 3
