"""Small prepared directories in ``data/shards.py``'s layout, written here with numpy and a
meta.json (not by ``prepare``), for the tests of what reads them: the loader and the trainer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from llm_foundry.data.batches import file_entry
from llm_foundry.data.shards import INDEX_DTYPE, index_name, shard_name
from llm_foundry.tokenizer import CharTokenizer


def write_sharded(
    out: Path,
    train: list[list],
    val: list[list],
    *,
    vocab_size: int,
    tokenizer: CharTokenizer | None = None,
    eos_id: int = 0,
    dtype: str = "uint16",
) -> Path:
    """``out`` as ``prepare`` lays out a sharded corpus: ``train``/``val`` are lists of shards,
    each a list of documents (sequences of ids, each ending with ``eos_id``); every shard with
    its .idx, listed in meta.json with every file's size and check digest."""
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or CharTokenizer("".join(chr(0x100 + i) for i in range(vocab_size)))
    tok.save(out / "tokenizer.json")
    files, shards = {"tokenizer.json": file_entry(out / "tokenizer.json")}, {}
    digest = hashlib.sha256()
    for split, listed in (("train", train), ("val", val)):
        shards[split] = []
        for i, docs in enumerate(listed):
            name, index = shard_name(split, i), index_name(shard_name(split, i))
            tokens = np.concatenate([np.asarray(d) for d in docs]).astype(dtype)
            starts = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(INDEX_DTYPE)
            tokens.tofile(out / name)
            starts.tofile(out / index)
            digest.update(tokens.tobytes())
            files[name], files[index] = file_entry(out / name), file_entry(out / index)
            entry = {"file": name, "tokens": len(tokens), "documents": len(docs), "index": index}
            shards[split].append(entry)
    meta = {
        "sha256": digest.hexdigest(),
        "tokenizer": tok.kind,
        "tokenizer_file": "tokenizer.json",
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "dtype": dtype,
        "shards": shards,
        "files": files,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return out


def text_documents(text: str, tokenizer: CharTokenizer, lines: int = 4) -> list[list[int]]:
    """``text`` as documents of consecutive lines, each ending at a blank line or after
    ``lines`` lines, its last id (the newline's) standing for the end-of-text id."""
    docs, doc = [], []
    for line in text.splitlines(keepends=True):
        if line.strip():
            doc.append(line)
        if doc and (not line.strip() or len(doc) == lines):
            docs.append(doc)
            doc = []
    docs += [doc] if doc else []
    return [tokenizer.encode("".join(d).rstrip("\n") + "\n") for d in docs]


def shard_documents(docs: list, n: int) -> list[list]:
    """``docs`` cut into ``n`` shards of consecutive documents (as even as they go)."""
    edges = np.linspace(0, len(docs), n + 1).astype(int)
    return [docs[a:b] for a, b in zip(edges[:-1], edges[1:], strict=True)]


def sharded_text(out: Path, text: str, train_shards: int = 3, val_shards: int = 2) -> Path:
    """``text`` as a sharded character-level corpus: its documents (``text_documents``), the
    last tenth of them validation."""
    tok = CharTokenizer.train(text)
    docs = text_documents(text, tok)
    n_val = max(val_shards, len(docs) // 10)
    train, val = docs[:-n_val], docs[-n_val:]
    return write_sharded(out, shard_documents(train, train_shards),
                         shard_documents(val, val_shards), vocab_size=tok.vocab_size,
                         tokenizer=tok, eos_id=tok.encode("\n")[0])  # fmt: skip
