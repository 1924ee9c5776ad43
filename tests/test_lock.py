"""One process per output directory: real processes race for a run directory; the loser is
refused with the holder's pid; a lock left by a killed process is taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llm_foundry import ablation, lock
from llm_foundry.cli import main as cli
from llm_foundry.data import prepare
from llm_foundry.rundir import latest_checkpoint, read_records

HOLD = """
import sys, time
from llm_foundry import lock
lock.acquire(sys.argv[1], "test directory")
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _holder(directory: Path, seconds: float = 60) -> subprocess.Popen:
    """Another process holding ``directory``'s lock (until killed or ``seconds`` pass)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def held(tmp_path):
    proc = _holder(tmp_path / "busy")
    yield tmp_path / "busy", proc.pid
    proc.kill()
    proc.wait()


def test_every_writer_is_refused_a_directory_another_process_holds(held, char_data, capsys):
    busy, pid = held
    data = char_data(20_000)
    with pytest.raises(lock.DirectoryBusy, match=rf"busy is in use by process {pid}"):
        lock.acquire(busy)
    with pytest.raises(
        lock.DirectoryBusy, match=rf"data directory .*busy is in use by process {pid}"
    ):
        prepare(busy, text_files=[data.parent / "corpus.txt"], progress=False)
    argv = ["--data", str(data), "--out", str(busy), "--train.max_steps", "2"]
    assert cli(["train", *argv]) == 1
    assert f"run directory {busy} is in use by process {pid}" in capsys.readouterr().err
    study = ablation.Study.from_dict(
        dict(vary={"norm": ["rmsnorm", "layernorm"]}, model=dict(dim=32, n_layers=1, n_heads=2))
    )
    with pytest.raises(lock.DirectoryBusy, match=rf"ablation directory .*in use by process {pid}"):
        ablation.run_study(study, data, busy)
    assert sorted(p.name for p in busy.iterdir()) == [".lock"]  # nothing was written there


def test_a_lock_left_by_a_killed_process_is_taken_over_with_a_note(tmp_path, capsys):
    proc = _holder(tmp_path / "run")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (tmp_path / "run" / ".lock").read_text().startswith(f"pid={proc.pid} ")
    with lock.hold(tmp_path / "run"):
        assert f"left by process {proc.pid}" in capsys.readouterr().err
        assert (tmp_path / "run" / ".lock").read_text().startswith(f"pid={os.getpid()} ")
        with lock.hold(tmp_path / "run"):  # re-entrant within one process
            pass
        assert (tmp_path / "run" / ".lock").exists()
    assert not (tmp_path / "run" / ".lock").exists()  # released cleanly: nothing to take over
    with lock.hold(tmp_path / "run"):
        assert "took over" not in capsys.readouterr().err


def test_a_file_in_the_way_is_named(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="run directory .*f exists and is not a directory"):
        lock.acquire(tmp_path / "f", "run directory")


STEPS = 100  # long enough that the second process reaches the lock while the first trains


@pytest.mark.heavy
def test_two_train_processes_started_together_one_runs_the_other_is_refused(char_data, tmp_path):
    data = char_data(20_000)
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "llm_foundry", "train", "--data", str(data), "--out", str(out)]
    argv += ["--preset", "llama-shakespeare-char", "--model.n_layers", "1", "--model.dim", "32"]
    argv += ["--model.n_heads", "2", "--train.max_steps", str(STEPS), "--train.batch_size", "4"]
    argv += [
        "--train.block_size",
        "32",
        "--train.eval_interval",
        "100",
        "--train.eval_batches",
        "2",
    ]
    argv += ["--train.sample_tokens", "0", "--train.progress", "false", "--train.device", "cpu"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    deadline = time.monotonic() + 300
    results = [p.communicate(timeout=max(1, deadline - time.monotonic())) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 1], results
    loser = next(i for i, p in enumerate(procs) if p.returncode == 1)
    winner = procs[1 - loser]
    assert f"is in use by process {winner.pid}" in results[loser][1]
    # the run directory is the winner's alone: its metrics, each step once, its last checkpoint
    steps = [r["step"] for r in read_records(out / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, STEPS + 1))
    assert latest_checkpoint(out / "checkpoints").name == f"step_{STEPS:06d}"
    assert not (out / ".lock").exists()


def test_a_holder_that_has_not_yet_written_its_pid_is_still_named(tmp_path):
    """The holder takes the lock, then writes its pid: a process refused in between waits for
    the pid instead of reporting 'process ?' (seen once in CI)."""
    import fcntl
    import threading

    from llm_foundry import lock

    path = tmp_path / lock.LOCK_FILE
    holder = open(path, "a+")  # noqa: SIM115 - held for the test
    fcntl.flock(holder.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)

    def write_late():
        holder.write("pid=424242 host=elsewhere started=now\n")
        holder.flush()

    timer = threading.Timer(0.3, write_late)
    timer.start()
    try:
        with pytest.raises(lock.DirectoryBusy, match=r"in use by process 424242 on elsewhere"):
            lock.acquire(tmp_path, "run directory")
    finally:
        timer.join()
        holder.close()


SHARE = """
import sys, time
from llm_foundry import lock
lock.share(sys.argv[1])
print("reading", flush=True)
time.sleep(60)
"""


def test_readers_keep_a_writer_out_and_a_writer_keeps_readers_out(tmp_path):
    """A process reading a directory (``share``) refuses a writer that asks for ``readers``,
    naming the reader; one writing it refuses a new reader, naming the writer. A plain lock
    (a run directory) does not wait for readers."""
    d = tmp_path / "data"
    d.mkdir()
    reader = subprocess.Popen(
        [sys.executable, "-c", SHARE, str(d)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert reader.stdout.readline().strip() == "reading"
        with pytest.raises(
            lock.DirectoryBusy, match=rf"data is being read by process {reader.pid}"
        ):
            lock.acquire(d, "data directory", readers=True)
        assert not (d / lock.LOCK_FILE).exists()  # the refused writer let go of the directory
        with lock.hold(d):  # not a writer of the data: allowed
            pass
    finally:
        reader.kill()
        reader.wait()
    with lock.hold(d, "data directory", readers=True):
        proc = subprocess.run(
            [sys.executable, "-c", SHARE, str(d)], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode != 0
        assert f"DirectoryBusy: data directory {d} is being written by process {os.getpid()}" in (
            proc.stderr
        )
    assert not list(d.iterdir())  # the writer removed what the killed reader left


def test_this_process_may_write_what_it_reads_and_the_last_reader_removes_the_file(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    lock.share(d)
    lock.share(d)
    with lock.hold(d, "data directory", readers=True):  # its own read lock does not block it
        lock.share(d)  # nor does reading while it writes
        lock.unshare(d)
    assert (d / lock.READERS_FILE).exists()
    lock.unshare(d)
    assert (d / lock.READERS_FILE).exists()  # one share is left
    lock.unshare(d)
    assert not list(d.iterdir())  # the last one out leaves nothing behind
    with lock.hold(d, "data directory", readers=True):
        pass
    assert not list(d.iterdir())


def test_a_forked_child_letting_go_does_not_drop_its_parents_read_lock(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    lock.share(d)
    try:
        pid = os.fork()
        if pid == 0:  # the child: its copy of the share goes, as a worker's would
            try:
                lock.unshare(d)
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert (d / lock.READERS_FILE).exists()
        write = "import sys; from llm_foundry import lock; lock.acquire(sys.argv[1], readers=True)"
        proc = subprocess.run(
            [sys.executable, "-c", write, str(d)], capture_output=True, text=True, timeout=60
        )
        assert f"is being read by process {os.getpid()}" in proc.stderr
    finally:
        lock.unshare(d)
    assert not list(d.iterdir())


def test_a_directory_made_for_a_command_that_wrote_nothing_is_removed(tmp_path):
    """A refused command (its output directory made by its lock, nothing written) leaves no
    directory behind, nor the parents made for it; one that wrote something, or that was there
    before, stays."""
    made = tmp_path / "runs" / "a" / "b"
    with lock.hold(made, "run directory"):
        assert made.is_dir()
    assert not (tmp_path / "runs").exists()
    with lock.hold(made, "run directory"):
        (made / "run.json").write_text("{}")
    assert (made / "run.json").is_file() and not (made / lock.LOCK_FILE).exists()
    (there := tmp_path / "there").mkdir()
    with lock.hold(there), lock.hold(there):  # nested: the outermost release decides
        pass
    assert there.is_dir()


@pytest.mark.parametrize("flags", [["--data", "nope"], ["--train.sdpa_backend", "cudnn"]])
def test_a_refused_train_leaves_no_run_directory(char_data, tmp_path, monkeypatch, flags):
    import torch

    if flags[1] == "cudnn" and torch.cuda.is_available():
        pytest.skip("cudnn runs on this machine")
    monkeypatch.chdir(tmp_path)
    data = char_data(20_000)
    args = ["train", "--data", str(data), "--out", "runs/x", "--train.max_steps", "1", *flags]
    assert cli(args) == 2
    assert not (tmp_path / "runs").exists()
