"""Exports racing, killed or refused by the disk (``outputs.py``): of two exports to one ``--out``
the one that finishes second is refused in one line and leaves nothing behind (the file or
directory is the first one's, whole); one finding another still writing is refused at once; the
temporaries a killed export leaves are removed by the next export to that path; a read-only or
full disk is one line naming ``--out``.

The second export runs between the first's steps (a hook on ``outputs``), so which one wins is
fixed, not left to timing; the killed export is a real process, stopped with SIGKILL once it has
said (by a file) that it is writing."""

from __future__ import annotations

import builtins
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from llm_foundry import outputs
from llm_foundry.checkpoint import save_checkpoint
from llm_foundry.cli import main
from llm_foundry.config import ModelConfig
from llm_foundry.models import Transformer
from llm_foundry.tokenizer import CharTokenizer

TEXT = "to be or not to be, that is the question\n" * 4
BIG = dict(dim=64, n_layers=2, n_heads=2)
SMALL = dict(dim=16, n_layers=1, n_heads=2)


def _checkpoint(path, dims: dict = SMALL):
    torch.manual_seed(0)
    tok = CharTokenizer.train(TEXT)
    cfg = ModelConfig(vocab_size=tok.vocab_size, max_seq_len=32, **dims)
    save_checkpoint(Transformer(cfg).eval(), path)
    tok.save(path / "tokenizer.json")
    return path


def _export(kind: str, src, out) -> list[str]:
    return {
        "gguf": ["convert", "--to-gguf", str(src), "--out", str(out)],
        "hf": ["convert", "--to-hf", str(src), "--out", str(out)],
        "quantize": ["quantize", "--checkpoint", str(src), "--to", "int8", "--out", str(out)],
    }[kind]


def _before(monkeypatch, step: str, action) -> list:
    """Run ``action`` once, the first time the export reaches ``outputs.<step>``; returns a list
    that then holds what it returned."""
    real, done = getattr(outputs, step), []

    def hooked(*args, **kw):
        if not done:
            done.append(None)
            done[0] = action()
        return real(*args, **kw)

    monkeypatch.setattr(outputs, step, hooked)
    return done


def _when_making(monkeypatch, directory, action) -> list:
    """Run ``action`` once, when the export first makes sure ``directory`` (where its --out goes)
    exists: after its checks, before it creates anything there."""
    real, done = Path.mkdir, []

    def mkdir(self, *args, **kw):
        if self == directory and not done:
            done.append(None)  # the action's own export makes it too
            done[0] = action()
        return real(self, *args, **kw)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    return done


def _one_line(capsys) -> str:
    """The error line, the only line besides notes (a GGUF export notes its vocabulary)."""
    lines = [s for s in capsys.readouterr().err.splitlines() if not s.startswith("note: ")]
    assert len(lines) == 1 and ": error: " in lines[0], lines
    return lines[0]


def _leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".partial" in p.name)


def _out_model_dim(kind: str, out) -> int:
    """The hidden size of the model written at ``out``."""
    if kind == "gguf":
        gguf = pytest.importorskip("gguf")
        fields = gguf.GGUFReader(str(out)).fields
        key = next(k for k in fields if k.endswith(".embedding_length"))
        return int(fields[key].contents())
    meta = json.loads((out / "config.json").read_text())
    return meta["hidden_size"] if "hidden_size" in meta else meta["model"]["dim"]


@pytest.mark.parametrize("kind", ["gguf", "hf", "quantize"])
def test_of_two_exports_racing_to_one_out_the_second_to_finish_is_refused(
    kind, tmp_path, capsys, monkeypatch
):
    """A big model's export starts; a small one's to the same --out starts after it but finishes
    first. The big one is refused in one line (no raw errno) and leaves nothing; the output is
    the small one's, whole: the same bytes as the small one exported alone."""
    if kind == "gguf":
        pytest.importorskip("gguf")
    big, small = _checkpoint(tmp_path / "big", BIG), _checkpoint(tmp_path / "small", SMALL)
    out_dir = tmp_path / "g2"
    out = out_dir / ("x.gguf" if kind == "gguf" else kind)
    second = _when_making(monkeypatch, out_dir, lambda: main(_export(kind, small, out)))
    assert main(_export(kind, big, out)) == 2
    assert second == [0]
    err = _one_line(capsys)
    assert f"--out {out} was written by another process meanwhile" in err, err
    assert "Errno" not in err and ".partial" not in err
    assert _leftovers(out_dir) == []
    assert _out_model_dim(kind, out) == SMALL["dim"]
    if kind == "gguf":  # not the small file followed by the big one's bytes
        solo = tmp_path / "solo" / "x.gguf"
        monkeypatch.undo()
        assert main(_export(kind, small, solo)) == 0
        assert out.read_bytes() == solo.read_bytes()


def test_an_empty_out_directory_taken_meanwhile_is_refused(tmp_path, capsys, monkeypatch):
    """An empty --out is allowed; the first export to finish fills it, the second is refused."""
    big, small = _checkpoint(tmp_path / "big", BIG), _checkpoint(tmp_path / "small", SMALL)
    out = tmp_path / "hf"
    out.mkdir()
    _when_making(monkeypatch, tmp_path, lambda: main(_export("hf", small, out)))
    assert main(_export("hf", big, out)) == 2
    assert "was written by another process meanwhile" in capsys.readouterr().err
    assert _out_model_dim("hf", out) == SMALL["dim"] and _leftovers(tmp_path) == []


@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_an_export_finding_another_still_writing_its_out_is_refused_at_once(
    kind, tmp_path, capsys, monkeypatch
):
    """The second export starts while the first writes its temporary: it is refused before it
    loads anything, naming the writer; the first one then finishes."""
    if kind == "gguf":
        pytest.importorskip("gguf")
    big, small = _checkpoint(tmp_path / "big", BIG), _checkpoint(tmp_path / "small", SMALL)
    out = tmp_path / ("x.gguf" if kind == "gguf" else "hf")
    second = _before(monkeypatch, "_publish", lambda: main(_export(kind, small, out)))
    assert main(_export(kind, big, out)) == 0
    assert second == [2]
    line = _one_line(capsys)
    assert f"--out {out} is being written by process {os.getpid()}" in line, line
    assert "choose another --out" in line
    assert _out_model_dim(kind, out) == BIG["dim"] and _leftovers(tmp_path) == []


# ----------------------------------------------------------------------------------------------
# Killed exports

KILLED = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path

    ready, argv = Path(sys.argv[1]), sys.argv[2:]

    def paused(real):  # the export writes, says so, then waits to be killed
        def step(*args, **kw):
            done = real(*args, **kw)
            ready.touch()
            time.sleep(600)
            return done
        return step

    if argv[0] == "quantize":
        import llm_foundry.quantize as q
        q.save_checkpoint = paused(q.save_checkpoint)
    else:
        import gguf
        gguf.GGUFWriter.write_tensors_to_file = paused(gguf.GGUFWriter.write_tensors_to_file)
    from llm_foundry.cli import main
    main(argv)
    """
)


def _killed_export(argv: list[str], ready) -> int:
    """The command ``argv`` killed (SIGKILL) while it writes its output; returns its pid."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(ready), *argv], stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    while not ready.exists():  # it says when it is writing
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the export never started writing"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    return proc.pid


@pytest.mark.parametrize("kind", ["gguf", "quantize"])
def test_what_a_killed_export_left_is_removed_by_the_next_one(kind, tmp_path, capsys):
    if kind == "gguf":
        pytest.importorskip("gguf")
    ck = _checkpoint(tmp_path / "ck")
    out_dir = tmp_path / "out"
    out = out_dir / ("x.gguf" if kind == "gguf" else "int8")
    pid = _killed_export(_export(kind, ck, out), tmp_path / "ready")
    left = _leftovers(out_dir)
    assert len(left) == 1 and left[0].startswith(f".{out.name}.partial-{pid}"), left
    assert not out.exists()
    assert main(_export(kind, ck, out)) == 0
    err = capsys.readouterr().err
    assert f"note: removed {out_dir / left[0]} (" in err, err
    assert f"left by process {pid}, which is no longer running" in err
    assert _leftovers(out_dir) == [] and _out_model_dim(kind, out) == SMALL["dim"]


def test_a_temporary_of_a_running_process_is_kept(tmp_path, capsys):
    """A temporary without a lock (an earlier version's writer) whose process still runs is not
    removed; one whose process is gone is, whatever version wrote it."""
    out = tmp_path / "hf"
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        running = tmp_path / f".hf.partial-{alive.pid}"
        running.mkdir()
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        (tmp_path / f".hf.partial-{gone.pid}").mkdir()
        assert main(_export("hf", _checkpoint(tmp_path / "ck"), out)) == 0
        assert _leftovers(tmp_path) == [running.name]
        assert f"left by process {gone.pid}" in capsys.readouterr().err
    finally:
        alive.kill()
        alive.wait()


# ----------------------------------------------------------------------------------------------
# A disk that refuses


def _read_only(monkeypatch, directory):
    """Creating anything in ``directory`` fails as on a read-only file system."""
    real_mkdir, real_open = os.mkdir, os.open

    def refuse(path):
        if str(path).startswith(str(directory)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    def mkdir(path, *args, **kw):
        refuse(path)
        return real_mkdir(path, *args, **kw)

    def open_(path, flags, *args, **kw):
        if flags & os.O_CREAT:
            refuse(path)
        return real_open(path, flags, *args, **kw)

    def builtin_open(path, mode="r", *args, **kw):
        if isinstance(path, str | os.PathLike) and set(mode) & set("wax+"):
            refuse(path)
        return real_builtin_open(path, mode, *args, **kw)

    real_builtin_open = builtins.open
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(builtins, "open", builtin_open)


@pytest.mark.parametrize("kind", ["gguf", "hf", "quantize"])
def test_a_read_only_out_is_one_line_naming_it(kind, tmp_path, capsys, monkeypatch):
    if kind == "gguf":
        pytest.importorskip("gguf")
    ck = _checkpoint(tmp_path / "ck")
    ro = tmp_path / "ro"
    ro.mkdir()
    for out in (ro / "x", ro / "new" / "x"):  # in it, and in a directory to make there
        _read_only(monkeypatch, ro)
        assert main(_export(kind, ck, out)) == 2
        monkeypatch.undo()
        err = _one_line(capsys)
        assert f"--out {out} cannot be written (Read-only file system)" in err, err
        assert "choose a writable --out" in err
        assert "Errno" not in err and ".partial" not in err
        assert list(ro.iterdir()) == []


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_a_directory_without_write_permission_is_one_line(tmp_path, capsys):
    ck = _checkpoint(tmp_path / "ck")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    try:
        assert main(_export("hf", ck, ro / "hf")) == 2
    finally:
        ro.chmod(0o755)
    err = _one_line(capsys)
    assert "cannot be written (Permission denied); choose a writable --out" in err


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    import llm_foundry.interop.hf as hf

    ck = _checkpoint(tmp_path / "ck")

    def full(model, out_dir, *args, **kw):
        (out_dir / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out_dir / "model.safetensors"))

    monkeypatch.setattr(hf, "to_hf", full)
    out = tmp_path / "hf"
    assert main(_export("hf", ck, out)) == 2
    err = _one_line(capsys)
    assert f"--out {out} could not be written (No space left on device)" in err, err
    assert ".partial" not in err and _leftovers(tmp_path) == [] and not out.exists()


def test_an_unreadable_source_is_not_blamed_on_the_out(tmp_path, capsys, monkeypatch):
    """Only errors on the output's own paths become "choose a writable --out"."""
    import llm_foundry.interop.hf as hf

    ck = _checkpoint(tmp_path / "ck")
    source = ck / "tokenizer.json"

    def unreadable(*args, **kw):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(source))

    monkeypatch.setattr(hf, "copy_tokenizer", unreadable)
    assert main(_export("hf", ck, tmp_path / "hf")) == 2
    err = _one_line(capsys)
    assert str(source) in err and "--out" not in err
    assert _leftovers(tmp_path) == []
