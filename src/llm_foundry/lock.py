"""One process per output directory: an exclusive lock on ``DIR/.lock`` held while it writes.

Two ``train`` (or ``ablate``, or ``prepare``) processes given the same directory would interleave
their metrics and delete each other's checkpoints; the second one is refused instead, with the
holder's pid. The lock is ``flock`` on an open file, so the kernel drops it when the holder dies,
however it dies: a lock left by a killed process is taken over at once (with a note, since that
run may have left work to ``--resume``). The file holds the holder's pid and is deleted on
release; a process that locked a file just deleted under it tries again on the new one.

Re-entrant within a process: ``train`` holds its run directory and the ``Trainer`` it starts asks
for the same one.

Readers: a process that maps a prepared directory's token files (``share``: a shared ``flock`` on
``DIR/.readers``, held while the mapping lives) keeps a writer that asks for ``readers=True``
(``prepare``) out: it is refused with the readers' pids rather than replacing the files, and a
reader that finds a writer at work is refused likewise. The file is deleted by the last one out.
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
READERS_FILE = ".readers"


class DirectoryBusy(RuntimeError):
    """Another live process holds the directory's lock."""


# resolved directory -> [open lock file, depth, readers file, the first directory it created]
_held: dict[Path, list] = {}
_shared: dict[Path, list] = {}  # resolved directory -> [open readers file, count, pid]


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


def acquire(
    directory: str | Path, what: str = "output directory", *, readers: bool = False
) -> None:
    """Lock ``directory`` (created if needed) for this process, or raise ``DirectoryBusy``
    naming the process that holds it. ``readers``: also refuse while another process reads the
    directory (``share``), and keep new readers out until the release."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(
            f"{what} {directory} exists and is not a directory (a file or a device); give a "
            "directory to write"
        )
    created = _first_missing(directory.resolve())
    directory.mkdir(parents=True, exist_ok=True)
    key = directory.resolve()
    if key in _held:
        if readers and _held[key][2] is None:
            _held[key][2] = _exclude_readers(key, directory, what)
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
    _held[key] = [f, 1, None, created]
    if readers:
        try:
            _held[key][2] = _exclude_readers(key, directory, what)
        except BaseException:
            release(directory)
            raise


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
    if entry[2] is not None:
        _readmit(key, entry[2])
    (key / LOCK_FILE).unlink(missing_ok=True)  # gone: released cleanly, nothing to take over
    f.close()  # closing the file drops the flock
    if entry[3] is not None:  # made for a command that wrote nothing (refused): leave no trace
        _remove_empty(key, entry[3])


def _first_missing(path: Path) -> Path | None:
    """The outermost of ``path`` and its parents that does not exist (None: ``path`` does)."""
    missing = None
    while not path.exists():
        missing, path = path, path.parent
    return missing


def _remove_empty(path: Path, top: Path) -> None:
    """Remove ``path`` and its parents up to ``top`` while they are empty."""
    while True:
        try:
            path.rmdir()
        except OSError:  # not empty (or gone): a command's output stays
            return
        if path == top:
            return
        path = path.parent


@contextmanager
def hold(
    directory: str | Path, what: str = "output directory", *, readers: bool = False
) -> Iterator[Path]:
    """``with hold(DIR):`` the directory is this process's until the block ends (``readers``:
    see ``acquire``)."""
    acquire(directory, what, readers=readers)
    try:
        yield Path(directory)
    finally:
        release(directory)


# ----------------------------------------------------------------------------------------------
# Readers


def _open_readers_file(key: Path, create: bool):
    """``DIR/.readers`` open (created if ``create`` and the directory is writable), or None."""
    path = key / READERS_FILE
    try:
        return open(path, "a+" if create else "r")  # noqa: SIM115 - held while the lock is
    except OSError:
        if not create:
            return None
        try:  # a read-only directory: lock the file if a writer made one, else nothing to lock
            return open(path)  # noqa: SIM115
        except OSError:
            return None


def _same_file(f, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
    except FileNotFoundError:
        return False


def _lockers(f, kind: str) -> list[int]:
    """Pids of the processes holding a ``kind`` ("READ" or "WRITE") flock on the open file ``f``
    (from /proc/locks; empty where that cannot be read)."""
    st = os.fstat(f.fileno())
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    try:
        with open("/proc/locks") as locks:
            for line in locks:
                parts = line.split()
                if "->" not in parts and kind in parts and dev in parts:
                    pid = int(parts[parts.index(kind) + 1])
                    if pid != os.getpid():
                        pids.append(pid)
    except (OSError, ValueError, IndexError):
        return []
    return sorted(set(pids))


def _flock_readers_file(key: Path, mode: int, own=None):
    """(the open ``DIR/.readers`` locked in ``mode``, None) or (None, the open file someone else
    holds, for naming them): retried while the holder is only a reader deleting the file on its
    way out. ``own``: this process's open file, converted instead of opening another. (None,
    None) where there is no file to lock (a read-only directory)."""
    deadline = time.monotonic() + 0.2
    while True:
        f = own or _open_readers_file(key, create=True)
        if f is None:
            return None, None
        try:
            fcntl.flock(f.fileno(), mode | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                if f is not own:
                    f.close()
                raise
            if own or (_same_file(f, key / READERS_FILE) and time.monotonic() > deadline):
                return None, f
            f.close()
            time.sleep(0.01)
            continue
        if own or _same_file(f, key / READERS_FILE):
            return f, None
        f.close()  # deleted under us by the last one out: lock the one on disk now


def _own_share(key: Path) -> list | None:
    """This process's entry in ``_shared``; one inherited through ``fork`` is forgotten (the
    lock it names is the parent's: the child neither converts nor releases it)."""
    entry = _shared.get(key)
    if entry is not None and entry[2] != os.getpid():
        del _shared[key]
        return None
    return entry


def _exclude_readers(key: Path, directory: Path, what: str):
    """Take ``DIR/.readers`` exclusively (this process's own read lock converted), or raise
    ``DirectoryBusy`` naming the processes that read the directory."""
    if fcntl is None:
        return None
    own = _own_share(key)
    f, busy = _flock_readers_file(key, fcntl.LOCK_EX, own[0] if own else None)
    if busy is None:
        return f
    pids = _lockers(busy, "READ")
    if own:
        fcntl.flock(busy.fileno(), fcntl.LOCK_SH)  # keep this process's own read lock
    else:
        busy.close()
    who = f"process {', '.join(map(str, pids))}" if pids else "another process"
    raise DirectoryBusy(
        f"{what} {directory} is being read by {who} (a training or fine-tune using its token "
        f"files; lock file {key / READERS_FILE}); wait for it to finish, stop it, or write "
        "another directory"
    )


def _readmit(key: Path, f) -> None:
    """End a writer's exclusion of readers: back to this process's own read lock, else the file
    is deleted (nobody else can hold it) and closed."""
    own = _own_share(key)
    if own and own[0] is f:
        fcntl.flock(f.fileno(), fcntl.LOCK_SH)
        return
    (key / READERS_FILE).unlink(missing_ok=True)
    f.close()


def share(directory: str | Path, what: str = "data directory") -> None:
    """Mark ``directory`` as read by this process until as many ``unshare`` calls: a writer
    asking with ``readers=True`` is refused meanwhile. Raises ``DirectoryBusy`` while a writer
    holds it. Nothing happens where the directory cannot be written (nobody can replace its
    files there either) or there is no ``flock``."""
    key = Path(directory).resolve()
    if _own_share(key) is not None:
        _shared[key][1] += 1
        return
    if fcntl is None:
        return
    if key in _held and _held[key][2] is not None:  # this process is writing it
        _shared[key] = [_held[key][2], 1, os.getpid()]
        return
    f, busy = _flock_readers_file(key, fcntl.LOCK_SH)
    if busy is not None:
        pids = _lockers(busy, "WRITE")
        busy.close()
        who = f"process {', '.join(map(str, pids))}" if pids else "another process"
        raise DirectoryBusy(
            f"{what} {directory} is being written by {who} (`llm-foundry prepare`); wait for it "
            "to finish and start again"
        )
    if f is None:
        return
    _shared[key] = [f, 1, os.getpid()]


def unshare(directory: str | Path) -> None:
    """Give up one ``share`` of ``directory``; the last one drops this process's read lock (and
    deletes the file when no other process holds it)."""
    key = Path(directory).resolve()
    entry = _own_share(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] > 0:
        return
    del _shared[key]
    f = entry[0]
    if key in _held and _held[key][2] is f:  # this process writes it now: the writer keeps it
        return
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        (key / READERS_FILE).unlink(missing_ok=True)  # nobody else reads it: leave no file
    except OSError:
        pass  # another reader holds it; the last one out deletes it
    f.close()


@contextmanager
def sharing(directory: str | Path, what: str = "data directory"):
    """``share`` for the ``with`` block: what is read inside (meta.json, then the files it
    names) comes from one version of the directory; maps opened inside keep their own share."""
    share(directory, what)
    try:
        yield
    finally:
        unshare(directory)
