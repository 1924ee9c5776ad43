"""Reading prepared data: ``meta.json`` (its one reader), the memmapped token splits, and
``BatchSampler``, which reads random windows of ``block_size + 1`` tokens from them.

``meta.json`` lists the files written with it (``"files"``: each one's size and ``file_check``
digest); a file that does not match, left by an interrupted or concurrent ``prepare`` or copied
in from elsewhere, is refused. While token files are mapped, the directory is shared with
``llm_foundry.lock`` so that ``prepare`` refuses to replace them under a running training.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shlex
import weakref
from pathlib import Path

import numpy as np
import torch

from llm_foundry import lock
from llm_foundry.data.sources import DataError
from llm_foundry.messages import first_few, shown
from llm_foundry.tokenizer import json_type

log = logging.getLogger(__name__)

SPLITS = ("train", "val")
IGNORE = -100  # the target of positions that do not count (the model's ignore_index)


def load_meta(data_dir: str | Path) -> dict:
    """``data_dir/meta.json``, with errors that say how to create it."""
    data_dir = Path(data_dir)
    if data_dir.is_file():
        raise DataError(f"data directory {data_dir} {not_prepared(data_dir)}")
    if not data_dir.is_dir():
        raise DataError(
            f"data directory {data_dir} does not exist; create it with `llm-foundry prepare`"
        )
    path = data_dir / "meta.json"
    if not path.is_file():
        raise DataError(
            f"{path} is missing: {data_dir} was not written by `llm-foundry prepare` or the run "
            "was interrupted; run `llm-foundry prepare` again"
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(
            f"{path} is not valid JSON ({e}); run `llm-foundry prepare` again"
        ) from None
    if not isinstance(meta, dict):
        raise DataError(
            f"{path} holds {json_type(meta)}, not an object; run `llm-foundry prepare` again"
        )
    missing = [k for k in ("dtype", "vocab_size") if k not in meta]
    if missing:
        raise DataError(f"{path} lacks {missing}; run `llm-foundry prepare` again")
    return meta


def not_prepared(path: Path) -> str:
    """What to say of a file given where a directory ``prepare`` wrote was expected."""
    from llm_foundry.data.corpus import file_format

    if path.suffix == ".bin" and (path.parent / "meta.json").is_file():
        return f"is one of the token files of {path.parent}: give that directory"
    from llm_foundry.data.rows import rows_advice

    if path.suffix == ".jsonl" and (rows := rows_advice(path)):
        return rows
    if file_format(path) is None:
        return "is a file, not a directory `llm-foundry prepare` wrote (one holding meta.json)"
    return (
        "is a file, not a directory `llm-foundry prepare` wrote; make one from it with "
        f"`llm-foundry prepare --input {shlex.quote(str(path))} --out DIR`"
    )


# what a prepared directory holds, by meta.json's "kind" (a text stream has none)
PREPARED_KINDS = {
    None: "a text stream (train.bin/val.bin, no kind)",
    "documents": "a document corpus (kind 'documents')",
    "sft": "fine-tuning rows (kind 'sft')",
    "preference": "preference pairs (kind 'preference')",
}


def prepared_kind(meta: dict) -> str:
    """What a prepared directory holds, in words, from its meta.json."""
    kind = meta.get("kind")
    if isinstance(kind, str | None) and kind in PREPARED_KINDS:
        return PREPARED_KINDS[kind]
    return f"data of kind {shown(kind)}"


def tokenizer_sha256(data_dir: str | Path, meta: dict) -> str | None:
    """sha256 of a prepared directory's tokenizer file (None: it has none)."""
    tok = Path(data_dir) / meta.get("tokenizer_file", "tokenizer.json")
    return hashlib.sha256(tok.read_bytes()).hexdigest() if tok.is_file() else None


def data_fingerprint(data_dir: str | Path) -> dict:
    """What identifies a prepared corpus: the text's sha256, its tokenizer file's sha256 and the
    split; a sharded one (``data.shards``) also its shards' token counts and check digests
    (``shards_sha256``). Two directories with equal fingerprints give a model the same batches."""
    data_dir = Path(data_dir)
    meta = load_meta(data_dir)
    found = {
        "text_sha256": meta.get("sha256"),
        "tokenizer_sha256": tokenizer_sha256(data_dir, meta),
        "vocab_size": meta["vocab_size"],
        "train_tokens": meta.get("train_tokens"),
        "val_tokens": meta.get("val_tokens"),
    }
    shards = meta.get("shards")
    if isinstance(shards, dict):  # sharded (data.shards): the shards' tokens and check digests
        files = meta.get("files") if isinstance(meta.get("files"), dict) else {}
        listed = {
            split: [
                [e.get("file"), e.get("tokens"), (files.get(e.get("file")) or {}).get("check")]
                for e in entries if isinstance(e, dict)
            ]
            for split, entries in sorted(shards.items()) if isinstance(entries, list)
        }  # fmt: skip
        for split in SPLITS:
            if found[f"{split}_tokens"] is None and split in listed:
                found[f"{split}_tokens"] = sum(t for _, t, _ in listed[split] if isinstance(t, int))
        found["shards_sha256"] = hashlib.sha256(
            json.dumps(listed, sort_keys=True).encode()
        ).hexdigest()
    return found


CHECK_BLOCKS = 64  # blocks of a file read by file_check
CHECK_BLOCK_BYTES = 1 << 20


def file_check(path: str | Path) -> str:
    """A digest that tells a file from any other a ``prepare`` could leave in its place: sha256
    of its size and of ``CHECK_BLOCKS`` blocks of ``CHECK_BLOCK_BYTES`` spread evenly over it
    (the whole file up to 64 MiB), so that checking a large corpus costs a few reads."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if size <= CHECK_BLOCKS * CHECK_BLOCK_BYTES:
            while block := f.read(CHECK_BLOCK_BYTES):
                digest.update(block)
        else:
            step = (size - CHECK_BLOCK_BYTES) // (CHECK_BLOCKS - 1)
            for k in range(CHECK_BLOCKS):
                f.seek(k * step)
                digest.update(f.read(CHECK_BLOCK_BYTES))
    return digest.hexdigest()


def file_entry(path: str | Path) -> dict:
    """What meta.json's ``"files"`` records of a file written with it."""
    return {"bytes": Path(path).stat().st_size, "check": file_check(path)}


_checked: dict[tuple, str] = {}  # (path, inode, size, mtime) -> its file_check, in this process


def check_files(data_dir: str | Path, meta: dict, names: list[str]) -> None:
    """Refuse the files ``names`` of ``data_dir`` unless each is the one meta.json records (its
    size and ``file_check``); a meta.json from before ``"files"`` was recorded checks nothing."""
    data_dir = Path(data_dir)
    files = meta.get("files")
    if not isinstance(files, dict):
        return
    for name in names:
        want, path = files.get(name), data_dir / name
        if not isinstance(want, dict) or not path.is_file():
            continue  # a missing file is reported by whoever opens it
        st = path.stat()
        if st.st_size != want.get("bytes"):
            raise DataError(
                f"{path} has {st.st_size:,} bytes; {data_dir / 'meta.json'} records "
                f"{want.get('bytes')!r}: the file is from another or an interrupted `prepare`; "
                "run `llm-foundry prepare` again"
            )
        key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in _checked:
            _checked[key] = file_check(path)
        if _checked[key] != want.get("check"):
            raise DataError(
                f"{path} is not the file {data_dir / 'meta.json'} records (its contents differ): "
                "it is from another or an interrupted `prepare`; run `llm-foundry prepare` again"
            )


def load_split(data_dir: str | Path, split: str) -> np.memmap:
    """The ``split`` ("train" or "val") token stream: a read-only memmap of shape (n_tokens,)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    data_dir = Path(data_dir)
    with lock.sharing(data_dir):  # no prepare may publish between reading meta.json and mapping
        meta = load_meta(data_dir)
        check_files(data_dir, meta, [f"{split}.bin", meta.get("tokenizer_file", "tokenizer.json")])
        return open_tokens(data_dir / f"{split}.bin", meta["dtype"], meta.get(f"{split}_tokens"))


def open_tokens(path: str | Path, dtype: str | np.dtype, expected: int | None = None) -> np.memmap:
    """Memory-map a ``.bin`` token file read-only, checking it exists, is non-empty and whole.
    Its directory is shared (``lock.share``) for as long as the map lives: ``prepare`` is
    refused it meanwhile."""
    path, dtype = Path(path), np.dtype(dtype)
    if not path.is_file():
        raise DataError(f"token file {path} is missing; run `llm-foundry prepare` again")
    size = path.stat().st_size
    if size == 0:  # numpy cannot map an empty file
        raise DataError(f"token file {path} is empty (0 tokens); run `llm-foundry prepare` again")
    if size % dtype.itemsize or (expected is not None and size // dtype.itemsize != expected):
        raise DataError(
            f"token file {path} has {size:,} bytes ({size / dtype.itemsize:,.1f} {dtype.name} "
            f"tokens); meta.json expects {expected} tokens: the file is truncated or from another "
            "run; run `llm-foundry prepare` again"
        )
    lock.share(path.parent)
    try:
        tokens = np.memmap(path, dtype=dtype, mode="r")
    except BaseException:
        lock.unshare(path.parent)
        raise
    weakref.finalize(tokens, lock.unshare, path.parent.resolve())  # cwd may change meanwhile
    return tokens


# ----------------------------------------------------------------------------------------------
# Batches


class Windows:
    """The windows of ``block_size + 1`` tokens inside one or several token arrays (the shards of
    a split), numbered 0 .. ``count`` - 1 through a cumulative table: shard 0's starts first, then
    shard 1's, ... A window never crosses from one array into the next; an array shorter than a
    window holds none (``unused``: their names and lengths; ``note``: the line that says so, or
    None; logged when ``main_rank``, so that torchrun's ranks say it once). With one array,
    window ``g`` starts at token ``g``."""

    def __init__(self, arrays: list[np.ndarray], block_size: int, name: str,
                 main_rank: bool = True):  # fmt: skip
        self.arrays, self.block_size = arrays, block_size
        starts = np.array([max(len(a) - block_size, 0) for a in arrays], dtype=np.int64)
        self.ends = np.cumsum(starts)  # window numbers below ends[i]: arrays 0..i
        self.first = self.ends - starts  # the first window number of each array
        self.count = int(self.ends[-1]) if len(arrays) else 0
        if self.count == 0:
            n = max((len(a) for a in arrays), default=0)
            where = name if len(arrays) == 1 else f"{name} (longest of {len(arrays)} shards)"
            raise DataError(
                f"{where} has {n:,} tokens; one window needs block_size + 1 = "
                f"{block_size + 1:,}: use block_size <= {max(n - 1, 0):,} or more text"
            )
        self.unused = [(_array_name(a, k), len(a)) for k, a in enumerate(arrays)
                       if len(a) <= block_size]  # fmt: skip
        self.note = unused_note(self.unused, block_size, name)
        if self.note and main_rank:
            log.warning(self.note)
        self._window = np.arange(block_size + 1)

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(array, offset in it) of the windows numbered ``g``."""
        shard = np.searchsorted(self.ends, g, side="right")
        return shard, g - self.first[shard]

    def read(self, g: np.ndarray) -> np.ndarray:
        """The windows numbered ``g`` (n,): (n, block_size + 1) int64."""
        if len(self.arrays) == 1:
            return np.array(self.arrays[0][g[:, None] + self._window], dtype=np.int64)
        shard, offset = self.locate(g)
        out = np.empty((len(g), self.block_size + 1), dtype=np.int64)
        for k in np.unique(shard):
            rows = shard == k
            out[rows] = self.arrays[k][offset[rows][:, None] + self._window]
        return out


def _array_name(array: np.ndarray, k: int) -> str:
    """A token array's file name (a memmapped shard), else its place in the list."""
    filename = getattr(array, "filename", None)
    return Path(filename).name if filename else f"array {k}"


def unused_note(unused: list[tuple[str, int]], block_size: int, name: str) -> str | None:
    """One line naming the arrays too short to hold a window (never sampled), or None."""
    if not unused:
        return None
    window = f"a window of block_size + 1 = {block_size + 1:,} tokens"
    if len(unused) == 1:
        ((shard, n),) = unused
        what = f"shard {shard} ({n:,} tokens) is"
    else:
        listed = first_few([f"{s} ({n:,})" for s, n in unused])
        total = sum(n for _, n in unused)
        what = f"{len(unused):,} shards ({total:,} tokens in all: {listed}) are"
    return f"note: {name}: {what} shorter than {window}, so never sampled"


class BatchSampler:
    """Random training windows: ``next()`` -> (x, y), each (batch_size, block_size) int64.

    ``y`` is ``x`` shifted left by one token (the next-token targets). ``data`` is one token
    stream or a list of them (the shards of a split): each window lies inside one, each of all
    their windows equally likely (``Windows``). Offsets come from a PCG64 generator seeded with
    ``seed``, whose state ``state_dict()`` returns as JSON data, so a resumed run draws exactly
    the batches an uninterrupted one would.

    Distributed: every rank holds the same generator; each step draws ``batch_size * world_size``
    offsets and rank r keeps ``[r * batch_size, (r + 1) * batch_size)``, so ``world_size`` ranks
    together see exactly the windows of one process with ``batch_size * world_size``.
    ``main_rank``: this process says the notes (``Windows``); pass False on torchrun's other
    ranks (``rank`` is the data-parallel rank, which tensor-parallel ranks share).
    ``llm_foundry.data.loader.Loader`` extends it to prepared directories, mixtures of them and
    packed documents.
    """

    def __init__(
        self,
        data: np.ndarray | str | Path | list[np.ndarray],
        block_size: int,
        batch_size: int,
        seed: int = 0,
        *,
        rank: int = 0,
        world_size: int = 1,
        name: str | None = None,
        main_rank: bool = True,
    ):
        self._start(block_size, batch_size, seed, rank, world_size)
        if isinstance(data, (list, tuple)):
            arrays = [_as_tokens(a)[0] for a in data]
            name = name or f"the {len(arrays)} token arrays"
        else:
            array, own = _as_tokens(data)
            arrays, name = [array], name or own
        self.windows = Windows(arrays, block_size, name, main_rank)
        self.data = arrays[0] if len(arrays) == 1 else None  # the one stream, when there is one

    def _start(self, block_size: int, batch_size: int, seed: int, rank: int, world_size: int):
        """The settings checked, and the generator seeded."""
        for what, value, low in (("block_size", block_size, 1), ("batch_size", batch_size, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{what} must be an integer >= {low}; got {value!r}")
        if not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need world_size >= 1 and 0 <= rank < world_size; got {rank=}, {world_size=}"
            )
        self.block_size, self.batch_size = block_size, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.batches = 0  # batches drawn so far (informational, saved with the state)

    def next(self) -> tuple[torch.Tensor, ...]:
        """One batch: x, y of shape (batch_size, block_size), int64, y[:, t] == x[:, t + 1]."""
        B = self.batch_size
        # high is exclusive: the last start of a shard of n tokens, n - block_size - 1, still
        # fits block_size + 1 tokens
        starts = self.rng.integers(0, self.windows.count, size=B * self.world_size)
        mine = starts[self.rank * B : (self.rank + 1) * B]  # (B,)
        w = torch.from_numpy(self.windows.read(mine))  # (B, T + 1)
        self.batches += 1
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    __next__ = next

    def __iter__(self) -> BatchSampler:
        return self

    def state_dict(self) -> dict:
        """The generator state as JSON data (128-bit integers as decimal strings)."""
        st = self.rng.bit_generator.state
        return {
            "bit_generator": st["bit_generator"],
            # strings: JSON readers outside Python lose integers above 2**53
            "state": str(st["state"]["state"]),
            "inc": str(st["state"]["inc"]),
            "has_uint32": int(st["has_uint32"]),
            "uinteger": int(st["uinteger"]),
            "batches": self.batches,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a ``state_dict()``: the next batches are those that followed it."""
        if state.get("bit_generator") != "PCG64":
            raise ValueError(
                f"sampler state is for bit generator {state.get('bit_generator')!r}; "
                "expected 'PCG64'"
            )
        self.rng.bit_generator.state = {
            "bit_generator": "PCG64",
            "state": {"state": int(state["state"]), "inc": int(state["inc"])},
            "has_uint32": int(state["has_uint32"]),
            "uinteger": int(state["uinteger"]),
        }
        self.batches = int(state.get("batches", 0))


def open_token_file(path: str | Path) -> np.memmap:
    """A token file of a prepared directory (``DIR/val.bin``, ``DIR/train_00003.bin``) mapped
    read-only with its meta.json's dtype; a path that is not one is named in a one-line error."""
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"{path} does not exist: give a directory `llm-foundry prepare` wrote, or one of its "
            "token files (.bin)"
        )
    if path.is_dir():
        raise DataError(f"{path} is a directory: give one of its token files (.bin)")
    if path.suffix != ".bin":
        raise DataError(f"{path} {not_prepared(path)}")
    meta = load_meta(path.parent)
    split = path.stem if path.stem in SPLITS else None
    expected = meta.get(f"{split}_tokens") if split else None
    return open_tokens(path, meta["dtype"], expected)


def _as_tokens(data: np.ndarray | str | Path) -> tuple[np.ndarray, str]:
    """(1-D token array, a name for error messages) from an array or a ``.bin`` path."""
    if isinstance(data, (str, Path)):
        return open_token_file(data), f"token file {data}"
    array = np.asarray(data)
    filename = getattr(data, "filename", None)
    name = f"token file {filename}" if filename else "the token array"
    if array.ndim != 1:
        raise DataError(f"{name} must be 1-D (a token stream); got shape {array.shape}")
    return (data if isinstance(data, np.memmap) else array), name


def packed_row(
    ids: np.ndarray, doc: np.ndarray, trained: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, y, doc of one packed row from its block_size + 1 tokens ``ids`` and their document
    numbers ``doc``: no position targets the next document's first token (y = IGNORE there),
    nor, given ``trained`` (whether each token is a target: SFT rows), a token that is not."""
    keep = doc[1:] == doc[:-1]
    if trained is not None:
        keep &= trained[1:]
    return ids[:-1], np.where(keep, ids[1:], IGNORE), doc[:-1]
