"""A corpus of documents read from many inputs, in one fixed order, as a stream.

Inputs (``resolve_inputs``): files, globs and directories (walked recursively in name order;
what a walk leaves out is listed in ``Group.skipped``: other types, hidden names, broken links,
linked directories, which are not followed, and links to a file read already) of

  .txt                          one file = one document
  .jsonl, .jsonl.gz, .jsonl.zst one row = one document, its text in field ``text_field``
  .parquet                      one row = one document, its text in column ``text_column``, read
                                a batch of rows at a time (never the whole file)
  a saved ``datasets`` directory ``datasets.load_from_disk`` (a DatasetDict: its ``split``)

and Hugging Face hub datasets by name (``NAME`` or ``NAME:CONFIG``, loaded through the
``datasets`` cache). Each input argument is a ``Group``; its files are read in order and the
groups one after another, so the same inputs always give the same documents in the same order.

``read_records`` yields every record (a row, or a text file) as a ``Record``: a document, an
empty one (an empty text, or null), a file holding no document at all, or one with bytes that
are not UTF-8 (``on_bad_utf8="skip"``; ``"fail"`` raises a one-line DataError naming the file
and row). A UTF-8 byte order mark opening a file is not text: it is dropped. It starts at any
``(file, record)`` position, so an interrupted prepare resumes without reading again what it
had already written. A text file past ``LONG_TEXT_BYTES`` comes as a ``LongText`` whose pieces
are read when asked for. Each file read to its end is checked against its identity when it was
resolved (``check_unchanged``): one changed meanwhile is an ``InputChanged`` error.

``draw_sample`` keeps a bounded, deterministic sample of a corpus's text spread over all of it,
for training a tokenizer.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import heapq
import io
import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llm_foundry.data.sources import READ_BYTES, DataError, NotUTF8, _read_utf8_blocks
from llm_foundry.messages import first_few, one_line, shown

SUFFIXES = (".jsonl.gz", ".jsonl.zst", ".jsonl", ".parquet", ".txt")  # longest first
HF_DISK, HF_HUB = "datasets", "hub"  # the formats of a saved dataset and of a hub one
LONG_TEXT_BYTES = 16 << 20  # a .txt file past this is read in pieces, never held whole
PARQUET_BATCH_ROWS = 1024
BOM = "\ufeff"  # a UTF-8 byte order mark, as decoded
HF_BATCH_ROWS = 1024
BAD_UTF8 = ("fail", "skip")
BAD_ROWS = ("fail", "skip")  # a row that is not a JSON object with its text as a string
LISTED_PATHS = 64  # a group of more files lists none of them in meta.json (their count only)
# what a directory's walk leaves out, by reason (meta.json counts each)
SKIP_REASONS = ("type", "hidden", "broken_link", "linked_directory", "duplicate_link")
COMPRESSED = (".gz", ".zst", ".bz2", ".xz", ".zip")  # a type is named with the suffix before it


class InputChanged(DataError):
    """An input file changed while it was being prepared."""


@dataclass
class InputFile:
    """One file (or dataset) of a group: ``path`` resolved (a hub dataset: its name), its
    ``format``, size on disk, and ``stamp``: what tells a changed one (size and mtime, or the
    dataset's fingerprint)."""

    path: str
    format: str
    group: int
    bytes: int
    stamp: list
    handle: Any = None  # a loaded datasets.Dataset
    inode: int | None = None  # a file's: one replaced by another keeps no inode
    name: str = ""  # the path as found (a link's own name), for messages
    read_sha256: str | None = None  # its bytes' digest once read whole (tells a touch apart)


@dataclass
class Group:
    """One input argument and the files it names; ``split``: "train" (inputs, of which
    ``val_fraction`` selects val documents) or "val" (a ``--val-source``)."""

    input: str
    split: str
    files: list[InputFile] = field(default_factory=list)
    skipped: dict[str, list[str]] = field(default_factory=dict)  # reason -> what, as found


@dataclass
class Record:
    """One record of the corpus: ``kind`` "doc" (``text`` is a str or a ``LongText``), "empty"
    (an empty or null text), "empty_file" (a file with no document: 0 bytes, or no row) or
    "bad" (not UTF-8, skipped) or "bad_row" (not the format's row, skipped); ``where`` names the
    file (and row) of one that is not a "doc".
    ``file``: its index among all the files; ``next``: the record index after it in that file
    (where reading resumes)."""

    kind: str
    text: str | LongText | None
    file: int
    next: int
    where: str = ""


class LongText:
    """A text file too large to hold: ``pieces()`` reads it (again) block by block."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = path, size

    def pieces(self) -> Iterator[str]:
        first = True
        for text, _ in _read_utf8_blocks(self.path, READ_BYTES):
            if first and text:
                text, first = text.removeprefix(BOM), False
            if text:
                yield text

    def __len__(self) -> int:  # characters, at least (bytes >= characters)
        return self.size


# ----------------------------------------------------------------------------------------------
# Inputs


def file_format(path: Path) -> str | None:
    """The format of a file from its name (``SUFFIXES``), or None."""
    name = path.name.lower()
    return next((s[1:] for s in SUFFIXES if name.endswith(s)), None)


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``datasets``' ``save_to_disk``."""
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file()
        or ((path / "dataset_info.json").is_file() and (path / "state.json").is_file())
    )


def resolve_inputs(
    inputs: Sequence[str | Path] = (),
    hf_datasets: Sequence[str] = (),
    val_sources: Sequence[str | Path] = (),
    split: str | None = None,
    text_column: str | None = None,
    text_field: str | None = None,
) -> list[Group]:
    """The groups of files that ``inputs``, ``hf_datasets`` and ``val_sources`` name, in that
    order. A name that matches nothing, a file of another type, a file named twice, a
    ``split``, ``text_column`` or ``text_field`` given (not None) for none of the files'
    formats: one-line DataErrors. ``text_column`` None: "text"."""
    column = "text" if text_column is None else text_column
    groups: list[Group] = []
    for arg in inputs:
        groups.append(_group(str(arg), "train", len(groups), split, column, "--input"))
    for name in hf_datasets:
        group = Group(str(name), "train")
        group.files.append(_dataset(str(name), len(groups), split, column, "--hf-dataset"))
        groups.append(group)
    for arg in val_sources:
        groups.append(_group(str(arg), "val", len(groups), split, column, "--val-source"))
    seen: dict[str, tuple[str, InputFile]] = {}
    for g in groups:
        for f in g.files:
            if f.path in seen:
                first, before = seen[f.path]
                link = next((x for x in (f, before) if x.name and Path(x.name).is_symlink()), None)
                what = (f"{f.path} is named twice" if link is None else
                        f"{link.name} is a link to {f.path}, so that file is named twice")  # fmt: skip
                raise DataError(
                    f"{what} (by {first!r} and {g.input!r}); name each input once"
                    + (" (a --val-source must not also be an input)" if g.split == "val" else "")
                )
            seen[f.path] = (g.input, f)
    if split is not None and not any(
        f.format in (HF_DISK, HF_HUB) for g in groups for f in g.files
    ):
        raise DataError(
            f"--split {split} is for Hugging Face datasets (a saved DatasetDict or "
            "--hf-dataset); none of the inputs is one"
        )
    _check_text_flags(groups, text_column, text_field)
    for f in (f for g in groups for f in g.files if f.format == "parquet"):
        _parquet_column(f, column)  # a missing column is named before anything is read
    return groups


# the flags that choose where a row's text is: the inputs each is for, and their formats
TEXT_FLAGS = {
    "--text-field": ("JSONL", ("jsonl", "jsonl.gz", "jsonl.zst")),
    "--text-column": ("parquet and datasets", ("parquet", HF_DISK, HF_HUB)),
}


def _check_text_flags(groups: list[Group], text_column: str | None, text_field: str | None):
    """Refuse --text-field or --text-column given for none of the inputs' formats, naming the
    flag that applies to them (a text file is one whole document: neither does)."""
    formats = sorted({f.format for g in groups for f in g.files})
    for flag, value in (("--text-field", text_field), ("--text-column", text_column)):
        if value is None or any(f in TEXT_FLAGS[flag][1] for f in formats):
            continue
        other = next((k for k, (_, fmts) in TEXT_FLAGS.items() if set(fmts) & set(formats)), None)
        use = (f"choose their text with {other}" if other else
               "a text file is one whole document, with no field or column to choose")  # fmt: skip
        raise DataError(
            f"{flag} {shown(value)} applies to {TEXT_FLAGS[flag][0]} inputs, and the inputs "
            f"are {', '.join(formats)}: {use}"
        )


def _group(arg: str, split: str, number: int, hf_split, column, flag: str) -> Group:
    group = Group(arg, split)
    globbed = any(c in arg for c in "*?[")
    if globbed:
        matches = sorted(glob.glob(os.path.expanduser(arg), recursive=True))
        if not matches:
            raise DataError(f"{flag} {arg!r} matches no file")
        paths = [Path(m) for m in matches]
    else:
        paths = [Path(os.path.expanduser(arg))]
        if not paths[0].exists():
            raise DataError(f"{flag} {arg}: no such file or directory")
    found: list[Path] = []
    for path in paths:
        if is_saved_dataset(path):
            group.files.append(_dataset(str(path), number, hf_split, column, flag))
        elif globbed:  # a pattern's matches are taken and left out as a directory's entries are
            found += _entries([path], group.skipped, hidden_too=True)
        elif path.is_dir():
            found += _walk(path, group.skipped)
        elif path.is_file():
            if file_format(path) is None:
                raise DataError(
                    f"{flag} {path}: not a file type prepare reads; valid: "
                    f"{', '.join(SUFFIXES)} files, directories of them, or a saved datasets "
                    "directory"
                )
            found.append(path)
    group.files += [_file(p, number) for p in _once(found, group.skipped)]
    if not group.files:
        left = skipped_summary(group.skipped)
        raise DataError(
            f"{flag} {arg}: no {', '.join(SUFFIXES)} file there (nor a saved datasets directory)"
            + (f"; skipped {left}" if left else "")
        )
    return group


def _walk(directory: Path, skipped: dict[str, list[str]]) -> list[Path]:
    """The files of a type prepare reads under ``directory``, in name order (a folder's files
    where its name sorts, as ``sorted(rglob)`` orders them); what is left out goes to
    ``skipped`` by reason."""
    return _entries(sorted(directory.iterdir(), key=lambda p: p.name), skipped)


def _entries(entries: list[Path], skipped: dict[str, list[str]], hidden_too: bool = False):
    """The files of a type prepare reads among ``entries`` and under those that are folders
    (walked, unless a link); the rest go to ``skipped`` by reason. ``hidden_too``: names
    starting with '.' are taken too (a pattern that matched them asked for them)."""
    found = []
    for entry in entries:
        name = str(entry)
        if entry.name.startswith(".") and not hidden_too:  # hidden, not walked into (.git, ...)
            skipped.setdefault("hidden", []).append(name)
        elif entry.is_symlink() and not entry.exists():
            skipped.setdefault("broken_link", []).append(name)
        elif entry.is_dir():
            if entry.is_symlink():  # followed, a link could lead back up and never end
                skipped.setdefault("linked_directory", []).append(name)
            else:
                found += _walk(entry, skipped)
        elif entry.is_file() and file_format(entry):
            found.append(entry)
        else:
            skipped.setdefault("type", []).append(name)
    return found


def _once(paths: list[Path], skipped: dict[str, list[str]]) -> list[Path]:
    """``paths`` without the links to a file that another of them names (the file itself kept
    where it is found, else the first link to it); those go to ``skipped``."""
    by_target: dict[Path, list[Path]] = {}
    for p in paths:
        by_target.setdefault(p.resolve(), []).append(p)
    kept = {t: next((p for p in ps if not p.is_symlink()), ps[0]) for t, ps in by_target.items()}
    out = []
    for p in paths:
        keep = kept[p.resolve()]
        if p is keep:
            out.append(p)
        else:
            skipped.setdefault("duplicate_link", []).append(f"{p} -> {keep}")
    return out


def _type(name: str) -> str:
    """A file's type as a note names it: its suffix (with the one before a compression's)."""
    suffixes = Path(name).suffixes
    if not suffixes:
        return "no suffix"
    n = 2 if len(suffixes) > 1 and suffixes[-1].lower() in COMPRESSED else 1
    return "".join(suffixes[-n:]).lower()


def skipped_summary(skipped: dict[str, list[str]]) -> str:
    """What a walk left out, in words (empty: nothing): its count, then each reason with its
    count and the first few it names."""
    parts = []
    if skipped.get("type"):
        kinds = Counter(_type(n) for n in skipped["type"])
        listed = ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
        parts.append(f"{len(skipped['type'])} of other types ({listed})")
    words = {"hidden": ("hidden", "hidden"), "broken_link": ("broken link", "broken links"),
             "linked_directory": ("linked directory, not followed",
                                  "linked directories, not followed"),
             "duplicate_link": ("link to a file read already", "links to a file read already")}  # fmt: skip
    for reason, (one, many) in words.items():
        names = skipped.get(reason) or []
        if names:
            parts.append(f"{len(names)} {one if len(names) == 1 else many} ({first_few(names)})")
    total = sum(len(v) for v in skipped.values())
    if not total:
        return ""
    return f"{total} {'entry' if total == 1 else 'entries'}: " + ", ".join(parts)


def skipped_note(group: Group) -> str | None:
    """One line saying what a directory input left out, or None."""
    summary = skipped_summary(group.skipped)
    flag = "--val-source" if group.split == "val" else "--input"
    return f"note: {flag} {group.input}: skipped {summary}" if summary else None


def skipped_counts(group: Group) -> dict[str, int]:
    """How many entries a group's walk left out, by reason (every reason, 0 included)."""
    return {r: len(group.skipped.get(r, [])) for r in SKIP_REASONS}


def _file(path: Path, group: int) -> InputFile:
    st = path.stat()
    return InputFile(str(path.resolve()), file_format(path), group, st.st_size,
                     [st.st_size, st.st_mtime_ns], inode=st.st_ino, name=str(path))  # fmt: skip


def check_unchanged(f: InputFile) -> None:
    """An ``InputChanged`` error (one line, naming the file) when the file ``f`` is no longer
    what it was when it was resolved: its size, modification time or inode differ (a saved or
    hub dataset is not checked: its files are the ``datasets`` cache's). A file read whole whose
    modification time alone changed is compared by content: a touch, or a save of the same
    bytes, is no change."""
    if f.format in (HF_DISK, HF_HUB):
        return
    try:
        st = os.stat(f.path)
    except FileNotFoundError:
        how = "removed"
    else:
        if st.st_size != f.bytes:
            how = f"{f.bytes:,} bytes then, {st.st_size:,} now"
        elif st.st_mtime_ns != f.stamp[1] and (f.read_sha256 is None
                                               or file_sha256(f.path) != f.read_sha256):  # fmt: skip
            how = "modified"
        elif f.inode is not None and st.st_ino != f.inode:
            how = "replaced by another file"
        else:
            return
    raise InputChanged(f"{f.path} changed while it was being prepared ({how}); run again")


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(READ_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _import(module: str, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        from llm_foundry.package import install_line

        raise DataError(
            f"{what} needs the {module} package, which is not installed: {install_line('data')}"
        ) from None


def _dataset(name: str, group: int, split: str | None, column: str, flag: str) -> InputFile:
    """A saved datasets directory (``load_from_disk``), else a hub dataset by name."""
    path = Path(os.path.expanduser(name))
    if is_saved_dataset(path):
        datasets = _import("datasets", f"reading the saved dataset {path}")
        ds = datasets.load_from_disk(str(path))
        where, fmt = str(path.resolve()), HF_DISK
    elif path.exists():
        raise DataError(
            f"{flag} {name} is not a saved datasets directory (no dataset_dict.json, nor "
            "dataset_info.json and state.json)"
        )
    else:
        datasets = _import("datasets", f"{flag} {name}")
        hub, _, config = name.partition(":")
        try:
            ds = datasets.load_dataset(hub, config or None, split=split or "train")
        except Exception as e:  # noqa: BLE001 - the hub's failures come in many types
            raise DataError(
                f"{flag} {name}: not a directory, and the Hugging Face hub could not give the "
                f"dataset ({type(e).__name__}: {one_line(e, 200)}); where the hub cannot be "
                "reached, save the dataset with save_to_disk elsewhere and pass its directory"
            ) from None
        where, fmt = name, HF_HUB
    if isinstance(ds, datasets.DatasetDict):
        want = split or "train"
        if want not in ds:
            raise DataError(
                f"{where} has no split {want!r}; its splits: {', '.join(ds)} (choose with --split)"
            )
        ds = ds[want]
    if column not in ds.column_names:
        raise DataError(
            f"{where} has no column {column!r}; its columns: {shown(ds.column_names)} (choose "
            "with --text-column)"
        )
    size = sum(os.path.getsize(c["filename"]) for c in ds.cache_files) or ds.data.nbytes
    return InputFile(where, fmt, group, size, [ds._fingerprint, len(ds)], ds)


def _parquet_column(f: InputFile, column: str) -> int:
    """The index of ``column`` in a parquet file's schema; a missing or non-text one is named."""
    pq = _import("pyarrow.parquet", f"reading {f.path}")
    import pyarrow as pa

    try:
        schema = pq.ParquetFile(f.path).schema_arrow
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{f.path} is not a readable parquet file ({one_line(e, 200)})") from None
    if column not in schema.names:
        raise DataError(
            f"{f.path} has no column {column!r}; its columns: {shown(schema.names)} (choose with "
            "--text-column)"
        )
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind)):  # fmt: skip
        raise DataError(f"{f.path}: column {column!r} holds {kind}; expected text (strings)")
    return schema.names.index(column)


# ----------------------------------------------------------------------------------------------
# Records


def read_records(
    groups: Sequence[Group],
    start: tuple[int, int] = (0, 0),
    *,
    text_field: str = "text",
    text_column: str = "text",
    on_bad_utf8: str = "fail",
    on_bad_row: str = "fail",
    progress: Callable[[int], None] | None = None,
) -> Iterator[Record]:
    """Every record of every file of ``groups``, in order, from position ``start`` (the index
    of a file among all of them, and of a record in it). ``progress(n)``: n more input bytes read
    (compressed bytes for compressed files; a table's bytes in proportion to its rows). Each file
    read to its end is checked unchanged since it was resolved (``check_unchanged``).
    ``on_bad_row``: a JSON line that is not an object with the text field a string or null, or a
    table's value that is not text, stops the read ("fail": a one-line DataError) or is a
    "bad_row" record ("skip")."""
    if on_bad_utf8 not in BAD_UTF8:
        raise ValueError(f"on_bad_utf8 must be one of {', '.join(BAD_UTF8)}; got {on_bad_utf8!r}")
    if on_bad_row not in BAD_ROWS:
        raise ValueError(f"on_bad_row must be one of {', '.join(BAD_ROWS)}; got {on_bad_row!r}")
    files = [f for g in groups for f in g.files]
    tick = progress or (lambda n: None)
    first, skip = start
    for i in range(first, len(files)):
        f = files[i]
        done = 0

        def moved(position: int, f=f) -> None:
            nonlocal done
            tick(max(0, min(position, f.bytes) - done))
            done = max(done, min(position, f.bytes))

        at = skip if i == first else 0
        if f.format == "txt":
            if at == 0:
                yield _txt_record(f, i, on_bad_utf8)
        elif f.format.startswith("jsonl"):
            yield from _jsonl_records(f, i, at, text_field, on_bad_utf8, on_bad_row, moved)
        elif f.format == "parquet":
            yield from _table_records(f, i, at, _parquet_batches(f, at, text_column), on_bad_utf8,
                                      on_bad_row, moved, text_column)  # fmt: skip
        else:
            yield from _table_records(f, i, at, _dataset_batches(f, at, text_column), on_bad_utf8,
                                      on_bad_row, moved, text_column)  # fmt: skip
        moved(f.bytes)
        check_unchanged(f)  # what was read is what the identity recorded names


def record_count(f: InputFile) -> int | None:
    """How many record positions reading ``f`` goes through (a ``Record.next`` equal to it: the
    file is read to its end), where known without reading it: a text file's one, a table's rows
    (one for a table without rows); None for JSON lines, whose lines only a read counts."""
    if f.format == "txt":
        return 1
    if f.format == "parquet":
        import pyarrow.parquet as pq

        return max(pq.ParquetFile(f.path).metadata.num_rows, 1)
    if f.format in (HF_DISK, HF_HUB) and f.handle is not None:
        return max(len(f.handle), 1)
    return None


def _bad_row(where: str, why: str, policy: str) -> str:
    """A row that is not what the format's reader takes: a one-line DataError under "fail",
    else where it is and why, for the "bad_row" record that counts it."""
    if policy == "fail":
        raise DataError(f"{where}{why}; fix the row, or pass --on-bad-row skip to leave such "
                        "rows out (they are counted)")  # fmt: skip
    return f"{where}{why}"


def _bad(f: InputFile, row: str, what: str, policy: str) -> str:
    """Where a record stops being UTF-8 (``what``: the byte or character, and where): the one
    wording of every format, a one-line DataError under the "fail" policy."""
    where = f"{f.path}{row}: {what}"
    if policy == "fail":
        raise DataError(
            f"{where}; convert the input to UTF-8, or pass --on-bad-utf8 skip to leave such "
            "documents out (they are counted)"
        )
    return where


def _byte(raw: bytes, e: UnicodeDecodeError, offset: int = 0) -> str:
    """The first byte of ``raw`` that is not UTF-8 in words; ``offset``: ``raw``'s in its file."""
    return f"byte {raw[e.start]:#04x} at offset {offset + e.start} is not UTF-8"


def _first_bad_byte(path: Path) -> str | None:
    """The first byte of a file that is not UTF-8, in ``_byte``'s words, or None; read block by
    block as a long text is."""
    try:
        for _ in _read_utf8_blocks(path, READ_BYTES):
            pass
    except NotUTF8 as e:
        return f"byte {e.byte:#04x} at offset {e.offset} is not UTF-8"
    return None


def _txt_record(f: InputFile, i: int, policy: str) -> Record:
    path = Path(f.path)
    if f.bytes > LONG_TEXT_BYTES:
        bad = _first_bad_byte(path)  # checked whole before any piece goes
        if bad is not None:
            return Record("bad", None, i, 1, _bad(f, "", bad, policy))
        return Record("doc", LongText(path, f.bytes), i, 1)
    raw = path.read_bytes()
    if len(raw) == f.bytes:  # what was read, should its modification time change (a touch)
        f.read_sha256 = hashlib.sha256(raw).hexdigest()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Record("bad", None, i, 1, _bad(f, "", _byte(raw, e), policy))
    if not raw:
        return Record("empty_file", None, i, 1, f.path)
    text = text.removeprefix(BOM)
    return Record("doc" if text else "empty", text, i, 1, f.path)


class _Counted(io.RawIOBase):
    """A file object that counts the bytes read through it (a compressed file's position) and
    digests them."""

    def __init__(self, raw):
        self.raw, self.count, self.digest = raw, 0, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.raw.readinto(b)
        self.count += n or 0
        self.digest.update(memoryview(b)[: n or 0])
        return n


def _open_lines(f: InputFile):
    """(binary line reader, the counter of file bytes read) of a .jsonl(.gz|.zst) file."""
    raw = _Counted(open(f.path, "rb"))  # noqa: SIM115 - closed with the reader
    if f.format == "jsonl.gz":
        return io.BufferedReader(gzip.GzipFile(fileobj=io.BufferedReader(raw))), raw
    if f.format == "jsonl.zst":
        zstd = _import("zstandard", f"reading {f.path}")
        reader = zstd.ZstdDecompressor().stream_reader(io.BufferedReader(raw))
        return io.BufferedReader(reader), raw
    return io.BufferedReader(raw), raw


def _jsonl_records(f, i, at, field, policy, row_policy, moved) -> Iterator[Record]:
    reader, raw = _open_lines(f)
    rows = lines = 0
    with reader:
        for n, line in enumerate(_lines(reader, f), start=0):
            lines = n + 1
            if n < at:
                continue
            moved(raw.count)
            if n == 0:
                line = line.removeprefix(codecs.BOM_UTF8)  # written by some editors: not text
            if not line.strip():
                continue  # a blank line is no row
            rows += 1
            row = f" line {n + 1}"
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Record("bad", None, i, n + 1, _bad(f, row, _byte(line, e), policy))
                continue
            why = None
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                # (a message such as "Invalid control character at" ends where its place goes)
                why = f" is not JSON ({e.msg.removesuffix(' at')}, column {e.colno})"
            else:
                if not isinstance(obj, dict):
                    why = f" is {type(obj).__name__}; expected a JSON object"
                elif field not in obj:
                    why = (f" has no field {field!r}; its fields: {shown(list(obj))} (choose "
                           "with --text-field)")  # fmt: skip
                elif obj[field] is not None and not isinstance(obj[field], str):
                    why = (f": field {field!r} is {shown(obj[field])}; expected a string (or "
                           "null, left out as an empty text)")  # fmt: skip
            if why is not None:
                yield Record("bad_row", None, i, n + 1, _bad_row(f"{f.path}{row}", why, row_policy))
                continue
            yield _text_record(obj[field], f, i, n + 1, row, policy)
    if raw.count == f.bytes:  # read whole: what was read, should its modification time change
        f.read_sha256 = raw.digest.hexdigest()
    if at == 0 and rows == 0:
        yield Record("empty_file", None, i, max(lines, 1), f.path)


def _lines(reader, f: InputFile) -> Iterator[bytes]:
    import zlib

    try:
        yield from reader
    except (OSError, EOFError, zlib.error) as e:  # a damaged or truncated compressed file
        raise DataError(f"{f.path} cannot be read to its end ({one_line(e, 200)})") from None
    except Exception as e:  # zstandard.ZstdError
        if type(e).__name__ != "ZstdError":
            raise
        raise DataError(f"{f.path} cannot be read to its end ({one_line(e, 200)})") from None


def _text_record(value, f: InputFile, i: int, nxt: int, row: str, policy: str) -> Record:
    """A text value read from a row: null is an empty text, bytes decoded, lone surrogates (a
    JSON escape such as ``\\ud800``: no UTF-8 encodes them) counted as bad UTF-8."""
    if value is None:
        return Record("empty", "", i, nxt, f"{f.path}{row}")
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            return Record("bad", None, i, nxt, _bad(f, row, _byte(value, e), policy))
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            what = f"character {e.object[e.start]!r} at {e.start} (a lone surrogate) is not UTF-8"
            return Record("bad", None, i, nxt, _bad(f, row, what, policy))
    return Record("doc" if value else "empty", value, i, nxt, f"{f.path}{row}")


def _parquet_batches(f: InputFile, at: int, column: str) -> Iterator[tuple[int, int, list]]:
    """(first row, rows in the file, values) a batch at a time from row ``at``; whole row
    groups before it are skipped unread."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f.path)
    total, first, groups = pf.metadata.num_rows, 0, []
    for g in range(pf.metadata.num_row_groups):
        rows = pf.metadata.row_group(g).num_rows
        if first + rows <= at and not groups:
            first += rows
            continue
        groups.append(g)
    if not groups:
        return
    for batch in pf.iter_batches(PARQUET_BATCH_ROWS, row_groups=groups, columns=[column]):
        yield first, total, batch.column(0).to_pylist()
        first += batch.num_rows


def _dataset_batches(f: InputFile, at: int, column: str) -> Iterator[tuple[int, int, list]]:
    ds = f.handle.select_columns([column])
    total = len(ds)
    for first in range(at, total, HF_BATCH_ROWS):
        yield first, total, ds[first : first + HF_BATCH_ROWS][column]


def _table_records(f, i, at, batches, policy, row_policy, moved, column) -> Iterator[Record]:
    rows = 0
    for first, total, values in batches:
        for k, value in enumerate(values):
            n = first + k
            if n < at:
                continue
            rows += 1
            row = f" row {n} (column {column!r})"
            if value is not None and not isinstance(value, (str, bytes)):
                why = _bad_row(f"{f.path}{row}", f" is {shown(value)}; expected text", row_policy)
                yield Record("bad_row", None, i, n + 1, why)
                continue
            yield _text_record(value, f, i, n + 1, row, policy)
        moved(f.bytes * (first + len(values)) // max(total, 1))
    if at == 0 and rows == 0:
        yield Record("empty_file", None, i, 1, f.path)


# ----------------------------------------------------------------------------------------------
# A tokenizer's sample


def _mix(x: int) -> int:
    """splitmix64: a well-spread 64-bit key for the x-th piece of the corpus."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def draw_sample(pieces: Iterable[str], budget: int) -> tuple[list[str], int, int]:
    """A deterministic sample of at most ``budget`` UTF-8 bytes of ``pieces``, spread evenly
    over all of them: the pieces with the smallest keys ``_mix(position)`` that fit (a bottom-k
    sample, kept in a heap while the pieces stream by, so memory stays within the budget).
    Returns (the sampled pieces in corpus order, their bytes, the corpus' bytes)."""
    heap: list[tuple[int, int, int, str]] = []  # (-key, position, bytes, text): largest key first
    kept = seen = 0
    for position, piece in enumerate(pieces):
        size = len(piece) if piece.isascii() else len(piece.encode("utf-8"))
        seen += size
        key = _mix(position)
        if size > budget or (kept + size > budget and (not heap or key >= -heap[0][0])):
            continue
        heapq.heappush(heap, (-key, position, size, piece))
        kept += size
        while kept > budget:
            kept -= heapq.heappop(heap)[2]
    return [p for _, _, _, p in sorted(heap, key=lambda e: e[1])], kept, seen
