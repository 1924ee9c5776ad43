"""Reading prepared data: ``meta.json`` (its one reader), the memmapped token splits, and
``BatchSampler``, which reads random windows of ``block_size + 1`` tokens from them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from llm_foundry.data.sources import DataError

SPLITS = ("train", "val")


def load_meta(data_dir: str | Path) -> dict:
    """``data_dir/meta.json``, with errors that say how to create it."""
    data_dir = Path(data_dir)
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
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path} is not valid JSON ({e}); run `llm-foundry prepare` again"
        ) from None
    missing = [k for k in ("dtype", "vocab_size") if k not in meta]
    if missing:
        raise DataError(f"{path} lacks {missing}; run `llm-foundry prepare` again")
    return meta


def data_fingerprint(data_dir: str | Path) -> dict:
    """What identifies a prepared corpus: the text's sha256, its tokenizer file's sha256 and the
    split. Two directories with equal fingerprints give a model the same batches."""
    data_dir = Path(data_dir)
    meta = load_meta(data_dir)
    tok = data_dir / meta.get("tokenizer_file", "tokenizer.json")
    return {
        "text_sha256": meta.get("sha256"),
        "tokenizer_sha256": hashlib.sha256(tok.read_bytes()).hexdigest() if tok.is_file() else None,
        "vocab_size": meta["vocab_size"],
        "train_tokens": meta.get("train_tokens"),
        "val_tokens": meta.get("val_tokens"),
    }


def load_split(data_dir: str | Path, split: str) -> np.memmap:
    """The ``split`` ("train" or "val") token stream: a read-only memmap of shape (n_tokens,)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    data_dir = Path(data_dir)
    meta = load_meta(data_dir)
    return open_tokens(data_dir / f"{split}.bin", meta["dtype"], meta.get(f"{split}_tokens"))


def open_tokens(path: str | Path, dtype: str | np.dtype, expected: int | None = None) -> np.memmap:
    """Memory-map a ``.bin`` token file read-only, checking it exists, is non-empty and whole."""
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
    return np.memmap(path, dtype=dtype, mode="r")


# ----------------------------------------------------------------------------------------------
# Batches


class BatchSampler:
    """Random training windows: ``next()`` -> (x, y), each (batch_size, block_size) int64.

    ``y`` is ``x`` shifted left by one token (the next-token targets). Offsets come from a PCG64
    generator seeded with ``seed``, whose state ``state_dict()`` returns as JSON data, so a resumed
    run draws exactly the batches an uninterrupted one would.

    Distributed: every rank holds the same generator; each step draws ``batch_size * world_size``
    offsets and rank r keeps ``[r * batch_size, (r + 1) * batch_size)``, so ``world_size`` ranks
    together see exactly the windows of one process with ``batch_size * world_size``.
    """

    def __init__(
        self,
        data: np.ndarray | str | Path,
        block_size: int,
        batch_size: int,
        seed: int = 0,
        *,
        rank: int = 0,
        world_size: int = 1,
    ):
        for name, value, low in (("block_size", block_size, 1), ("batch_size", batch_size, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
        if not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need world_size >= 1 and 0 <= rank < world_size; got {rank=}, {world_size=}"
            )
        self.data, name = _as_tokens(data)
        n = len(self.data)
        if n < block_size + 1:
            raise DataError(
                f"{name} has {n:,} tokens; one window needs block_size + 1 = "
                f"{block_size + 1:,}: use block_size <= {max(n - 1, 0):,} or more text"
            )
        self.block_size, self.batch_size = block_size, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.batches = 0  # batches drawn so far (informational, saved with the state)
        self._window = np.arange(block_size + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch: x, y of shape (batch_size, block_size), int64, y[:, t] == x[:, t + 1]."""
        B = self.batch_size
        # high is exclusive: the last start, n - block_size - 1, still fits block_size + 1 tokens
        starts = self.rng.integers(0, len(self.data) - self.block_size, size=B * self.world_size)
        mine = starts[self.rank * B : (self.rank + 1) * B]  # (B,)
        windows = np.array(self.data[mine[:, None] + self._window], dtype=np.int64)  # (B, T+1)
        w = torch.from_numpy(windows)
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


def _as_tokens(data: np.ndarray | str | Path) -> tuple[np.ndarray, str]:
    """(1-D token array, a name for error messages) from an array or a ``.bin`` path."""
    if isinstance(data, (str, Path)):
        path = Path(data)
        meta = load_meta(path.parent)
        split = path.stem if path.stem in SPLITS else None
        expected = meta.get(f"{split}_tokens") if split else None
        return open_tokens(path, meta["dtype"], expected), f"token file {path}"
    array = np.asarray(data)
    filename = getattr(data, "filename", None)
    name = f"token file {filename}" if filename else "the token array"
    if array.ndim != 1:
        raise DataError(f"{name} must be 1-D (a token stream); got shape {array.shape}")
    return (data if isinstance(data, np.memmap) else array), name
