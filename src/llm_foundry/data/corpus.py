"""A corpus of documents read from many inputs, in one fixed order, as a stream.

Inputs (``resolve_inputs``): files, globs and directories (walked recursively in name order,
hidden names skipped) of

  .txt                          one file = one document
  .jsonl, .jsonl.gz, .jsonl.zst one row = one document, its text in field ``text_field``
  .parquet                      one row = one document, its text in column ``text_column``, read
                                a batch of rows at a time (never the whole file)
  a saved ``datasets`` directory ``datasets.load_from_disk`` (a DatasetDict: its ``split``)

and Hugging Face hub datasets by name (``NAME`` or ``NAME:CONFIG``, loaded through the
``datasets`` cache). Each input argument is a ``Group``; its files are read in order and the
groups one after another, so the same inputs always give the same documents in the same order.

``read_records`` yields every record (a row, or a text file) as a ``Record``: a document, an
empty one, or one with bytes that are not UTF-8 (``on_bad_utf8="skip"``; ``"fail"`` raises a
one-line DataError naming the file and row). It starts at any ``(file, record)`` position, so an
interrupted prepare resumes without reading again what it had already written. A text file
past ``LONG_TEXT_BYTES`` comes as a ``LongText`` whose pieces are read when asked for.

``draw_sample`` keeps a bounded, deterministic sample of a corpus's text spread over all of it,
for training a tokenizer.
"""

from __future__ import annotations

import glob
import gzip
import heapq
import io
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llm_foundry.data.sources import READ_BYTES, DataError, _read_utf8_blocks
from llm_foundry.messages import one_line, shown

SUFFIXES = (".jsonl.gz", ".jsonl.zst", ".jsonl", ".parquet", ".txt")  # longest first
HF_DISK, HF_HUB = "datasets", "hub"  # the formats of a saved dataset and of a hub one
LONG_TEXT_BYTES = 16 << 20  # a .txt file past this is read in pieces, never held whole
PARQUET_BATCH_ROWS = 1024
HF_BATCH_ROWS = 1024
BAD_UTF8 = ("fail", "skip")
LISTED_PATHS = 64  # a group of more files lists none of them in meta.json (their count only)


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


@dataclass
class Group:
    """One input argument and the files it names; ``split``: "train" (inputs, of which
    ``val_fraction`` selects val documents) or "val" (a ``--val-source``)."""

    input: str
    split: str
    files: list[InputFile] = field(default_factory=list)


@dataclass
class Record:
    """One record of the corpus: ``kind`` "doc" (``text`` is a str or a ``LongText``), "empty"
    or "bad" (not UTF-8, skipped; ``where`` says where). ``file``: its index among all the
    files; ``next``: the record index after it in that file (where reading resumes)."""

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
        for text, _ in _read_utf8_blocks(self.path, READ_BYTES):
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
    seen: dict[str, str] = {}
    for g in groups:
        for f in g.files:
            if f.path in seen:
                raise DataError(
                    f"{f.path} is named twice (by {seen[f.path]!r} and {g.input!r}); name each "
                    "input once"
                    + (" (a --val-source must not also be an input)" if g.split == "val" else "")
                )
            seen[f.path] = g.input
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
    if any(c in arg for c in "*?["):
        matches = sorted(glob.glob(os.path.expanduser(arg), recursive=True))
        if not matches:
            raise DataError(f"{flag} {arg!r} matches no file")
        paths = [Path(m) for m in matches]
    else:
        paths = [Path(os.path.expanduser(arg))]
        if not paths[0].exists():
            raise DataError(f"{flag} {arg}: no such file or directory")
    for path in paths:
        if is_saved_dataset(path):
            group.files.append(_dataset(str(path), number, hf_split, column, flag))
        elif path.is_dir():
            found = [
                p
                for p in sorted(path.rglob("*"))
                if p.is_file()
                and file_format(p)
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            ]
            group.files += [_file(p, number) for p in found]
        elif path.is_file():
            if file_format(path) is None:
                raise DataError(
                    f"{flag} {path}: not a file type prepare reads; valid: "
                    f"{', '.join(SUFFIXES)} files, directories of them, or a saved datasets "
                    "directory"
                )
            group.files.append(_file(path, number))
    if not group.files:
        raise DataError(
            f"{flag} {arg}: no {', '.join(SUFFIXES)} file there (nor a saved datasets directory)"
        )
    return group


def _file(path: Path, group: int) -> InputFile:
    st = path.stat()
    fmt = file_format(path)
    f = InputFile(str(path.resolve()), fmt, group, st.st_size, [st.st_size, st.st_mtime_ns])
    if st.st_size == 0:
        raise DataError(f"{f.path} is empty (0 bytes): it holds no document; remove it")
    return f


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
    progress: Callable[[int], None] | None = None,
) -> Iterator[Record]:
    """Every record of every file of ``groups``, in order, from position ``start`` (the index
    of a file among all of them, and of a record in it). ``progress(n)``: n more input bytes read
    (compressed bytes for compressed files; a table's bytes in proportion to its rows)."""
    if on_bad_utf8 not in BAD_UTF8:
        raise ValueError(f"on_bad_utf8 must be one of {', '.join(BAD_UTF8)}; got {on_bad_utf8!r}")
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
            yield from _jsonl_records(f, i, at, text_field, on_bad_utf8, moved)
        elif f.format == "parquet":
            yield from _table_records(f, i, at, _parquet_batches(f, at, text_column), on_bad_utf8,
                                      moved, text_column)  # fmt: skip
        else:
            yield from _table_records(f, i, at, _dataset_batches(f, at, text_column), on_bad_utf8,
                                      moved, text_column)  # fmt: skip
        moved(f.bytes)


def _bad(f: InputFile, row: str, raw: bytes, e: UnicodeDecodeError, policy: str) -> str:
    """Where a record's bytes stop being UTF-8 (a DataError under the "fail" policy)."""
    where = f"{f.path}{row}: byte {raw[e.start]:#04x} at offset {e.start} is not UTF-8"
    if policy == "fail":
        raise DataError(
            f"{where}; convert the input to UTF-8, or pass --on-bad-utf8 skip to leave such "
            "documents out (they are counted)"
        )
    return where


def _txt_record(f: InputFile, i: int, policy: str) -> Record:
    path = Path(f.path)
    if f.bytes > LONG_TEXT_BYTES:
        try:
            for _ in _read_utf8_blocks(path, READ_BYTES):  # checked whole before any piece goes
                pass
        except DataError as e:
            if policy == "fail":
                raise DataError(
                    f"{e}, or pass --on-bad-utf8 skip to leave such documents out"
                ) from None
            return Record("bad", None, i, 1, str(e))
        return Record("doc", LongText(path, f.bytes), i, 1)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Record("bad", None, i, 1, _bad(f, "", raw, e, policy))
    return Record("doc" if text else "empty", text, i, 1)


class _Counted(io.RawIOBase):
    """A file object that counts the bytes read through it (a compressed file's position)."""

    def __init__(self, raw):
        self.raw, self.count = raw, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.raw.readinto(b)
        self.count += n or 0
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


def _jsonl_records(f, i, at, field, policy, moved) -> Iterator[Record]:
    reader, raw = _open_lines(f)
    rows = 0
    with reader:
        for n, line in enumerate(_lines(reader, f), start=0):
            if n < at:
                continue
            moved(raw.count)
            if not line.strip():
                continue  # a blank line is no row
            rows += 1
            row = f" line {n + 1}"
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Record("bad", None, i, n + 1, _bad(f, row, line, e, policy))
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{f.path}{row} is not JSON ({e.msg}, column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{f.path}{row} is {type(obj).__name__}; expected a JSON object")
            if field not in obj:
                raise DataError(
                    f"{f.path}{row} has no field {field!r}; its fields: {shown(list(obj))} "
                    "(choose with --text-field)"
                )
            value = obj[field]
            if not isinstance(value, str):
                raise DataError(
                    f"{f.path}{row}: field {field!r} is {shown(value)}; expected a string"
                )
            yield _text_record(value, f, i, n + 1, row, policy)
    if at == 0 and rows == 0:
        raise DataError(f"{f.path} holds no row: no document; remove it")


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
    """A text value read from a row: bytes decoded, lone surrogates (a JSON escape such as
    ``\\ud800``: no UTF-8 encodes them) counted as bad UTF-8."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            return Record("bad", None, i, nxt, _bad(f, row, value, e, policy))
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            where = f"{f.path}{row}: character {e.object[e.start]!r} at {e.start} (a lone " \
                    "surrogate) cannot be UTF-8"  # fmt: skip
            if policy == "fail":
                raise DataError(
                    f"{where}; pass --on-bad-utf8 skip to leave such documents out"
                ) from None
            return Record("bad", None, i, nxt, where)
    return Record("doc" if value else "empty", value, i, nxt)


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


def _table_records(f, i, at, batches, policy, moved, column) -> Iterator[Record]:
    rows = 0
    for first, total, values in batches:
        for k, value in enumerate(values):
            n = first + k
            if n < at:
                continue
            rows += 1
            row = f" row {n} (column {column!r})"
            if value is None:
                raise DataError(f"{f.path}{row} is null; expected text")
            if not isinstance(value, (str, bytes)):
                raise DataError(f"{f.path}{row} is {shown(value)}; expected text")
            yield _text_record(value, f, i, n + 1, row, policy)
        moved(f.bytes * (first + len(values)) // max(total, 1))
    if at == 0 and rows == 0:
        raise DataError(f"{f.path} holds no row: no document; remove it")


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
