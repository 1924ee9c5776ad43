"""A sharded (DCP) checkpoint that does not fit, on 2 CPU processes (torchrun, gloo, FSDP2): one
rank's full disk stops every rank with the gathered save's one line, said once (by rank 0), and
no rank leaves its bytes behind. One process: tests/test_dcp.py."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from test_distributed import TRAIN, _flags, torchrun

pytestmark = pytest.mark.heavy  # subprocesses: left out of `make test-fast`

# a script that runs the command with the disk of one rank full from the save of step 4 on:
# WHERE is "shards" (DCP's file writes, on rank 1) or "state" (state.json, on rank 0 alone)
FULL_DISK = """
import errno, os, sys
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.elastic.multiprocessing.errors import record
import llm_foundry.train.dcp as train_dcp
from llm_foundry.cli import main

WHERE = {where!r}


def full():
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


write_data, write_state = FileSystemWriter.write_data, train_dcp.write_state


def shards(self, plan, planner):
    if WHERE == "shards" and dist.get_rank() == 1 and ".tmp-step_000004" in str(self.path):
        full()
    return write_data(self, plan, planner)


def state(tmp, step, *args, **kwargs):
    if WHERE == "state" and step == 4:
        full()
    return write_state(tmp, step, *args, **kwargs)


FileSystemWriter.write_data, train_dcp.write_state = shards, state
sys.exit(record(main)())
"""


@pytest.fixture(scope="module")
def data_dir(char_data) -> Path:
    return char_data(30_000)


def _full_at_step_4(script_text: str, fmt: str, data_dir, tmp_path, **kw):
    """2 FSDP ranks saving every 2 steps under ``script_text`` (which fills the disk at step 4),
    checked to stop with the one line, said once, and step 2 kept as the last checkpoint."""
    script = tmp_path / "full.py"
    script.write_text(textwrap.dedent(script_text))
    run = tmp_path / "run"
    flags = {**TRAIN, "checkpoint_interval": 2, "eval_interval": 0, "keep_last": 1}
    args = ["train", "--data", str(data_dir), "--out", str(run)]
    r = torchrun(args + _flags(**flags, batch_size=4, max_steps=6, parallel="fsdp",
                               checkpoint_format=fmt), script=str(script), **kw)  # fmt: skip
    root = run / "checkpoints"
    said = (
        f"llm-foundry train: could not write checkpoint {root / 'step_000004'}: no space left on "
        f"device; the last complete checkpoint is {root / 'step_000002'}; free space, then "
        f"--resume --out {run}"
    )
    lines = r.stderr.splitlines()
    assert r.returncode != 0 and lines.count(said) == 1, r.stderr[-3000:]
    assert not any("could not write checkpoint" in line for line in lines if line != said)
    assert "CheckpointNotWritten" not in r.stderr
    assert sorted(p.name for p in root.iterdir()) == ["latest.json", "step_000002"]
    assert json.loads((root / "latest.json").read_text())["step"] == 2
    return r, root


@pytest.mark.parametrize("where", ["shards", "state"])
def test_one_ranks_full_disk_stops_every_rank_in_one_line(where, data_dir, tmp_path):
    # every rank stops with it (DCP gathers each rank's error; rank 0 holds its own): said once,
    # and no rank's traceback (the launcher's own says which ranks exited 1)
    r, _ = _full_at_step_4(FULL_DISK.format(where=where), "dcp", data_dir, tmp_path)
    assert "CheckpointException" not in r.stderr


# rank 0 alone puts a checkpoint in place: its disk full at step 4's commit, before the rename
# (WHERE "fsync": the files' fsync) or after it (WHERE "latest": latest.json not written)
FULL_AT_COMMIT = """
import errno, os, sys, time
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
import llm_foundry.train.state as train_state
from llm_foundry.cli import main
from llm_foundry.train.dcp import ShardedCheckpoints

WHERE, MARK = {where!r}, {mark!r}
fsync_tree, write_json_atomic = train_state.fsync_tree, train_state.write_json_atomic


def full():
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def fsync(path):
    if WHERE == "fsync" and dist.get_rank() == 0 and ".tmp-step_000004" in str(path):
        full()
    return fsync_tree(path)


def latest(path, obj):
    if WHERE == "latest" and dist.get_rank() == 0 and obj.get("step") == 4:
        full()
    return write_json_atomic(path, obj)


def finish(self, quiet=False):  # which ranks raise it themselves (not stopped by the launcher)
    try:
        return finish_dcp(self, quiet)
    except Exception as e:
        rank = dist.get_rank()
        # its own file, not stdout: two ranks' prints share one pipe and can interleave mid-line
        with open(f"{{MARK}}.tmp{{rank}}", "w") as f:
            f.write(str(e))
        os.replace(f"{{MARK}}.tmp{{rank}}", f"{{MARK}}.{{rank}}")
        # the launcher stops the other rank once one exits: each waits (30 s at most) for the
        # other's word, so a slow rank is not taken for one that never raised
        other, deadline = f"{{MARK}}.{{1 - rank}}", time.monotonic() + 30
        while not os.path.exists(other) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise


finish_dcp = ShardedCheckpoints.finish
train_state.fsync_tree, train_state.write_json_atomic = fsync, latest
ShardedCheckpoints.finish = finish
sys.exit(record(main)())
"""


@pytest.mark.parametrize("where, fmt", [("fsync", "dcp"), ("latest", "dcp"),
                                        ("fsync", "dcp-async")])  # fmt: skip
def test_rank0s_failed_commit_stops_every_rank_in_one_line(where, fmt, data_dir, tmp_path):
    """Rank 0's commit of step 4 fails on a full disk (the other rank's shards all written):
    every rank stops at once (none waits in the next step's collectives until a timeout), the
    error said once; after the rename, the directory is taken back, as the line says. With
    dcp-async the commit fails in the background: every rank stops at the next save."""
    # the training group's timeout is minutes: a rank left waiting would overrun this
    script = FULL_AT_COMMIT.format(where=where, mark=str(tmp_path / "raised"))
    r, root = _full_at_step_4(script, fmt, data_dir, tmp_path, timeout=120)
    assert "Traceback" not in r.stdout
    # each rank raised it (before, rank 1 went on, and only the launcher ended it)
    raised = {rank: tmp_path / f"raised.{rank}" for rank in (0, 1)}
    assert all(p.exists() for p in raised.values()), r.stdout[-2000:]
    for p in raised.values():
        assert f"could not write checkpoint {root / 'step_000004'}" in p.read_text()
