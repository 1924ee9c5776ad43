"""Writes that survive a power loss: what is written under a temporary name is flushed to disk
(``fsync``) before the rename that publishes it, and the directory after it, so that a crash
leaves the old output or the new one whole, never a name pointing at bytes still in the page
cache. Checkpoints (``train/state.py``), exports (``outputs.py``) and prepared data
(``data/sources.py``) all publish through these two calls.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync(path: str | Path) -> None:
    """Flush ``path`` to disk: a file's bytes, or a directory's entries (the names created,
    renamed or removed in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | Path) -> None:
    """``fsync`` every file and directory under ``path`` (a directory after what it holds), then
    ``path`` itself (a file alone when it is one)."""
    path = Path(path)
    if path.is_dir():
        for item in sorted(path.rglob("*"), reverse=True):
            fsync(item)
    fsync(path)


def umask() -> int:
    """The process's file-creation mask, read without changing it (Linux's /proc; elsewhere
    set and put back at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def usual_mode(path: str | Path) -> None:
    """Give a file safetensors wrote the permissions any other file written here gets (it
    creates its files readable by their owner alone: a teammate who can read a run's configs
    could not read its weights)."""
    os.chmod(path, 0o666 & ~umask())
