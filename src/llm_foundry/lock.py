"""One process per output directory: an exclusive lock on ``DIR/.lock`` held while it writes.

Two ``train`` (or ``ablate``, or ``prepare``) processes given the same directory would interleave
their metrics and delete each other's checkpoints; the second one is refused instead, with the
holder's pid. The lock is ``flock`` on an open file, so the kernel drops it when the holder dies,
however it dies: a lock left by a killed process is taken over at once (with a note, since that
run may have left work to ``--resume``). The file holds the holder's pid and is deleted on
release; a process that locked a file just deleted under it tries again on the new one.

Re-entrant within a process: ``train`` holds its run directory and the ``Trainer`` it starts asks
for the same one.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock; directories are not locked there
    fcntl = None

LOCK_FILE = ".lock"


class DirectoryBusy(RuntimeError):
    """Another live process holds the directory's lock."""


_held: dict[Path, list] = {}  # resolved directory -> [open lock file, depth]


def _describe(text: str) -> str:
    parts = dict(p.split("=", 1) for p in text.split() if "=" in p)
    pid = parts.get("pid", "?")
    where = f" on {parts['host']}" if parts.get("host") not in (None, socket.gethostname()) else ""
    since = f" since {parts['started']}" if "started" in parts else ""
    return f"process {pid}{where}{since}"


def _holder_text(f, wait_s: float = 2.0) -> str:
    """What the holder wrote in the lock file; a holder that has just taken the lock writes its
    pid a moment later, so an empty file is read again for up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        f.seek(0)
        text = f.read()
        if text.strip() or time.monotonic() > deadline:
            return text
        time.sleep(0.01)


def acquire(directory: str | Path, what: str = "output directory") -> None:
    """Lock ``directory`` (created if needed) for this process, or raise ``DirectoryBusy``
    naming the process that holds it."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(
            f"{what} {directory} exists and is not a directory (a file or a device); give a "
            "directory to write"
        )
    directory.mkdir(parents=True, exist_ok=True)
    key = directory.resolve()
    if key in _held:
        _held[key][1] += 1
        return
    path = key / LOCK_FILE
    while True:
        f = open(path, "a+")  # noqa: SIM115 - held open for as long as the lock is held
        if fcntl is None:
            break
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                f.close()
                raise
            holder = _describe(_holder_text(f))
            f.close()
            raise DirectoryBusy(
                f"{what} {directory} is in use by {holder} (lock file {path}); wait for it to "
                "finish, stop it, or choose another directory"
            ) from None
        try:  # the holder we waited on may have deleted the file: lock the one on disk now
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()
    f.seek(0)
    previous = f.read().strip()
    if previous:  # the last holder died without releasing: its lock is ours now
        log.warning(
            f"note: took over the lock on {directory} left by {_describe(previous)}, which is no "
            "longer running (it stopped without finishing)"
        )
    f.seek(0)
    f.truncate()
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    f.write(f"pid={os.getpid()} host={socket.gethostname()} started={started}\n")
    f.flush()
    _held[key] = [f, 1]


def release(directory: str | Path) -> None:
    """Give up this process's hold on ``directory`` (the outermost release unlocks it)."""
    key = Path(directory).resolve()
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] > 0:
        return
    del _held[key]
    f = entry[0]
    (key / LOCK_FILE).unlink(missing_ok=True)  # gone: released cleanly, nothing to take over
    f.close()  # closing the file drops the flock


@contextmanager
def hold(directory: str | Path, what: str = "output directory") -> Iterator[Path]:
    """``with hold(DIR):`` the directory is this process's until the block ends."""
    acquire(directory, what)
    try:
        yield Path(directory)
    finally:
        release(directory)
