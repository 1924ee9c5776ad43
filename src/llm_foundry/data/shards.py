"""A prepared corpus on disk as shards: the layout ``prepare`` writes and every reader reads.

    DATA_DIR/
      meta.json           dtype, vocab_size, tokenizer, the shards of each split (below), sources
      tokenizer.json
      train_00000.bin     tokens (uint16 or uint32), documents one after another, each ended by
      train_00000.idx     the end-of-text id; .idx: uint64 start of every document, then the end
      ...                 (documents + 1 entries)
      val_00000.bin/.idx  held-out documents, never windows cut from the training stream

meta.json's ``"shards"`` lists, per split, each shard's ``file``, ``tokens``, ``documents`` and
``index`` (the .idx file, or null for a stream without document boundaries); ``"files"`` records
every file's size and check digest (``batches.file_entry``), so a shard truncated or replaced on
disk is refused. A directory from before shards (one ``train.bin``/``val.bin``, no index) reads
as one shard per split.

``prepare --input`` (``documents.prepare_documents``, through ``shard_writer``) writes this
layout; its meta.json adds ``eot_id`` (= ``eos_id``: the id that ends every document), a
``sha256`` of each shard's bytes in its entry, ``train_documents``/``val_documents``, the
``sources`` read (per input: files, bytes, documents, tokens, empty and non-UTF-8 documents left
out), the ``settings`` that made it and ``timing`` (the one part that differs between runs of
the same inputs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llm_foundry import lock
from llm_foundry.data.batches import SPLITS, check_files, load_meta, open_tokens
from llm_foundry.data.sources import DataError
from llm_foundry.messages import shown

INDEX_DTYPE = np.dtype("<u8")  # document starts: uint64 little-endian
SHARD_FILE = re.compile(r"(train|val)_\d{5,}\.(bin|idx)")  # the names shard_name/index_name give


def shard_name(split: str, number: int) -> str:
    """The token file of shard ``number`` of ``split``: train_00000.bin, ..."""
    return f"{split}_{number:05d}.bin"


def index_name(shard_file: str) -> str:
    """The document index beside a shard: train_00000.bin -> train_00000.idx."""
    return shard_file.removesuffix(".bin") + ".idx"


@dataclass(frozen=True)
class Shard:
    """One token file of a split: ``tokens`` ids in ``path``, ``documents`` documents whose
    starts ``index`` lists (None: a plain stream, windows only)."""

    path: Path
    tokens: int
    documents: int | None = None
    index: Path | None = None


def split_shards(data_dir: str | Path, split: str, meta: dict | None = None) -> list[Shard]:
    """The shards of ``split`` ("train" or "val") that meta.json lists, in order."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    data_dir = Path(data_dir)
    meta = load_meta(data_dir) if meta is None else meta
    listed = (meta.get("shards") or {}).get(split)
    if listed is None:  # one file per split, from before shards
        return [Shard(data_dir / f"{split}.bin", int(meta.get(f"{split}_tokens") or 0))]
    where = data_dir / "meta.json"
    if not isinstance(listed, list) or not listed:
        raise DataError(f"{where}: shards.{split} is {shown(listed)}; expected a non-empty list")
    shards = []
    for i, entry in enumerate(listed):
        ok = isinstance(entry, dict) and isinstance(entry.get("file"), str)
        ok = ok and isinstance(entry.get("tokens"), int) and entry["tokens"] > 0
        if not ok:
            raise DataError(
                f"{where}: shards.{split}[{i}] is {shown(entry)}; expected file and tokens > 0"
            )
        index = entry.get("index")
        shards.append(
            Shard(
                data_dir / entry["file"],
                entry["tokens"],
                entry.get("documents"),
                data_dir / index if isinstance(index, str) else None,
            )
        )
    return shards


def open_shard(data_dir: str | Path, shard: Shard, meta: dict) -> np.memmap:
    """The shard's tokens, memory-mapped read-only after checking the file is the one meta.json
    records (size and check digest)."""
    data_dir = Path(data_dir)
    with lock.sharing(data_dir):
        check_files(data_dir, meta, [shard.path.name])
        return open_tokens(shard.path, meta["dtype"], shard.tokens)


def document_starts(data_dir: str | Path, shard: Shard, meta: dict) -> np.ndarray:
    """Start offsets of the shard's documents and its end: (documents + 1,) int64, increasing,
    from 0 to ``shard.tokens``; checked against the shard."""
    if shard.index is None:
        raise DataError(
            f"{shard.path} has no document index: it was prepared as one text stream (--text); "
            "for document packing prepare the corpus as documents: `llm-foundry prepare --input "
            "FILES --out DIR`"
        )
    data_dir = Path(data_dir)
    with lock.sharing(data_dir):
        check_files(data_dir, meta, [shard.index.name])
        starts = open_tokens(shard.index, INDEX_DTYPE, (shard.documents or 0) + 1)
    starts = np.asarray(starts, dtype=np.int64)
    if starts[0] != 0 or starts[-1] != shard.tokens or np.any(np.diff(starts) <= 0):
        raise DataError(
            f"{shard.index} does not index {shard.path}: its starts must rise from 0 to the "
            f"shard's {shard.tokens:,} tokens; prepare the corpus again"
        )
    return starts
