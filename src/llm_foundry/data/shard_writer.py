"""Writing the shards of a prepared corpus (the layout ``shards`` reads), resumably.

``SplitWriter`` appends documents to a split's open shard, written under a hidden name
(``.train_00003.bin.partial`` and its ``.idx.partial``), and closes it at the first document
boundary at or past ``shard_tokens``: the index gets its end, both files are flushed to disk and
renamed to their names (``train_00003.bin``/``.idx``), and the entry meta.json will list is kept.

The progress record (``OUT/.progress.json``, written atomically whenever a shard closes) holds
what an interrupted prepare needs to go on: what identifies its inputs and settings, the input
position after the last document written, each split's closed shards (entries and file checks)
and its open shard's length. Resuming truncates the open shards to the recorded length (what
was appended after the record is written again) and reads on from the recorded position; a
closed shard that is not the file recorded, or a record of other inputs or settings, is refused
with one line.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from llm_foundry.data.batches import file_entry, prepared_kind
from llm_foundry.data.shards import INDEX_DTYPE, SHARD_FILE, index_name, shard_name
from llm_foundry.data.sources import DataError, write_atomic
from llm_foundry.messages import capped, shown

PROGRESS_FILE = ".progress.json"
PROGRESS_VERSION = 1
RESTART = "add --restart to discard it and prepare from the start"


def partial(path: Path) -> Path:
    """Where a shard file is written until it is complete: a hidden name beside it."""
    return path.with_name(f".{path.name}.partial")


class SplitWriter:
    """The shards of one split: ``begin()``, ``write(ids)`` (any number of times), ``end(eot)``
    per document; ``close()`` at the end. ``state()`` is what the progress record keeps;
    ``SplitWriter(..., state)`` goes on from it."""

    def __init__(
        self, out: Path, split: str, dtype: np.dtype, shard_tokens: int, state: dict | None = None
    ):
        self.out, self.split, self.dtype = Path(out), split, np.dtype(dtype)
        self.shard_tokens = shard_tokens
        state = state or {"done": [], "files": {}, "open": {"tokens": 0, "documents": 0}}
        self.done: list[dict] = list(state["done"])  # the closed shards' meta.json entries
        self.files: dict[str, dict] = dict(state["files"])  # their file entries
        # and their size and mtime, what a resumed prepare checks them by (no reading)
        self.stamps: dict[str, list] = dict(state.get("stamps", {}))
        self.tokens = int(state["open"]["tokens"])  # of the open shard
        self.documents = int(state["open"]["documents"])
        self._data = self._index = None
        self._digest = hashlib.sha256()
        if self.documents:
            self._reopen()

    # the open shard's files
    def _names(self) -> tuple[str, str]:
        name = shard_name(self.split, len(self.done))
        return name, index_name(name)

    def _paths(self) -> tuple[Path, Path]:
        data, index = self._names()
        return partial(self.out / data), partial(self.out / index)

    def _reopen(self) -> None:
        """Go on with the open shard of a progress record: its files cut to the recorded
        length (what was written after the record goes) and its digest computed again."""
        data, index = self._paths()
        want = (self.tokens * self.dtype.itemsize, self.documents * INDEX_DTYPE.itemsize)
        for path, final, size in zip((data, index), self._names(), want, strict=True):
            if not path.is_file() and (self.out / final).is_file():
                # closed and renamed, but stopped before the record said so: open again
                os.replace(self.out / final, path)
            have = path.stat().st_size if path.is_file() else None
            if have is None or have < size:
                raise DataError(
                    f"cannot resume: {path} has {have} bytes; the progress record needs "
                    f"{size:,}; {RESTART}"
                )
            os.truncate(path, size)
        with open(data, "rb") as f:
            while block := f.read(1 << 20):
                self._digest.update(block)
        self._data, self._index = open(data, "ab"), open(index, "ab")  # noqa: SIM115

    def begin(self) -> None:
        """A document starts: its offset goes into the index."""
        if self._data is None:
            data, index = self._paths()
            self._data, self._index = open(data, "wb"), open(index, "wb")  # noqa: SIM115
            self._digest = hashlib.sha256()
        self._index.write(np.array([self.tokens], INDEX_DTYPE).tobytes())

    def write(self, ids: np.ndarray) -> None:
        raw = np.ascontiguousarray(ids, self.dtype).tobytes()
        self._data.write(raw)
        self._digest.update(raw)
        self.tokens += len(ids)

    def end(self, eot: np.ndarray) -> bool:
        """The document ends with the end-of-text id; True when that closed the shard."""
        self.write(eot)
        self.documents += 1
        if self.tokens >= self.shard_tokens:
            self.close()
            return True
        return False

    def sync(self) -> None:
        """Everything written so far on disk (before a progress record names it)."""
        for f in (self._data, self._index):
            if f is not None:
                f.flush()
                os.fsync(f.fileno())

    def close(self) -> None:
        """Close the open shard (if it holds a document): index end written, files synced and
        renamed to their names, the entry kept."""
        if self._data is None or not self.documents:
            return
        self._index.write(np.array([self.tokens], INDEX_DTYPE).tobytes())
        self.sync()
        self._data.close()
        self._index.close()
        self._data = self._index = None
        names = self._names()
        for name, tmp in zip(names, self._paths(), strict=True):
            os.replace(tmp, self.out / name)
            self.files[name] = file_entry(self.out / name)
            self.stamps[name] = _stamp(self.out / name)
        self.done.append(
            {
                "file": names[0],
                "tokens": self.tokens,
                "documents": self.documents,
                "index": names[1],
                "sha256": self._digest.hexdigest(),
            }
        )
        self.tokens = self.documents = 0

    def abandon(self) -> None:
        """Close the open files as they are (an interrupted prepare; the record says how much
        of them counts)."""
        for f in (self._data, self._index):
            if f is not None:
                f.close()
        self._data = self._index = None

    def state(self) -> dict:
        return {
            "done": self.done,
            "files": self.files,
            "stamps": self.stamps,
            "open": {"tokens": self.tokens, "documents": self.documents},
        }

    @property
    def total_tokens(self) -> int:
        return sum(e["tokens"] for e in self.done) + self.tokens

    @property
    def total_documents(self) -> int:
        return sum(e["documents"] for e in self.done) + self.documents


# ----------------------------------------------------------------------------------------------
# The progress record


def save_progress(out: Path, record: dict) -> None:
    write_atomic(Path(out) / PROGRESS_FILE, json.dumps(record) + "\n")


def load_progress(out: Path) -> dict | None:
    """The progress record an interrupted prepare left in ``out``, or None."""
    path = Path(out) / PROGRESS_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e}); {RESTART}") from None
    if not isinstance(record, dict) or record.get("version") != PROGRESS_VERSION:
        raise DataError(f"{path} is not a progress record this version reads; {RESTART}")
    return record


def check_resumable(out: Path, record: dict, identity: dict) -> None:
    """Refuse (one line) a record of other inputs or settings than ``identity``, or whose closed
    shards are not the files it recorded."""
    where = Path(out) / PROGRESS_FILE
    differs = what_differs(record.get("identity") or {}, identity)
    if differs:
        raise DataError(
            f"{where}: an interrupted prepare of other inputs or settings is there ({differs}); "
            f"run it again with the same ones to resume it, or {RESTART}"
        )
    for split in record["splits"].values():
        for name, want in split["stamps"].items():
            path = Path(out) / name
            if not path.is_file() or _stamp(path) != want:
                raise DataError(
                    f"cannot resume: {path} is not the shard the interrupted prepare wrote "
                    f"(missing or changed); {RESTART}"
                )


class AlreadyPrepared(Exception):
    """``out`` holds a complete prepare of these very inputs and settings: nothing to do.
    ``meta``: its meta.json."""

    def __init__(self, out: Path, meta: dict):
        super().__init__(
            f"{out} is already prepared from these inputs with these settings: nothing to do"
        )
        self.meta = meta


AGAIN = "add --restart to prepare it again from scratch, or write to another --out"


def prepared_before(out: Path, kind: str | None, recorded: str, what: str) -> dict | None:
    """``out``'s meta.json when it holds a complete prepare of ``kind`` that records
    ``recorded`` (what a new prepare is compared with: ``what``, in words); None when it holds
    no complete prepare; a one-line DataError for another kind, or one from before ``recorded``
    was written (naming --restart)."""
    meta = complete_meta(out)
    if meta is None:
        return None
    if meta.get("kind") != kind:
        raise DataError(f"{out} already holds {prepared_kind(meta)}; {AGAIN}")
    if meta.get(recorded) is None:
        raise DataError(
            f"{out} is already prepared, but its meta.json does not record {what} (an earlier "
            f"version wrote it), so these cannot be compared with them; {AGAIN}"
        )
    return meta


def same_or_refused(
    out: Path, meta: dict, sha256: str, settings: dict, whose: str, other: str
) -> None:
    """``out`` holds the complete prepare ``meta`` of one source (a text, rows): raise
    ``AlreadyPrepared`` when its digest is ``sha256`` and its settings ``settings``, else a
    one-line DataError naming the first differences and --restart. ``whose``/``other`` word
    them ("the text's" / "another text")."""
    found = []
    if meta.get("sha256") != sha256:
        found.append(f"{whose} sha256: {str(meta.get('sha256'))[:12]}… then, {sha256[:12]}… now")
    found += differences(meta["settings"], settings, SHOWN_DIFFERENCES - len(found), "settings")
    if found:
        raise DataError(
            f"{out} is already prepared from {other} or settings ({'; '.join(found)}); {AGAIN}"
        )
    raise AlreadyPrepared(Path(out), meta)


def check_prepared(out: Path, identity: dict) -> None:
    """Before a document corpus is prepared in ``out``: ``AlreadyPrepared`` when ``out`` holds a
    complete prepare of ``identity`` (inputs and settings, as meta.json records them), a
    one-line DataError when it holds another complete prepare (naming what differs, and
    --restart); nothing when it holds none (or one whose files no longer match its meta.json,
    which is prepared again)."""
    meta = prepared_before(out, "documents", "inputs", "its inputs' files")
    if meta is None:
        return
    differs = what_differs({"inputs": meta["inputs"], "settings": meta.get("settings")}, identity)
    if differs:
        raise DataError(f"{out} is already prepared from other inputs or settings ({differs}); "
                        f"{AGAIN}")  # fmt: skip
    raise AlreadyPrepared(out, meta)


def complete_meta(out: Path) -> dict | None:
    """``out``'s meta.json when it is complete: readable, and every file it lists there with the
    size it records (the size alone: a check that reads no file); else None."""
    path = Path(out) / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict):
        return None
    for name, entry in files.items():
        p = Path(out) / name
        if not p.is_file() or not isinstance(entry, dict) or p.stat().st_size != entry.get("bytes"):
            return None
    return meta


SHOWN_DIFFERENCES = 3  # what a refusal names of how two identities differ, at most


def what_differs(old: dict, new: dict) -> str | None:
    """How two identities (inputs and settings) differ, in words: the first change of the
    inputs, then the first settings that differ, ``SHOWN_DIFFERENCES`` in all (None: the same)."""
    found = [d for d in [changed_inputs(old, new)] if d]
    rest = ({k: v for k, v in x.items() if k != "inputs"} for x in (old, new))
    found += differences(*rest, SHOWN_DIFFERENCES - len(found))
    return "; ".join(found) or None


def changed_inputs(old: dict, new: dict) -> str | None:
    """How the inputs of two identities differ, in words: a file changed, added or gone, or
    the same files in another order (None: the same inputs)."""

    def files(identity):
        return {f[0]: f for group in identity.get("inputs") or [] for f in group[2]}

    before, now = files(old), files(new)
    for path, f in now.items():
        if path not in before:
            return f"{path} is a new input"
        if before[path] != f:
            (_, old_format, old_stamp), (_, fmt, stamp) = before[path], f
            if fmt in ("datasets", "hub"):
                how = f"dataset fingerprint {shown(old_stamp[0])} then, {shown(stamp[0])} now"
            elif old_format == fmt and old_stamp[0] != stamp[0]:
                how = f"{old_stamp[0]:,} bytes then, {stamp[0]:,} now"
            else:
                how = "modified since"
            return f"{path} changed ({how})"
    for path in before:
        if path not in now:
            return f"{path} is no longer an input"

    def grouped(identity):  # each group's split and files, not the argument's spelling
        return [group[1:] for group in identity.get("inputs") or []]

    if grouped(old) != grouped(new):  # ./big/, big and /abs/big name the same group alike
        spelled = lambda identity: " ".join(str(g[0]) for g in identity.get("inputs") or [])  # noqa: E731
        return (f"the inputs are given in another order or grouping: {capped(spelled(old), 200)}"
                f" then, {capped(spelled(new), 200)} now")  # fmt: skip
    return None


def differences(old, new, limit: int = 1, where: str = "") -> list[str]:
    """The first ``limit`` places where two JSON values differ, each said in words (none:
    equal)."""
    if limit < 1:
        return []
    if isinstance(old, dict) and isinstance(new, dict):
        found: list[str] = []
        for key in list(old) + [k for k in new if k not in old]:
            here = f"{where}.{key}".strip(".")
            found += differences(old.get(key), new.get(key), limit - len(found), here)
        return found
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        found = []
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            found += differences(a, b, limit - len(found), f"{where}[{i}]")
        return found
    if old == new:
        return []
    return [f"{where or 'the record'}: {shown(old)} then, {shown(new)} now"]


def _stamp(path: Path) -> list:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def remove_unlisted(out: Path, listed: set[str]) -> None:
    """Remove the shard files, partials and progress record in ``out`` that a prepare's
    meta.json does not list (left by an earlier or an interrupted prepare)."""
    for p in Path(out).iterdir():
        name = p.name
        stale = SHARD_FILE.fullmatch(name) and name not in listed
        if (stale or name == PROGRESS_FILE or _is_partial(name)) and p.is_file():
            p.unlink()


def _is_partial(name: str) -> bool:
    return name.startswith(".") and name.endswith(".partial")


def clear_outputs(out: Path) -> None:
    """Remove what a prepare writes in ``out`` (meta.json first, so that what is left never
    reads as complete): token files, shards, indexes, tokenizer, progress record, partials."""
    out = Path(out)
    (out / "meta.json").unlink(missing_ok=True)
    for p in out.iterdir():
        name = p.name
        if (
            name in ("train.bin", "val.bin", "tokenizer.json", PROGRESS_FILE)
            or SHARD_FILE.fullmatch(name)
            or _is_partial(name)
        ) and p.is_file():
            p.unlink()
