"""Prepare: a corpus -> token files on disk, in bounded memory. ``prepare(out_dir, ...)`` writes

  train.bin, val.bin   the token stream (first 90% / last 10%, as nanoGPT), raw ``ndarray.tofile``
                       output: uint16 when vocab_size <= 65536, else uint32
  tokenizer.json       the tokenizer (see ``llm_foundry.tokenizer``)
  meta.json            source, sha256 of the text, dtype, vocab size, token counts, split, tokenizer,
                       and each file's size and check digest (``files``); removed before the new
                       files are put in place and written last, so its presence means the
                       directory is complete

Every file is written under a temporary name and renamed into place: a process that maps the old
files keeps reading them whole. A directory already prepared is kept: the same text and settings
again is nothing to do (``shard_writer.AlreadyPrepared``), others are refused, naming what
differs (``restart`` prepares it again). The directory is locked while it is written, and refused while a
training reads it (``llm_foundry.lock``); an input that is one of the outputs is refused.

The corpus is read twice as a stream of pieces (once to train the tokenizer, once to encode),
never held whole: peak memory is a few chunks, whatever the corpus size.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from llm_foundry import lock
from llm_foundry.data.batches import file_entry
from llm_foundry.data.shard_writer import prepared_before, remove_unlisted, same_or_refused
from llm_foundry.data.sources import (
    DATASETS,
    DataError,
    TextSource,
    load_shakespeare,
    publish,
    refuse_overwriting_inputs,
    remove_temporaries,
    temporary,
)
from llm_foundry.tokenizer import TOKENIZER_KINDS, BatchEncoder, Tokenizer, build_tokenizer

CHUNK_CHARS = 1 << 16  # characters per encoding chunk
# a stretch longer than this with no exact cut (_CUT: base64, DNA, minified code) is cut every
# RUN_CHARS characters, where a token may break. BPE training time grows with the square of a
# word's length (one word of 30,000 / 100,000 / 300,000 letters: 0.6 / 6 / 45 s), encoding time
# linearly; 1 MB of DNA trains to 2,000 ids in 2.8 / 6.9 / 24.6 s cut every 4K / 16K / 64K
RUN_CHARS = 1 << 14
WHOLE = sys.maxsize  # chunk_chars that cuts nowhere but in long runs
CHUNKS_PER_BATCH = 16  # chunks handed to the tokenizer at once (BPE encodes them in parallel)
PROGRESS_MIN_CHARS = 1 << 20  # inputs shorter than this get no progress bar
COPY_BYTES = 1 << 20  # bytes copied at a time when the validation tail is split off
OUTPUTS = ("train.bin", "val.bin", "tokenizer.json", "meta.json")

# A cut just before a single space or newline that stands between two non-space characters is
# invisible to both tokenizers: byte-level BPE's pre-tokenizer (GPT-2's pattern) starts a token
# there and no token crosses it. Python's \s covers Unicode White_Space (and \x1c-\x1f besides),
# so a cut never lands where the tokenizer would see whitespace that Python does not.
_CUT = re.compile(r"(?<=\S)[ \n](?=\S)")
_LAST_CUT = re.compile(r"[\s\S]*(?<=\S)[ \n](?=\S)")  # matched to its end: the last _CUT


class LongRuns:
    """What ``split_pieces`` cut inside stretches of more than ``RUN_CHARS`` characters with no
    exact cut: ``runs`` such stretches, ``cuts`` cuts in them (a token may break at each)."""

    def __init__(self):
        self.runs = self.cuts = 0


def split_pieces(
    pieces: Iterable[str],
    chunk_chars: int = CHUNK_CHARS,
    run_chars: int = RUN_CHARS,
    runs: LongRuns | None = None,
) -> Iterator[str]:
    """Re-cut a stream of text pieces into chunks of at least ``chunk_chars`` characters (the
    last may be shorter; ``WHOLE``: one chunk), each cut at a place (``_CUT``) where encoding
    the chunks gives the same ids as encoding the whole text; but a stretch of more than
    ``run_chars`` characters with no such place is cut every ``run_chars`` characters, counted
    in ``runs``."""
    buf, run, inside = "", 0, False  # run: where the stretch with no cut began; inside: a long one
    for piece in itertools.chain(pieces, [None]):
        final = piece is None
        buf += piece or ""
        start = 0
        while True:
            window = min(run + run_chars + 2, len(buf))  # (run, run + run_chars]: +2 to look ahead
            first = _CUT.search(buf, max(min(start + chunk_chars, window), run + 1), window)
            if first is not None:  # the chunk ends at its first cut past chunk_chars
                run = first.start()
                yield buf[start:run]
                start, inside = run, False
                continue
            if window < run + run_chars + 2 and not final:
                break  # more text decides
            last = _LAST_CUT.match(buf, run + 1, window)
            if last is not None:
                run, inside = last.end() - 1, False
            elif len(buf) - run > run_chars:  # a long run: cut it
                run += run_chars
                yield buf[start:run]
                start = run
                if runs is not None:
                    runs.cuts += 1
                    runs.runs += not inside
                inside = True
            else:
                break
        buf, run = buf[start:], run - start
    if buf:
        yield buf


def split_text(text: str, chunk_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """``split_pieces`` of one string: consecutive pieces whose encodings join to its encoding."""
    return split_pieces([text], chunk_chars)


def cut_safe(encoder: BatchEncoder) -> bool:
    """Whether cutting a text where ``split_text`` cuts leaves its ids unchanged for this
    tokenizer, tried on a probe text (byte-level BPE: yes; one that marks the start of a text,
    as SentencePiece does: no, and long documents are then tokenized whole)."""
    probe = "Hello world, a test.\nA line\n\nand  a paragraph: é東🙂 ok!\n\tDone. " * 4
    whole = encoder([probe])[0]
    parts = encoder(list(split_text(probe, 16)))[0]
    return np.array_equal(whole, parts)


def encode_chunks(tokenizer: Tokenizer, chunks: Iterable[str]) -> Iterator[tuple[np.ndarray, int]]:
    """(token ids as int64, characters consumed) for groups of ``CHUNKS_PER_BATCH`` chunks (BPE
    encodes a group in parallel threads)."""
    encode_batch = getattr(tokenizer, "encode_batch", None)
    group: list[str] = []

    def flush():
        ids = encode_batch(group) if encode_batch else [tokenizer.encode(c) for c in group]
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64)
        return flat, sum(map(len, group))

    for chunk in chunks:
        group.append(chunk)
        if len(group) == CHUNKS_PER_BATCH:
            yield flush()
            group = []
    if group:
        yield flush()


def encode_text(
    tokenizer: Tokenizer, text: str, progress: bool = True, chunk_chars: int = CHUNK_CHARS
) -> np.ndarray:
    """All token ids of ``text``: shape (n_tokens,), int64, its runs of more than
    ``RUN_CHARS`` characters with no exact cut encoded in pieces. Shows a bar on large inputs."""
    parts = []
    show = progress and len(text) >= PROGRESS_MIN_CHARS
    with tqdm(
        total=len(text), unit="char", unit_scale=True, desc="encode", disable=not show
    ) as bar:
        for ids, n in encode_chunks(tokenizer, split_text(text, chunk_chars)):
            parts.append(ids)
            bar.update(n)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _bar(source: TextSource, desc: str, progress: bool) -> tqdm:
    show = progress and source.n_bytes >= PROGRESS_MIN_CHARS
    return tqdm(total=source.n_bytes, unit="B", unit_scale=True, desc=desc, disable=not show)


def bytes_counted(pieces: Iterable[str], bar: tqdm, then: str | None = None) -> Iterator[str]:
    """``pieces``, counted on ``bar`` in UTF-8 bytes; ``then``: what the bar says once they are
    all read (what its reader does next, e.g. a BPE trainer merging pairs)."""
    for piece in pieces:
        bar.update(len(piece) if piece.isascii() else len(piece.encode("utf-8")))
        yield piece
    if then:
        bar.set_postfix_str(then)


MERGING = "merging pairs"  # what a BPE trainer does once it has read its text


def prepare(
    out_dir: str | Path,
    *,
    dataset: str | None = None,
    text_files: Sequence[str | Path] | None = None,
    tokenizer: str = "char",
    vocab_size: int | None = None,
    val_fraction: float = 0.1,
    progress: bool = True,
    restart: bool = False,
) -> dict:
    """Tokenize ``dataset`` or ``text_files`` into ``out_dir``; returns the meta.json dict.

    The tokenizer is trained on the whole text; train is the first ``1 - val_fraction`` of the
    token stream and val the rest. Memory stays bounded whatever the corpus size: the text is
    streamed twice (train the tokenizer, then encode straight into the token file). The
    directory is locked while it is written (``llm_foundry.lock``). A complete prepare already
    in ``out_dir`` raises ``AlreadyPrepared`` for the same text and settings, a one-line
    DataError for others (``restart``: prepare it again).
    """
    if isinstance(text_files, (str, Path)):  # one path, not a string of one-letter paths
        text_files = [text_files]
    if (dataset is None) == (not text_files):
        raise ValueError(
            f"give exactly one of dataset ({', '.join(DATASETS)}) or text_files; "
            f"got dataset={dataset!r}, text_files={text_files!r}"
        )
    if dataset is not None and dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; valid: {', '.join(DATASETS)}")
    if tokenizer not in TOKENIZER_KINDS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; valid: {', '.join(TOKENIZER_KINDS)}")
    if isinstance(val_fraction, bool) or not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be strictly between 0 and 1; got {val_fraction}")
    if not str(out_dir).strip():
        raise ValueError("the output directory (--out) is empty: give a directory to write")
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ValueError(f"output directory {out_dir} is a file; give a directory to write")

    if dataset:
        text, name = load_shakespeare()
        source = TextSource(text=text, name=name)
    else:
        source = TextSource(files=text_files)
    out = Path(out_dir)
    refuse_overwriting_inputs([("text file", Path(f)) for f in text_files or ()], out, OUTPUTS)
    settings = {"tokenizer": tokenizer, "vocab_size": vocab_size, "val_fraction": val_fraction}
    if not restart and (out / "meta.json").is_file():
        with lock.sharing(out):  # as a reader: a training reading it may go on meanwhile
            check_stream_prepared(out, source, settings)
    created = not out.exists()
    with lock.hold(out, "data directory", readers=True):
        try:
            return _prepare_locked(source, out, dataset, text_files, settings, progress)
        except BaseException:
            if created:  # leave no directory behind a refused input
                shutil.rmtree(out, ignore_errors=True)
            raise


def check_stream_prepared(out: Path, source: TextSource, settings: dict) -> None:
    """Before a text stream is prepared in ``out``: ``AlreadyPrepared`` when it holds a complete
    prepare of the same text (its sha256, read here) and ``settings``, a one-line DataError
    naming the first differences and --restart when it holds another, nothing when none."""
    meta = prepared_before(out, None, "settings", "the settings it was prepared with")
    if meta is None:
        return
    for _ in source.pieces():  # read through once: the text's sha256
        pass
    same_or_refused(out, meta, source.sha256, settings, "the text's", "another text")


def _prepare_locked(source, out, dataset, text_files, settings, progress) -> dict:
    tokenizer, vocab_size = settings["tokenizer"], settings["vocab_size"]
    val_fraction = settings["val_fraction"]
    # a BPE trainer reads the text as it goes (its bar runs until the merges are done too)
    bpe = tokenizer == "bpe"
    with _bar(source, "train BPE" if bpe else "read", progress) as bar:
        pieces = bytes_counted(source.pieces(), bar, MERGING if bpe else None)
        chunks = split_pieces(pieces, CHUNK_CHARS)
        try:
            tok = build_tokenizer(tokenizer, chunks, vocab_size)
        except ValueError:
            if source.n_chars == 0:  # the tokenizer saw nothing to learn from
                raise DataError(
                    f"the text from {source.name} is empty (0 characters); nothing to tokenize"
                ) from None
            raise
    if not source.n_chars:
        raise DataError(f"the text from {source.name} is empty (0 characters); nothing to tokenize")
    dtype = token_dtype(tok.vocab_size)
    remove_temporaries(out, ["tokens", *OUTPUTS])
    tokens = out / f".tokens.{os.getpid()}.tmp"
    written = {name: temporary(out / name) for name in ("train.bin", "val.bin", "tokenizer.json")}
    n, runs = 0, LongRuns()
    try:
        with open(tokens, "wb") as f, _bar(source, "encode", progress) as bar:
            pieces = bytes_counted(source.pieces(), bar)
            chunks = split_pieces(pieces, CHUNK_CHARS, runs=runs if bpe else None)  # char: exact
            for ids, _ in encode_chunks(tok, chunks):
                ids.astype(dtype).tofile(f)
                n += len(ids)
        n_train = int(n * (1 - val_fraction))
        if not 0 < n_train < n:
            raise DataError(
                f"{n} tokens from {source.name} cannot be split with val_fraction="
                f"{val_fraction}: one split would be empty; use more text"
            )
        _split_token_file(tokens, n_train, written["train.bin"], written["val.bin"], dtype)
        tok.save(written["tokenizer.json"])
        meta = {
            "dataset": dataset,
            "source": source.name,
            "text_files": [str(Path(p).resolve()) for p in text_files] if text_files else None,
            "sha256": source.sha256,
            "n_chars": source.n_chars,
            "tokenizer": tok.kind,
            "tokenizer_file": "tokenizer.json",
            "vocab_size": tok.vocab_size,
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
            "pad_id": tok.pad_id,
            "dtype": dtype.name,
            "train_tokens": n_train,
            "val_tokens": n - n_train,
            "val_fraction": val_fraction,
            "split": "train = first (1 - val_fraction) of the token stream, val = the rest",
            "run_chars": RUN_CHARS,
            # runs of more than run_chars characters with no exact cut, cut every run_chars
            "long_runs": {"runs": runs.runs, "cuts": runs.cuts},
            "settings": settings,  # what a later prepare of this directory compares
            "files": {name: file_entry(tmp) for name, tmp in written.items()},
        }
        publish(out, written, json.dumps(meta, indent=2) + "\n")
        remove_unlisted(out, set())  # shards of a document corpus prepared here before
    finally:
        for tmp in [tokens, *written.values()]:
            tmp.unlink(missing_ok=True)
    return meta


def _split_token_file(tokens: Path, n_train: int, train: Path, val: Path, dtype) -> None:
    """The first ``n_train`` tokens of ``tokens`` become ``train``, the rest ``val`` (both new
    files): the tail is copied out in blocks, then the file is cut short and renamed (no second
    full copy)."""
    itemsize = np.dtype(dtype).itemsize
    with open(tokens, "rb") as src, open(val, "wb") as dst:
        src.seek(n_train * itemsize)
        shutil.copyfileobj(src, dst, COPY_BYTES)
    os.truncate(tokens, n_train * itemsize)
    os.replace(tokens, train)
