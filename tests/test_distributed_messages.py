"""What a torchrun job of 2 CPU ranks (gloo) prints: a message that follows from the command
line (a usage error, a stop signal, how to go on) once, by rank 0; one that may differ between
ranks (an I/O error) by each rank, with its rank; and advice to run a job again that launches it
as it was launched (torchrun, its processes per node), from run.json's record of the command."""

from __future__ import annotations

import json
import shlex
import textwrap
from pathlib import Path

import pytest
from test_distributed import TRAIN, _flags, torchrun

pytestmark = pytest.mark.heavy  # subprocesses: left out of `make test-fast`

# every rank raises (or is signalled) after step 2 of a run that would save only at its end
FAILING = """
import os, signal, sys
from torch.distributed.elastic.multiprocessing.errors import record
from llm_foundry.cli import main
from llm_foundry.train.trainer import Trainer

original = Trainer._train_step

def step(self, *args, **kwargs):
    if self.step == 2:
        how = os.environ["FAIL_HOW"]
        if how == "crash":
            raise RuntimeError(f"power cut on rank {self.world.rank}")
        if how == "disk":
            raise OSError(f"disk on fire on rank {self.world.rank}")
        if how == "value":  # what every rank's data says alike
            raise ValueError("token id 99 past the vocabulary")
        if how == "value-rank1":  # what one rank's data alone says (rank 0 goes on)
            if self.world.rank == 1:
                raise ValueError("token id 99 past the vocabulary in rank 1's shard")
            return original(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # what torchrun hands each rank when stopped
    return original(self, *args, **kwargs)

Trainer._train_step = step
sys.exit(record(main)())
"""


@pytest.fixture(scope="module")
def data_dir(char_data) -> Path:
    return char_data(30_000)


def failing(tmp_path: Path, how: str, args: list[str], monkeypatch):
    """torchrun of ``args`` whose ranks all fail ``how`` after step 2."""
    script = tmp_path / "failing.py"
    script.write_text(textwrap.dedent(FAILING))
    monkeypatch.setenv("FAIL_HOW", how)  # torchrun's workers inherit it
    return torchrun(args, script=str(script), timeout=180)


def start(data_dir: Path, run: Path, **train) -> list[str]:
    args = ["train", "--data", str(data_dir), "--out", str(run)]
    return args + _flags(**{**TRAIN, "checkpoint_interval": 0, "eval_interval": 0},
                         batch_size=4, max_steps=6, **train)  # fmt: skip


def test_a_job_that_never_saved_is_told_to_launch_its_command_again_with_torchrun(
    data_dir, tmp_path, monkeypatch
):
    run = tmp_path / "run"
    args = start(data_dir, run, parallel="fsdp")
    r = failing(tmp_path, "crash", args, monkeypatch)
    assert r.returncode != 0 and "power cut on rank" in r.stdout + r.stderr
    assert not (run / "checkpoints").exists()
    launch = json.loads((run / "run.json").read_text())["commands"][0]["launch"]
    assert launch == dict(world_size=2, torchrun=dict(nproc_per_node=2, nnodes=1))
    r = torchrun(["train", "--out", str(run), "--resume"])
    assert r.returncode != 0  # torchrun's status when a rank fails
    lines = [s for s in (r.stdout + r.stderr).splitlines() if "llm-foundry train: error:" in s]
    assert len(lines) == 1, r.stdout + r.stderr  # said by rank 0 alone
    said, _, command = lines[0].partition("without --resume: ")
    words = shlex.split(command)
    assert words[:5] == ["torchrun", "--nproc-per-node", "2", "-m", "llm_foundry"], command
    assert words[5:] == args, command
    # run as printed (torchrun standalone here), it trains the job it was: 2 FSDP ranks
    r = torchrun(words[5:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    info = json.loads((run / "run.json").read_text())
    assert (info["world_size"], info["parallel"]) == (2, "fsdp")


def test_an_io_error_is_said_by_each_rank_with_its_rank(data_dir, tmp_path, monkeypatch):
    r = failing(tmp_path, "disk", start(data_dir, tmp_path / "run", parallel="ddp"), monkeypatch)
    assert r.returncode != 0
    err = r.stdout + r.stderr
    for rank in (0, 1):
        line = f"rank {rank}: llm-foundry train: error: disk on fire on rank {rank}"
        assert err.count(line) == 1, err


def test_a_value_error_is_said_once_and_one_rank_alone_says_its_own(data_dir, tmp_path,
                                                                     monkeypatch):  # fmt: skip
    """Raised alike on every rank: rank 0 says it, once, with no rank. Raised by rank 1 alone
    (rank 0 goes on into the next step's collectives): rank 1 says it, with its rank (dropped
    as said by rank 0, it was said by none)."""
    for how, line in [
        ("value", "llm-foundry train: error: token id 99 past the vocabulary"),
        ("value-rank1", "rank 1: llm-foundry train: error: token id 99 past the vocabulary in "
                        "rank 1's shard"),
    ]:  # fmt: skip
        r = failing(tmp_path, how, start(data_dir, tmp_path / how, parallel="ddp"), monkeypatch)
        said = [s for s in (r.stdout + r.stderr).splitlines() if "error: token id 99" in s]
        assert r.returncode != 0 and said == [line], r.stdout + r.stderr


def test_a_stop_signal_is_said_once(data_dir, tmp_path, monkeypatch):
    run = tmp_path / "run"
    r = failing(tmp_path, "signal", start(data_dir, run, parallel="ddp"), monkeypatch)
    err = r.stdout + r.stderr
    assert err.count("llm-foundry train: stopped by SIGTERM: 3 of 6 steps done") == 1, err
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 3
