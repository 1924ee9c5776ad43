"""Where exports write (convert, quantize): a new file or directory, never over one that exists
(a checkpoint, a run, the source itself) nor inside a training run's ``checkpoints/`` (a resumed
run replaces what it finds there).

An export is written under a temporary sibling name of its own, ``.NAME.partial-PID-N``, created
exclusively and ``flock``-ed while its process writes, then put in place by a step that never
replaces what another process put there meanwhile (a hard link for a file, a rename onto a
missing or empty directory): of two exports racing to one ``--out`` the second is refused in one
line and leaves nothing behind. Its files are on disk (``fsync``) before that step, and the step
itself after it. An interrupted export leaves nothing that looks finished; what a
killed one leaves is removed by the next export to that path, once its process is gone (no
lock held, the pid not running).
"""

from __future__ import annotations

import errno
import glob
import itertools
import logging
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llm_foundry.durable import fsync, fsync_tree
from llm_foundry.rundir import CHECKPOINTS, RUN_INFO

log = logging.getLogger(__name__)

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock; temporaries are never judged stale
    fcntl = None

_serial = itertools.count()  # two exports in one process never share a temporary name
_PID = re.compile(r"\.partial-(\d+)(?:-\d+)?")  # -N absent in the names earlier versions used
UNWRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


class OutputTaken(FileExistsError):
    """Another process wrote the output (or is writing it) after this export was checked."""


class OutputUnwritable(OSError):
    """The output cannot be written there: a read-only file system, no permission, a full disk."""


def check_new_output(path: str | Path, flag: str = "--out", kind: str = "directory") -> Path:
    """Refuse (one line) an output ``path`` that exists (an empty directory is fine), lies in
    a training run's checkpoints/, or that another live export is writing; returns it as a Path."""
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
    for tmp, pid in _temporaries(path):
        if _locked(tmp):
            raise OutputTaken(
                f"{flag} {path} is being written by process {pid} (its unfinished {tmp.name}); "
                f"wait for it to finish or choose another {flag}"
            )
    return path


@contextmanager
def new_directory(path: str | Path, flag: str = "--out") -> Iterator[Path]:
    """``with new_directory(out) as tmp: write into tmp``: checked by ``check_new_output``,
    filled under a temporary sibling name, renamed to ``path`` once the block ends without an
    error (removed if it raises, or if another process wrote ``path`` meanwhile)."""
    with _new_output(path, flag, "directory") as tmp:
        yield tmp


@contextmanager
def new_file(path: str | Path, flag: str = "--out") -> Iterator[Path]:
    """``with new_file(out) as tmp: write the file tmp``: as ``new_directory``, for one file
    (created empty, to be opened and written by the block)."""
    with _new_output(path, flag, "file") as tmp:
        yield tmp


@contextmanager
def _new_output(path: str | Path, flag: str, kind: str) -> Iterator[Path]:
    path = check_new_output(path, flag, kind)
    name = path.with_name(f".{path.name}.partial-{os.getpid()}-{next(_serial)}")
    tmp, fd = None, None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(path)
        if kind == "directory":
            name.mkdir()
            tmp, fd = name, os.open(name, os.O_RDONLY)
        else:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            tmp = name
        if fcntl is not None:  # held until the end: a live writer's temporary is never removed
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield tmp
        fsync_tree(tmp)  # every byte on disk before the name that publishes it
        _publish(tmp, path, flag, kind)
        fsync(path.parent)
    except OSError as e:
        told = _unwritable(e, path, flag, name)
        if told is None:
            raise
        raise told from e
    finally:
        if fd is not None:
            os.close(fd)
        if tmp is not None:
            _remove(tmp)


def _publish(tmp: Path, path: Path, flag: str, kind: str) -> None:
    """Put the finished ``tmp`` at ``path`` unless another process has put something there."""
    try:
        if kind == "directory":
            os.rename(tmp, path)  # onto a missing or empty directory only
            return
        try:
            os.link(tmp, path)  # atomic, and fails where the name exists
        except FileExistsError:
            raise
        except OSError:  # no hard links on this file system: claim the name, then fill it
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            os.replace(tmp, path)
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise
        raise OutputTaken(
            f"{flag} {path} was written by another process meanwhile; this export was "
            f"discarded: run it again with another {flag} to keep both"
        ) from None


def _unwritable(e: OSError, path: Path, flag: str, tmp: Path) -> OSError | None:
    """``e`` said in one line naming ``path`` as the user gave it, where it comes from writing
    the output (a read-only or full disk); None where it does not (a source file unreadable)."""
    if e.errno in FULL:
        return OutputUnwritable(
            f"{flag} {path} could not be written ({e.strerror}); free space there or choose "
            f"another {flag}"
        )
    named = [Path(os.path.abspath(f)) for f in (e.filename, e.filename2) if f is not None]
    ours = [Path(os.path.abspath(p)) for p in (path, tmp)]
    if e.errno in UNWRITABLE and any(
        n.is_relative_to(p) or p.is_relative_to(n) for n in named for p in ours
    ):
        return OutputUnwritable(
            f"{flag} {path} cannot be written ({e.strerror}); choose a writable {flag}"
        )
    return None


# ----------------------------------------------------------------------------------------------
# Temporaries a killed export left


def remove_stale(path: Path) -> list[Path]:
    """Remove the temporaries of exports to ``path`` whose process is gone (their lock free and
    their pid not running), with a note for each; returns them."""
    removed = []
    for tmp, pid in _temporaries(path):
        if _locked(tmp) is not False:  # held, or no flock to tell
            continue
        if pid != os.getpid() and _alive(pid):  # an earlier version's writer, unlocked
            continue
        size = _size(tmp)
        _remove(tmp)
        if tmp.exists() or tmp.is_symlink():
            continue
        removed.append(tmp)
        if pid != os.getpid():
            from llm_foundry.accounting import human

            log.warning(
                f"note: removed {tmp} ({human(size, 'B')}), an unfinished export to {path} "
                f"left by process {pid}, which is no longer running"
            )
    return removed


def _temporaries(path: Path) -> list[tuple[Path, int]]:
    """The temporaries of exports to ``path`` on disk, with the pid in each name."""
    found = []
    for name in glob.glob(glob.escape(str(path.parent / f".{path.name}.partial-")) + "*"):
        match = _PID.fullmatch(name[len(str(path.parent / f".{path.name}")) :])
        if match:
            found.append((Path(name), int(match[1])))
    return sorted(found)


def _locked(tmp: Path) -> bool | None:
    """Whether a process holds ``tmp``'s lock (it is writing it); None where that cannot be told."""
    if fcntl is None:
        return None
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError as e:
        return True if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) else None
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (another user's counts)."""
    if pid <= 0:
        return True  # never signal a process group
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _size(tmp: Path) -> int:
    try:
        if not tmp.is_dir() or tmp.is_symlink():
            return tmp.lstat().st_size
        return sum(f.lstat().st_size for f in tmp.rglob("*") if not f.is_dir())
    except OSError:  # removed meanwhile, or unreadable: the note says 0 B
        return 0


def _remove(tmp: Path) -> None:
    try:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    except OSError:
        pass
