"""Where exports write (convert, quantize): a new file or directory, never over one that exists
(a checkpoint, a run, the source itself) nor inside a training run's ``checkpoints/`` (a resumed
run replaces what it finds there). A directory is written under a temporary name and renamed
into place when complete, so an interrupted export leaves nothing that looks finished."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llm_foundry.rundir import CHECKPOINTS, RUN_INFO


def check_new_output(path: str | Path, flag: str = "--out", kind: str = "directory") -> Path:
    """Refuse (one line) an output ``path`` that exists (an empty directory is fine) or lies in
    a training run's checkpoints/; returns it as a Path."""
    path = Path(path)
    if path.is_dir() and kind == "file":
        raise ValueError(f"{flag} {path} is a directory; give the file to write")
    if path.is_dir() and any(path.iterdir()):
        raise ValueError(f"{flag} {path} is not empty; give a new directory")
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"{flag} {path} is a file that exists; exports never overwrite: give a new path"
        )
    for parent in path.resolve().parents:
        if parent.name == CHECKPOINTS and (parent.parent / RUN_INFO).exists():
            raise ValueError(
                f"{flag} {path} lies inside the training run {parent.parent}'s {CHECKPOINTS}/, "
                "which a resumed run rewrites; write it elsewhere"
            )
    return path


@contextmanager
def new_directory(path: str | Path, flag: str = "--out") -> Iterator[Path]:
    """``with new_directory(out) as tmp: write into tmp``: checked by ``check_new_output``,
    filled under a temporary sibling name, renamed to ``path`` once the block ends without an
    error (removed if it raises)."""
    path = check_new_output(path, flag)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if path.is_dir():
            path.rmdir()  # empty (checked); a file created there meanwhile makes this fail loudly
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
