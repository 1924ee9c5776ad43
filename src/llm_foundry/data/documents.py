"""Prepare a corpus of documents into shards: ``prepare_documents(out_dir, inputs, ...)``.

The documents (``corpus.read_records``: text files, JSONL, parquet, ``datasets``) are read once
in a fixed order. Each is tokenized on its own and followed by the end-of-text id, then appended
to the open shard of its split (``shard_writer.SplitWriter``); a shard closes at the first
document boundary at or past ``shard_tokens``. Validation holds whole documents: those of a
``val_sources`` input, or by ``val_fraction`` f the documents i (counted over the inputs) with
floor((i+1) f) > floor(i f), spread evenly through the corpus.

Tokenizer: ``tokenizer_from`` (a model's tokenizer.json, one of our runs or checkpoints, or an
HF directory; its end-of-sequence token ends the documents; the files beside it that carry an HF
tokenizer's chat template and special tokens (``tokenizer_files``) are published beside the
shards, so that a model trained on them keeps its chat format), or byte-level BPE trained with the
chat markers reserved (``tokenizer.CHAT_TOKENS``) on a sample of at most ``tokenizer_sample``
bytes of the training documents drawn evenly over all of them (``corpus.draw_sample``). Special
tokens written in a document are text: only the end-of-text id between documents is special.

``workers`` > 1 tokenizes in that many processes (HF tokenizers' batch encoding, one thread
each); 1 tokenizes here (the tokenizer's own threads). Documents go to the workers in batches of
pieces (a document past ``PIECE_CHARS`` is cut where encoding the pieces gives the ids of the
whole, when the tokenizer allows it; a run of over ``encode.RUN_CHARS`` characters with no such
place, e.g. base64 or DNA, every ``RUN_CHARS`` characters, where a token may break: counted in
``long_runs``), at most ``2 * workers`` batches in flight, and come back in order: the output is
the same bytes whatever the number of workers, and memory stays flat whatever the corpus size.

An interrupted prepare (Ctrl-C, a crash, a kill) leaves no meta.json and a progress record;
calling it again with the same inputs and settings goes on from the last closed shard
(``shard_writer``). meta.json, written last, lists every shard and every file's size and check,
with the inputs and settings (``"inputs"``, ``"settings"``): called again on a complete
directory, it does nothing with the same ones (``shard_writer.AlreadyPrepared``) and is refused
with others, as a resume is (``restart`` prepares it again from scratch). An input file that
changes while it is prepared (``corpus.InputChanged``) stops it with nothing left to resume:
what was written came partly from the file as it was.

Notes (``note: ...`` lines, logged as warnings on the ``llm_foundry`` logger, which the command
line prints): what a directory input left out, a resume and where it goes on from, the files
left out as empty.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from llm_foundry import lock
from llm_foundry.data.batches import SPLITS, file_entry
from llm_foundry.data.corpus import (
    BAD_ROWS,
    BAD_UTF8,
    LISTED_PATHS,
    Group,
    InputChanged,
    LongText,
    check_unchanged,
    draw_sample,
    read_records,
    record_count,
    resolve_inputs,
    skipped_counts,
    skipped_note,
)
from llm_foundry.data.encode import (
    MERGING,
    PROGRESS_MIN_CHARS,
    RUN_CHARS,
    WHOLE,
    LongRuns,
    bytes_counted,
    cut_safe,
    split_pieces,
    token_dtype,
)
from llm_foundry.data.shard_writer import (
    PROGRESS_FILE,
    PROGRESS_VERSION,
    SplitWriter,
    check_prepared,
    check_resumable,
    clear_outputs,
    load_progress,
    remove_unlisted,
    save_progress,
)
from llm_foundry.data.sources import (
    DataError,
    publish,
    refuse_overwriting_inputs,
    remove_temporaries,
    temporary,
)
from llm_foundry.messages import NAMED, first_few, one_line
from llm_foundry.tokenizer import (
    DEFAULT_BPE_VOCAB,
    END_OF_TEXT,
    BatchEncoder,
    BPETokenizer,
    encode_in_worker,
    start_encoding_worker,
)
from llm_foundry.tokenizer_files import METADATA_FILES, metadata_files

DEFAULT_SHARD_TOKENS = 100_000_000
DEFAULT_TOKENIZER_SAMPLE = 200_000_000  # bytes of text the BPE is trained on, at most
PIECE_CHARS = 1 << 16  # a document past this is tokenized in pieces (where that is exact)
SAMPLE_PIECE_CHARS = 1 << 14  # the tokenizer's sample is drawn in pieces of about this size
BATCH_CHARS = 1 << 20  # characters sent to a worker at a time
BATCH_PIECES = 2048
BATCH_OPS = 4 * BATCH_PIECES  # what a batch records (pieces, document ends, skips), at most
DTYPES = ("auto", "uint16", "uint32")
TOKENIZER_TMP = ".tokenizer.json.partial"
HF_EOT_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Tokenizing (here or in worker processes)


def _pool(workers: int, tokenizer_json: str, dtype: str) -> ProcessPoolExecutor:
    # forkserver: workers are forked from a server process started clean (no copy of this
    # process's threads, its torch or its memory), which imports the tokenizer module once
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["llm_foundry.tokenizer"])
    return ProcessPoolExecutor(
        workers,
        mp_context=ctx,
        initializer=start_encoding_worker,
        initargs=(tokenizer_json, dtype, os.getpid()),
    )


# ----------------------------------------------------------------------------------------------
# The tokenizer


class ModelTokenizer(NamedTuple):
    """A model's tokenizer for a document corpus (``--tokenizer-from``)."""

    file: Path
    json: str  # the file's text
    kind: str  # "bpe" (ours) or "hf"
    eot_id: int  # what ends each document
    eot: str  # that token
    special_ids: dict[str, int]
    metadata: dict[str, bytes]  # the tokenizer_files metadata files beside it: name -> bytes


def model_tokenizer(path: str | Path) -> ModelTokenizer:
    """The tokenizer of ``--tokenizer-from``. ``path``: a tokenizer.json, a directory holding
    one (an HF model), one of our checkpoints or a training run."""
    from llm_foundry.rundir import checkpoint_dir
    from llm_foundry.tokenizer import load_any_tokenizer

    p = Path(path)
    file = p
    if p.is_dir():
        file = p / "tokenizer.json"
        if not file.is_file():
            file = checkpoint_dir(p, "--tokenizer-from") / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"--tokenizer-from {path}: no tokenizer.json there")
    tok = load_any_tokenizer(file)
    if tok.kind == "char":
        raise DataError(
            f"--tokenizer-from {path}: {file} is a character tokenizer, which has no "
            "end-of-text token to end documents with; give a BPE or Hugging Face tokenizer"
        )
    text = file.read_text(encoding="utf-8")
    # read once: what is published is what the settings' digests name
    metadata = {name: (file.parent / name).read_bytes() for name in metadata_files(file.parent)}
    if tok.kind == "bpe":
        return ModelTokenizer(file, text, "bpe", tok.eos_id, END_OF_TEXT, tok.special_ids, metadata)
    eot = _hf_end_of_text(file.parent, tok.hf)
    if eot is None:
        raise DataError(
            f"--tokenizer-from {path}: found no end-of-text token (config.json eos_token_id, "
            f"tokenizer_config.json eos_token, or one of {', '.join(HF_EOT_NAMES)}) to end "
            "documents with"
        )
    name = tok.hf.id_to_token(eot)
    return ModelTokenizer(file, text, "hf", eot, name, {name: eot}, metadata)


def _hf_end_of_text(directory: Path, hf) -> int | None:
    from llm_foundry.chat import special_tokens, tokenizer_config

    config = directory / "config.json"
    if config.is_file():
        try:
            value = json.loads(config.read_text(encoding="utf-8")).get("eos_token_id")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            value = None
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    name = special_tokens(tokenizer_config(directory)).get("eos_token")
    for candidate in ([name] if name else []) + list(HF_EOT_NAMES):
        if (i := hf.token_to_id(candidate)) is not None:
            return i
    return None


# ----------------------------------------------------------------------------------------------
# Documents in order, split and cut into batches


class _Val:
    """Which documents of the inputs are validation: document i when floor((i+1) f) >
    floor(i f), f = ``fraction`` as written (exact decimal arithmetic)."""

    def __init__(self, fraction: float | None):
        f = Fraction(repr(float(fraction))) if fraction else Fraction(0)
        self.p, self.q = f.numerator, f.denominator

    def __call__(self, i: int) -> bool:
        return ((i + 1) * self.p) // self.q > (i * self.p) // self.q


def _pieces(text: str | LongText, cut: bool, limit: int | None = None,
            runs: LongRuns | None = None) -> Iterator[str]:  # fmt: skip
    """A document as the pieces it is tokenized in (or sampled in: ``limit``); not ``cut``: one
    piece but where a run of over ``RUN_CHARS`` characters is cut (counted in ``runs``)."""
    chunk = (limit or PIECE_CHARS) if cut else WHOLE
    if isinstance(text, str) and len(text) <= min(chunk, RUN_CHARS):
        yield text
    else:
        yield from split_pieces(text.pieces() if isinstance(text, LongText) else [text], chunk,
                                runs=runs)  # fmt: skip


def _batches(records, file_group: list[int], val_groups: set[int], next_doc: int, is_val: _Val,
             cut: bool) -> Iterator[tuple[list[str], list[tuple]]]:  # fmt: skip
    """(pieces, ops) batches: the ops say, in order, where each piece goes: ("begin", split),
    ("piece",), ("end", group, file, next record, next document number, where if a long run was
    cut in it else None), ("skip", group, kind, file, next record, where). ``file_group``: the
    group of each file; ``val_groups``: those of the val sources."""
    pieces: list[str] = []
    ops: list[tuple] = []
    chars, runs = 0, LongRuns()
    for r in records:
        if len(ops) >= BATCH_OPS:  # many short, empty or skipped records: bounded all the same
            yield pieces, ops
            pieces, ops, chars = [], [], 0
        group = file_group[r.file]
        if r.kind != "doc":
            ops.append(("skip", group, r.kind, r.file, r.next, r.where))
            continue
        if group in val_groups:
            split = "val"
        else:
            split = "val" if is_val(next_doc) else "train"
            next_doc += 1
        ops.append(("begin", split))
        cuts = runs.cuts
        for piece in _pieces(r.text, cut, runs=runs):
            pieces.append(piece)
            ops.append(("piece",))
            chars += len(piece)
            if chars >= BATCH_CHARS or len(pieces) >= BATCH_PIECES:
                yield pieces, ops
                pieces, ops, chars = [], [], 0
        long = (r.where or str(getattr(r.text, "path", ""))) if runs.cuts > cuts else None
        ops.append(("end", group, r.file, r.next, next_doc, long))
    if ops:
        yield pieces, ops


# ----------------------------------------------------------------------------------------------
# prepare_documents


def prepare_documents(
    out_dir: str | Path,
    inputs: Sequence[str | Path] = (),
    *,
    hf_datasets: Sequence[str] = (),
    val_sources: Sequence[str | Path] = (),
    split: str | None = None,
    text_field: str | None = None,
    text_column: str | None = None,
    vocab_size: int | None = None,
    tokenizer_from: str | Path | None = None,
    tokenizer_sample: int = DEFAULT_TOKENIZER_SAMPLE,
    val_fraction: float | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    dtype: str = "auto",
    workers: int = 1,
    on_bad_utf8: str = "fail",
    on_bad_row: str = "fail",
    restart: bool = False,
    progress: bool = True,
) -> dict:
    """Tokenize the documents of ``inputs`` (files, globs, directories, saved datasets) and
    ``hf_datasets`` (hub names) into shards in ``out_dir``; returns the meta.json dict.

    Validation: the documents of ``val_sources``, else the fraction ``val_fraction`` (default
    0.1) of the documents, spread evenly. An interrupted call resumes when called again with the
    same inputs and settings (``restart``: start over instead). On a directory it prepared
    completely, it raises ``shard_writer.AlreadyPrepared`` (carrying its meta.json; nothing is
    written) with the same inputs and settings, a DataError naming what differs with others
    (``restart``: prepare it again). ``text_field`` (JSONL) and ``text_column`` (parquet,
    datasets) default to "text"; one given for none of the inputs' formats is refused. Errors
    the user can fix are one-line DataErrors (or ValueErrors for the arguments)."""
    _check_arguments(locals())
    if val_sources and val_fraction is not None:
        raise ValueError("give --val-fraction or --val-source, not both")
    if not (inputs or hf_datasets):
        raise ValueError("no input: give --input PATH... or --hf-dataset NAME")
    fraction = None if val_sources else (0.1 if val_fraction is None else float(val_fraction))
    out = Path(out_dir)
    groups = resolve_inputs(inputs, hf_datasets, val_sources, split, text_column, text_field)
    settings = {
        "tokenizer": "from" if tokenizer_from else "bpe",
        "vocab_size": None if tokenizer_from else (vocab_size or DEFAULT_BPE_VOCAB),
        "tokenizer_sample": None if tokenizer_from else tokenizer_sample,
        "tokenizer_from": None,
        "val_fraction": fraction,
        "shard_tokens": shard_tokens,
        "dtype": dtype,
        "text_field": "text" if text_field is None else text_field,
        "text_column": "text" if text_column is None else text_column,
        "split": split,
        "on_bad_utf8": on_bad_utf8,
        "piece_chars": PIECE_CHARS,
        "special_tokens_in_text": "encoded as text",
    }
    if on_bad_row != "fail":  # kept only when given: directories prepared before it are the same
        settings["on_bad_row"] = on_bad_row
    model = None
    if tokenizer_from:
        model = model_tokenizer(tokenizer_from)
        refuse_overwriting_inputs([("--tokenizer-from", model.file)], out, ["tokenizer.json"])
        sha = hashlib.sha256(model.json.encode("utf-8")).hexdigest()
        settings["tokenizer_from"] = {"file": str(model.file.resolve()), "sha256": sha}
        if model.metadata:  # none: the settings of a directory prepared before they were kept
            settings["tokenizer_from"]["metadata"] = {
                name: hashlib.sha256(data).hexdigest() for name, data in model.metadata.items()
            }
    identity = {
        "inputs": [
            [g.input, g.split, [[f.path, f.format, f.stamp] for f in g.files]] for g in groups
        ],
        "settings": settings,
    }
    job = _Job(out, groups, settings, identity, model, workers, progress)
    if not restart and (out / "meta.json").is_file():
        with lock.sharing(out):  # as a reader: a training reading it may go on meanwhile
            check_prepared(out, identity)
    created = not out.exists()
    with lock.hold(out, "data directory", readers=True):
        try:
            return job.run(restart)
        except BaseException:
            if created and not (out / PROGRESS_FILE).exists():  # nothing there to resume
                shutil.rmtree(out, ignore_errors=True)
            raise


def _check_arguments(a: dict) -> None:
    def whole(name, low):
        v = a[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an integer >= {low}; got {v!r}")

    whole("workers", 1)
    whole("shard_tokens", 1)
    whole("tokenizer_sample", 1)
    if a["vocab_size"] is not None:
        if a["tokenizer_from"]:
            raise ValueError("vocab_size is for a trained tokenizer, not with tokenizer_from")
        whole("vocab_size", 256 + 5)
    f = a["val_fraction"]
    if f is not None and (isinstance(f, bool) or not 0 < f < 1):
        raise ValueError(f"val_fraction must be strictly between 0 and 1; got {f!r}")
    if a["dtype"] not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {a['dtype']!r}")
    if a["on_bad_utf8"] not in BAD_UTF8:
        raise ValueError(f"on_bad_utf8 must be one of {', '.join(BAD_UTF8)}")
    if a["on_bad_row"] not in BAD_ROWS:
        raise ValueError(f"on_bad_row must be one of {', '.join(BAD_ROWS)}")
    if not str(a["out_dir"]).strip():
        raise ValueError("the output directory (--out) is empty: give a directory to write")
    if Path(a["out_dir"]).exists() and not Path(a["out_dir"]).is_dir():
        raise ValueError(f"output directory {a['out_dir']} is a file; give a directory to write")


def _stats() -> dict:
    return {"documents": 0, "tokens": 0, "empty": 0, "bad_utf8": 0, "bad_utf8_first": None,
            "bad_rows": 0, "bad_rows_first": None, "empty_files": 0, "empty_files_first": [],
            "long_runs": 0, "long_runs_first": None}  # fmt: skip


# a record's counter
SKIPS = {"empty": "empty", "bad": "bad_utf8", "bad_row": "bad_rows", "empty_file": "empty_files"}


class _Job:
    """One prepare_documents call, run under the directory's lock."""

    def __init__(self, out, groups, settings, identity, model, workers, progress):
        self.out, self.groups, self.settings = out, groups, settings
        self.identity, self.model = identity, model
        self.workers, self.progress = workers, progress
        self.is_val = _Val(settings["val_fraction"])
        self.val_groups = {i for i, g in enumerate(groups) if g.split == "val"}
        self.file_group = [f.group for g in groups for f in g.files]
        self.read = dict(text_field=settings["text_field"], text_column=settings["text_column"],
                         on_bad_utf8=settings["on_bad_utf8"],
                         on_bad_row=settings.get("on_bad_row", "fail"))  # fmt: skip
        self.seconds = {"tokenizer": 0.0, "encode": 0.0}

    def _bar(self, desc: str, groups: list[Group], initial: int = 0) -> tqdm:
        total = sum(f.bytes for g in groups for f in g.files)
        show = self.progress and total >= PROGRESS_MIN_CHARS
        return tqdm(total=total, initial=initial, unit="B", unit_scale=True, desc=desc,
                    disable=not show)  # fmt: skip

    def run(self, restart: bool) -> dict:
        if not restart:  # again under the lock: one may have completed since
            check_prepared(self.out, self.identity)
        for g in self.groups:
            if note := skipped_note(g):
                log.warning(note)
        try:
            return self._run(restart)
        except InputChanged as e:
            # its shards and tokenizer came partly from the file as it was: nothing to resume
            clear_outputs(self.out)
            raise InputChanged(f"{str(e).removesuffix('; run again')}: what was written from "
                               f"these inputs in {self.out} is removed (part of it came from the "
                               "file as it was); run again to prepare it anew") from None  # fmt: skip

    def _run(self, restart: bool) -> dict:
        out = self.out
        remove_temporaries(out, ["meta.json", PROGRESS_FILE, *METADATA_FILES])
        record = load_progress(out)
        if record is not None and restart:
            record = None
        if record is not None:
            check_resumable(out, record, self.identity)
            tok_json = self._saved_tokenizer(record)
            for st in record["groups"]:  # a record written before these counters were kept
                for key, value in _stats().items():
                    st.setdefault(key, value)
            log.warning(self._resume_note(record))
        else:
            t0 = time.monotonic()
            tok_json, info = self._tokenizer()
            self.seconds["tokenizer"] = time.monotonic() - t0
            self._dtype(info)  # refused before anything is removed
            clear_outputs(out)
            (out / TOKENIZER_TMP).write_text(tok_json, encoding="utf-8")
            record = {
                "version": PROGRESS_VERSION,
                "identity": self.identity,
                "tokenizer": info,
                "tokenizer_sha256": hashlib.sha256(tok_json.encode("utf-8")).hexdigest(),
                "position": [0, 0],
                "next_doc": 0,
                "splits": {},
                "groups": [_stats() for _ in self.groups],
            }
            save_progress(out, record)
        resumed = record["position"] != [0, 0]
        dtype = self._dtype(record["tokenizer"])
        t0 = time.monotonic()
        writers = {
            s: SplitWriter(out, s, dtype, self.settings["shard_tokens"], record["splits"].get(s))
            for s in SPLITS
        }
        try:
            self._encode(record, writers, tok_json, dtype)
            for w in writers.values():
                w.close()
        finally:
            for w in writers.values():
                w.abandon()
        for f in (f for g in self.groups for f in g.files):  # those read before changed since?
            check_unchanged(f)
        record["splits"] = {s: w.state() for s, w in writers.items()}
        save_progress(out, record)
        self.seconds["encode"] = time.monotonic() - t0
        carried, removed = self._metadata()
        written = {"tokenizer.json": out / TOKENIZER_TMP, **carried}
        meta = self._meta(record, writers, dtype, resumed, written)
        publish(out, written, json.dumps(meta, indent=2) + "\n", removed)
        remove_unlisted(out, set(meta["files"]))  # the progress record last
        if note := _empty_files_note(meta["sources"]):
            log.warning(note)
        return meta

    def _resume_note(self, record: dict) -> str:
        """What a resume keeps, and where it goes on from."""
        files = [f for g in self.groups for f in g.files]
        done, rows = record["position"]
        shards = sum(len(s["done"]) for s in record["splits"].values())
        if [done, rows] == [0, 0]:
            return (f"note: resuming {self.out}: its tokenizer is trained already; no document "
                    "was written yet")  # fmt: skip
        at = ""
        if rows and rows == record_count(files[done]):  # file `done` was read to its end
            done, rows = done + 1, 0
        elif rows:  # JSON lines count lines (blank ones too), tables rows
            unit = "lines" if files[done].format.startswith("jsonl") else "rows"
            at = f" after its first {rows:,} {unit}"
        kept = f"{done:,} of {len(files):,} input files already written ({shards:,} shards kept)"
        if done == len(files):
            return f"note: resuming {self.out}: {kept}; finishing"
        return f"note: resuming {self.out}: {kept}; going on from {files[done].path}{at}"

    # -- the tokenizer
    def _metadata(self) -> tuple[dict[str, Path], list[str]]:
        """The tokenizer's metadata files written under temporary names (name -> that path), and
        the names of an earlier prepare's files this tokenizer lacks (``publish`` removes them
        once meta.json is gone, so no meta.json names a deleted file)."""
        carried = self.model.metadata if self.model is not None else {}
        written, removed = {}, []
        for name in METADATA_FILES:
            if name in carried:
                written[name] = temporary(self.out / name)
                written[name].write_bytes(carried[name])
            elif (self.out / name).exists():
                removed.append(name)
        return written, removed

    def _saved_tokenizer(self, record: dict) -> str:
        path = self.out / TOKENIZER_TMP
        if not path.is_file() and (self.out / "tokenizer.json").is_file():
            # stopped while it was being published: it was put in place already
            shutil.copyfile(self.out / "tokenizer.json", path)
        text = path.read_text(encoding="utf-8") if path.is_file() else None
        if text is None or hashlib.sha256(text.encode()).hexdigest() != record["tokenizer_sha256"]:
            raise DataError(
                f"cannot resume: {path}, the tokenizer of the interrupted prepare, is missing or "
                "changed; add --restart to discard it and prepare from the start"
            )
        return text

    def _tokenizer(self) -> tuple[str, dict]:
        from tokenizers import Tokenizer

        if self.model is not None:
            m = self.model
            vocab = Tokenizer.from_str(m.json).get_vocab_size()
            info = {"kind": m.kind, "from": str(m.file.resolve()), "vocab_size": vocab,
                    "eot_id": m.eot_id, "eot": m.eot, "special_ids": m.special_ids,
                    "sample_bytes": None, "corpus_bytes": None}  # fmt: skip
            return m.json, info
        tok, kept, seen = self._train_bpe()
        info = {"kind": "bpe", "from": None, "vocab_size": tok.vocab_size, "eot_id": tok.eos_id,
                "eot": END_OF_TEXT, "special_ids": tok.special_ids, "sample_bytes": kept,
                "corpus_bytes": seen}  # fmt: skip
        return tok.hf.to_str(pretty=True), info

    def _train_bpe(self) -> tuple[BPETokenizer, int, int]:
        """Byte-level BPE trained on ``draw_sample`` of the training documents; every input is
        read through (and checked) once."""
        counts = {"train": 0, "val": 0}
        left = dict.fromkeys(SKIPS.values(), 0)
        with self._bar("read sample", self.groups) as bar:

            def texts() -> Iterator[str]:
                i = 0
                for r in read_records(self.groups, progress=bar.update, **self.read):
                    if r.kind != "doc":
                        left[SKIPS[r.kind]] += 1
                        continue
                    if self.file_group[r.file] in self.val_groups or self.is_val(i):
                        counts["val"] += 1
                    else:
                        counts["train"] += 1
                        yield from _pieces(r.text, True, SAMPLE_PIECE_CHARS)
                    i += self.file_group[r.file] not in self.val_groups

            sample, kept, seen = draw_sample(texts(), self.settings["tokenizer_sample"])
        self._check_counts(counts["train"], counts["val"], left)
        # the trainer reads the sample as it goes; the bar runs until the merges are done too
        show = self.progress and seen >= PROGRESS_MIN_CHARS
        with tqdm(total=kept, unit="B", unit_scale=True, desc="train BPE",
                  disable=not show) as bar:  # fmt: skip
            pieces = bytes_counted(sample, bar, MERGING)
            tok = BPETokenizer.train(pieces, self.settings["vocab_size"], chat_tokens=True)
        return tok, kept, seen

    def _check_counts(self, train: int, val: int, left: dict[str, int]) -> None:
        """Refuse a corpus with no training or no validation document; ``left``: how many
        records were left out, by counter ("empty", "bad_utf8", "bad_rows", "empty_files")."""
        f = self.settings["val_fraction"]
        if train == 0:
            words = {"empty_files": "empty file{}", "empty": "empty text{}",
                     "bad_utf8": "text{} not UTF-8", "bad_rows": "bad row{}",
                     "val": "val document{}"}  # fmt: skip
            what = ", ".join(f"{n:,} {w.format('' if n == 1 else 's')}" for k, w in words.items()
                             if (n := {**left, "val": val}.get(k, 0)))  # fmt: skip
            raise DataError(f"the inputs hold no training document ({what or 'nothing read'})")
        if val == 0:
            how = (f"--val-fraction {f} picks none of {train:,} documents (one needs at least "
                   f"{int(np.ceil(1 / f)):,})") if f else "the --val-source holds no document"  # fmt: skip
            raise DataError(f"no validation document: {how}; use a larger --val-fraction or more "
                            "documents, or --val-source")  # fmt: skip

    def _dtype(self, info: dict) -> np.dtype:
        want, vocab = self.settings["dtype"], info["vocab_size"]
        dtype = token_dtype(vocab) if want == "auto" else np.dtype(want)
        if np.iinfo(dtype).max < vocab - 1:
            raise DataError(
                f"--dtype {want} cannot hold the tokenizer's ids (vocabulary of {vocab:,}: ids up "
                f"to {vocab - 1:,} > {np.iinfo(dtype).max:,}); use --dtype uint32 or auto"
            )
        return dtype

    # -- the documents
    def _encode(self, record: dict, writers: dict, tok_json: str, dtype: np.dtype) -> None:
        encoder = BatchEncoder(tok_json, dtype.name)
        cut = cut_safe(encoder)
        position = tuple(record["position"])
        files = [f for g in self.groups for f in g.files]
        done = sum(f.bytes for f in files[: position[0]])
        stats = record["groups"]
        eot = np.array([record["tokenizer"]["eot_id"]], dtype)
        at = {"writer": None, "tokens": 0}

        def consume(ids: np.ndarray, lengths: np.ndarray, ops: list[tuple]) -> None:
            k = start = 0
            for op in ops:
                tag = op[0]
                if tag == "piece":
                    n = int(lengths[k])
                    at["writer"].write(ids[start : start + n])
                    at["tokens"] += n
                    start += n
                    k += 1
                elif tag == "begin":
                    at["writer"], at["tokens"] = writers[op[1]], 0
                    at["writer"].begin()
                elif tag == "end":
                    _, group, file, nxt, next_doc, long = op
                    closed = at["writer"].end(eot)
                    stats[group]["documents"] += 1
                    stats[group]["long_runs"] += long is not None  # a long run cut in it
                    stats[group]["long_runs_first"] = stats[group]["long_runs_first"] or long
                    stats[group]["tokens"] += at["tokens"] + 1
                    record["position"], record["next_doc"] = [file, nxt], next_doc
                    if closed:  # a shard is complete: what precedes this point is on disk
                        for w in writers.values():
                            w.sync()
                        record["splits"] = {s: w.state() for s, w in writers.items()}
                        save_progress(self.out, record)
                else:
                    _, group, kind, file, nxt, where = op
                    key = SKIPS[kind]
                    stats[group][key] += 1
                    if key in ("bad_utf8", "bad_rows") and stats[group][f"{key}_first"] is None:
                        stats[group][f"{key}_first"] = where
                    if key == "empty_files" and len(stats[group]["empty_files_first"]) < NAMED:
                        stats[group]["empty_files_first"].append(where)
                    record["position"] = [file, nxt]

        with self._bar("tokenize", self.groups, done) as bar:
            records = read_records(self.groups, position, progress=bar.update, **self.read)
            batches = _batches(records, self.file_group, self.val_groups, record["next_doc"],
                               self.is_val, cut)  # fmt: skip
            _run(batches, consume, encoder, self.workers, tok_json, dtype)
        try:
            left = {k: sum(st[k] for st in stats) for k in SKIPS.values()}
            self._check_counts(writers["train"].total_documents, writers["val"].total_documents,
                               left)  # fmt: skip
        except DataError:
            clear_outputs(self.out)  # these settings can never complete: nothing left to resume
            raise

    # -- meta.json
    def _meta(self, record: dict, writers: dict, dtype: np.dtype, resumed: bool,
              written: dict[str, Path]) -> dict:  # fmt: skip
        info = record["tokenizer"]
        shards = {s: writers[s].done for s in SPLITS}
        files = {name: file_entry(path) for name, path in written.items()}
        for s in SPLITS:
            files.update(writers[s].files)
        digest = hashlib.sha256()
        for s in SPLITS:
            for e in shards[s]:
                digest.update(f"{s} {e['file']} {e['sha256']}\n".encode())
        sources = []
        for g, st in zip(self.groups, record["groups"], strict=True):
            entry = {"input": g.input,
                     "split": "val" if g.split == "val" else
                              ("train" if self.val_groups else "train+val"),
                     "formats": sorted({f.format for f in g.files}), "files": len(g.files),
                     "bytes": sum(f.bytes for f in g.files), **st,
                     "skipped": skipped_counts(g)}  # fmt: skip
            if len(g.files) <= LISTED_PATHS:
                entry["paths"] = [f.path for f in g.files]
            sources.append(entry)
        specials = info["special_ids"]
        f = self.settings["val_fraction"]
        seconds = sum(self.seconds.values())
        in_bytes = sum(s["bytes"] for s in sources)
        return {
            "kind": "documents",
            "dataset": None,
            "source": one_line(", ".join(g.input for g in self.groups), 300),
            "sources": sources,
            "inputs": self.identity["inputs"],  # what a later prepare of this directory compares
            "sha256": digest.hexdigest(),
            "tokenizer": info["kind"],
            "tokenizer_file": "tokenizer.json",
            "tokenizer_sha256": record["tokenizer_sha256"],
            "tokenizer_from": info["from"],
            "tokenizer_sample_bytes": info["sample_bytes"],
            "tokenizer_corpus_bytes": info["corpus_bytes"],
            "vocab_size": info["vocab_size"],
            "bos_id": specials.get("<bos>"),
            "eos_id": info["eot_id"],
            "pad_id": specials.get("<pad>"),
            "eot_id": info["eot_id"],
            "eot": info["eot"],
            "special_ids": specials,
            "dtype": dtype.name,
            "train_tokens": writers["train"].total_tokens,
            "val_tokens": writers["val"].total_tokens,
            "train_documents": writers["train"].total_documents,
            "val_documents": writers["val"].total_documents,
            "val_fraction": f,
            "val_source": [g.input for g in self.groups if g.split == "val"] or None,
            "split": (
                f"val = document i of the inputs when floor((i+1)*{f}) > floor(i*{f}); "
                "train = the others"
            )
            if f
            else "val = the documents of --val-source; train = those of the inputs",  # fmt: skip
            "documents": "each document's tokens then eot_id; shards close at a document "
            "boundary once they hold shard_tokens",
            "settings": self.settings,
            "shards": shards,
            "files": files,
            "timing": {
                "workers": self.workers,
                "resumed": resumed,
                "tokenizer_seconds": round(self.seconds["tokenizer"], 3),
                "encode_seconds": round(self.seconds["encode"], 3),
                "input_mb_per_second": round(in_bytes / 1e6 / seconds, 3) if seconds else None,
            },
        }


def _empty_files_note(sources: list[dict]) -> str | None:
    """One line naming how many input files held no document (and the first few), or None."""
    n = sum(s["empty_files"] for s in sources)
    if not n:
        return None
    names = [p for s in sources for p in s["empty_files_first"]]
    return (f"note: left out {n:,} empty input file{'s' if n != 1 else ''} (0 bytes, or no row): "
            f"{first_few(names, n)}")  # fmt: skip


_NO_IDS = (np.zeros(0, np.uint32), np.zeros(0, np.int64))


def _run(batches, consume, encoder: BatchEncoder, workers: int, tok_json: str, dtype) -> None:
    """Encode every batch (here, or in ``workers`` processes with at most ``2 * workers``
    batches in flight) and hand the results to ``consume`` in order."""
    if workers == 1:
        for pieces, ops in batches:
            consume(*(encoder(pieces) if pieces else _NO_IDS), ops)
        return
    pool = _pool(workers, tok_json, dtype.name)
    inflight: deque = deque()
    try:
        for pieces, ops in batches:
            inflight.append((pool.submit(encode_in_worker, pieces) if pieces else None, ops))
            while len(inflight) > 2 * workers:
                future, ops = inflight.popleft()
                consume(*(future.result() if future else _NO_IDS), ops)
        while inflight:
            future, ops = inflight.popleft()
            consume(*(future.result() if future else _NO_IDS), ops)
    except BrokenProcessPool as e:
        raise DataError(
            f"a tokenizing worker process died ({one_line(e, 120)}; out of memory?); what was "
            "complete is kept: run the same command again to resume"
        ) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
