"""Tokenizers: text <-> integer ids, each saved to (and loaded from) one JSON file.

- ``CharTokenizer``: one id per character of the training corpus, the sorted set of its characters
  (nanoGPT's ``shakespeare_char``: 65 symbols for tiny Shakespeare). No special tokens. Saved as
  ``{"type": "char", "chars": ...}``; ``to_hf`` gives the same tokenizer as a Hugging Face
  ``tokenizers`` one (what an HF export carries), which ``load_tokenizer`` reads back as a
  ``CharTokenizer``.
- ``BPETokenizer``: byte-level BPE (GPT-2's scheme) trained with Hugging Face ``tokenizers``.
  Its 256-byte base alphabet makes any Unicode string encodable and decodable exactly; special
  tokens ``<bos>``, ``<eos>``, ``<pad>`` take ids 0, 1, 2; ``<eos>`` is also the end of text that
  ends every document of a prepared corpus. A tokenizer trained for a document corpus
  (``chat_tokens=True``) reserves the chat markers ``CHAT_TOKENS`` as ids 3 and 4, so that a
  model pretrained with it can later be tuned on chats without growing its vocabulary. The saved
  file *is* a Hugging Face ``tokenizer.json``, so ``tokenizers.Tokenizer.from_file`` and
  ``transformers`` read it too.

``load_tokenizer(path)`` reads either kind back; ``build_tokenizer(kind, texts)`` trains one.
"""

from __future__ import annotations

import json
import logging
import numbers
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

TOKENIZER_KINDS = ("char", "bpe")
SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")  # every BPE tokenizer of ours has these, ids 0-2
END_OF_TEXT = "<eos>"  # what ends each document of a prepared corpus
# reserved (ChatML's markers) by tokenizers trained with chat_tokens=True: ids 3, 4; optional,
# so that tokenizers saved before them still load
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
BYTE_ALPHABET = 256
MIN_BPE_VOCAB = BYTE_ALPHABET + len(SPECIAL_TOKENS)  # every byte and the specials
DEFAULT_BPE_VOCAB = 4096

log = logging.getLogger(__name__)

# a character tokenizer's HF form: every code point its own piece (Oniguruma's "." skips "\n")
ANY_CHAR = r"[\s\S]"
# WordLevel's unknown token, never in a vocabulary of single characters: an unknown one is refused
HF_CHAR_UNK = "<unk>"
# the parts of a tokenizer.json that decide what it does (not its version, padding, truncation)
HF_PIPELINE = ("added_tokens", "normalizer", "pre_tokenizer", "post_processor", "decoder", "model")


class Tokenizer:
    """What every tokenizer offers: ``encode``, ``decode``, ``vocab_size``, special ids, ``save``."""

    kind: str = ""
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def save(self, path: str | Path) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


# ----------------------------------------------------------------------------------------------
class CharTokenizer(Tokenizer):
    """Character-level: id ``i`` is the i-th character of the sorted training alphabet."""

    kind = "char"

    def __init__(self, chars: str | Iterable[str]):
        chars = "".join(chars)
        if not chars:
            raise ValueError("a character tokenizer needs at least one character; got none")
        if len(set(chars)) != len(chars) or any(len(c) != 1 for c in chars):
            raise ValueError(f"chars must be distinct single characters; got {chars!r}")
        self.chars = chars
        self._stoi = {c: i for i, c in enumerate(chars)}

    @classmethod
    def train(cls, text: str | Iterable[str]) -> CharTokenizer:
        """The vocabulary of ``text`` (a string or an iterable of strings): its sorted characters."""
        pieces = [text] if isinstance(text, str) else text
        alphabet: set[str] = set()
        for piece in pieces:
            alphabet.update(piece)
        if not alphabet:
            raise ValueError("cannot build a character vocabulary from empty text")
        return cls(sorted(alphabet))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._stoi[c] for c in text]
        except KeyError:
            pos = next(i for i, c in enumerate(text) if c not in self._stoi)
            raise ValueError(
                f"character {text[pos]!r} at position {pos} is not in the vocabulary "
                f"({self.vocab_size} characters, built from the training corpus)"
            ) from None

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        n = len(self.chars)
        if ids and not 0 <= min(ids) <= max(ids) < n:
            bad = next(i for i in ids if not 0 <= i < n)
            raise ValueError(f"token id {bad} is out of range for a vocabulary of {n} characters")
        return "".join([self.chars[i] for i in ids])

    def to_dict(self) -> dict:
        return {"type": "char", "chars": self.chars}

    def to_hf(self):
        """This tokenizer as a Hugging Face ``tokenizers.Tokenizer`` that encodes and decodes as it
        does: a WordLevel vocabulary of its characters (the same ids), a pre-tokenizer that isolates
        every code point (a Python string's items: one id per character, newlines and spaces
        included), a Fuse decoder that joins the pieces with nothing between; no normalizer, no
        special tokens. A character outside the vocabulary is refused by both (HF raises "Missing
        [UNK] token"); an id past the vocabulary is refused by ``decode``, skipped by HF's."""
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        hf = HFTokenizer(models.WordLevel(dict(self._stoi), unk_token=HF_CHAR_UNK))
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(ANY_CHAR), behavior="isolated")
        hf.decoder = decoders.Fuse()
        return hf

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), ensure_ascii=False), encoding="utf-8")


# ----------------------------------------------------------------------------------------------
class BPETokenizer(Tokenizer):
    """Byte-level BPE around a ``tokenizers.Tokenizer``; special tokens are never read from text."""

    kind = "bpe"

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        # "<eos>" written in a corpus stays text: only code can insert the special ids
        self.hf.encode_special_tokens = True
        ids = [self.hf.token_to_id(t) for t in SPECIAL_TOKENS]
        if any(i is None for i in ids):
            missing = [t for t, i in zip(SPECIAL_TOKENS, ids, strict=True) if i is None]
            raise ValueError(
                f"BPE tokenizer lacks the special tokens {missing}; expected all of "
                f"{list(SPECIAL_TOKENS)}"
            )
        self.bos_id, self.eos_id, self.pad_id = ids
        # the chat markers it reserves (none in a tokenizer trained without them)
        self.chat_ids = {t: i for t in CHAT_TOKENS if (i := self.hf.token_to_id(t)) is not None}

    @property
    def special_ids(self) -> dict[str, int]:
        """Every special token it has, by name: ``<bos>``, ``<eos>``, ``<pad>``, chat markers."""
        named = dict(zip(SPECIAL_TOKENS, (self.bos_id, self.eos_id, self.pad_id), strict=True))
        return {**named, **self.chat_ids}

    @classmethod
    def train(
        cls,
        texts: str | Iterable[str],
        vocab_size: int = DEFAULT_BPE_VOCAB,
        chat_tokens: bool = False,
    ) -> BPETokenizer:
        """Learn merges from ``texts`` until ``vocab_size`` ids (256 bytes + the specials +
        merges); ``chat_tokens``: reserve ``CHAT_TOKENS`` too (ids 3, 4).

        A corpus too small to supply that many merges yields a smaller vocabulary (with a note,
        logged as a warning). Ctrl-C and SIGTERM stop it within ``WAIT_S`` (``run_interruptibly``).
        """
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        specials = list(SPECIAL_TOKENS) + (list(CHAT_TOKENS) if chat_tokens else [])
        minimum = BYTE_ALPHABET + len(specials)
        if not isinstance(vocab_size, numbers.Integral) or vocab_size < minimum:
            raise ValueError(
                f"BPE vocab_size must be an integer >= {minimum} (256 bytes + "
                f"{len(specials)} special tokens); got {vocab_size!r}"
            )
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=int(vocab_size),
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        cancel = threading.Event()

        def until_cancelled() -> Iterator[str]:
            for text in [texts] if isinstance(texts, str) else texts:
                if cancel.is_set():  # stopped: the trainer's reading ends here, in its thread
                    raise InterruptedError("BPE training was stopped")
                yield text

        run_interruptibly(hf.train_from_iterator, until_cancelled(), trainer=trainer,
                          cancel=cancel)  # fmt: skip
        got = hf.get_vocab_size()
        if got < vocab_size:
            log.warning(
                f"note: BPE training stopped at {got:,} ids (asked for {vocab_size:,}): the "
                "corpus has no more pairs to merge"
            )
        return cls(hf)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode several strings at once (in parallel threads)."""
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        ids, n = [int(i) for i in ids], self.vocab_size
        if ids and not 0 <= min(ids) <= max(ids) < n:
            bad = next(i for i in ids if not 0 <= i < n)
            raise ValueError(f"token id {bad} is out of range for a vocabulary of {n} ids")
        return self.hf.decode(ids, skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        self.hf.save(str(path))


WAIT_S = 0.1  # how long the waiting thread sleeps at a time: a signal is answered within it


def run_interruptibly(work, *args, cancel=None, **kwargs):
    """``work(*args, **kwargs)``'s result, computed in a daemon thread while this one waits in
    joins of ``WAIT_S``, so that Ctrl-C and SIGTERM's handlers run meanwhile: a Rust call such
    as HF tokenizers' ``train_from_iterator`` holds this thread until it returns (seconds to
    hours) but lets go of the interpreter while it merges pairs, so it can run beside it. Its
    exception is raised here. Stopped so (KeyboardInterrupt), the call goes on in its thread
    until it ends or the process exits (a command exits at once: nothing is left to write);
    ``cancel`` (a ``threading.Event``) is set then, for the work to end early where it can.
    Called off the main thread (where no signal handler runs), it runs there."""
    if threading.current_thread() is not threading.main_thread():
        return work(*args, **kwargs)
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = work(*args, **kwargs)
        except BaseException as e:  # raised again in the waiting thread
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True, name=getattr(work, "__name__", "work"))
    thread.start()
    try:
        while thread.is_alive():
            thread.join(WAIT_S)
    except BaseException:
        if cancel is not None:
            cancel.set()
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


# ----------------------------------------------------------------------------------------------
def build_tokenizer(
    kind: str, texts: str | Iterable[str], vocab_size: int | None = None
) -> Tokenizer:
    """Train a tokenizer of ``kind`` ("char" or "bpe") on ``texts`` (a string or strings)."""
    if kind == "char":
        if vocab_size is not None:
            raise ValueError(
                f"the char tokenizer's vocabulary is the corpus's character set; "
                f"vocab_size must be None, got {vocab_size}"
            )
        return CharTokenizer.train(texts)
    if kind == "bpe":
        return BPETokenizer.train(
            texts, vocab_size=DEFAULT_BPE_VOCAB if vocab_size is None else vocab_size
        )
    raise ValueError(f"unknown tokenizer kind {kind!r}; valid kinds: {', '.join(TOKENIZER_KINDS)}")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Read a tokenizer saved by ``save``: a char JSON or a Hugging Face BPE ``tokenizer.json``;
    or a char tokenizer's HF ``tokenizer.json`` (``CharTokenizer.to_hf``), as a ``CharTokenizer``.

    A damaged file (empty, truncated, not UTF-8, fields missing or of the wrong type, a vocabulary
    that would drop text) raises a one-line ValueError naming the file and what was expected.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} does not exist")
    raw = path.read_bytes()
    if not raw.strip():
        raise ValueError(f"tokenizer file {path} is empty; expected {_EXPECTED}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"tokenizer file {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
            f"{e.start}); expected {_EXPECTED}"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"tokenizer file {path} is not valid JSON ({e.msg}: line {e.lineno} column "
            f"{e.colno}); expected {_EXPECTED}"
        ) from None
    if isinstance(data, dict) and data.get("type") == "char":
        return _load_char(path, data)
    model = data.get("model") if isinstance(data, dict) else None
    if isinstance(model, dict) and model.get("type") == "BPE":
        return _load_bpe(path, text, model)
    if isinstance(model, dict) and model.get("type") == "WordLevel":
        return _load_char_hf(path, data, model)
    found = (
        f"top-level keys: {sorted(data)}"
        if isinstance(data, dict)
        else f"it holds {json_type(data)}"
    )
    raise ValueError(
        f"tokenizer file {path} is neither a char tokenizer ({{'type': 'char', ...}}, or its HF "
        f"form: model.type == 'WordLevel') nor a Hugging Face BPE tokenizer.json (model.type == "
        f"'BPE'); {found}"
    )


_EXPECTED = (
    "a tokenizer saved by llm-foundry: {'type': 'char', 'chars': ...}, its HF form "
    "(CharTokenizer.to_hf) or a Hugging Face BPE tokenizer.json"
)


def json_type(value) -> str:
    """The JSON name of a parsed value's type, for messages about a file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, numbers.Number):
        return f"a number ({value!r})"
    return {str: "a string", list: "a list", dict: "an object"}.get(
        type(value), type(value).__name__
    )


def _load_char(path: Path, data: dict) -> CharTokenizer:
    """A char tokenizer from its parsed file, each malformed field named with the file."""
    where = f"tokenizer file {path} (a char tokenizer)"
    if "chars" not in data:
        raise ValueError(
            f"{where} has no 'chars'; expected 'chars': a string of distinct characters"
        )
    chars = data["chars"]
    if not isinstance(chars, str):
        raise ValueError(
            f"{where}: 'chars' is {json_type(chars)}; expected a string of distinct characters"
        )
    if not chars:
        raise ValueError(f"{where}: 'chars' is empty; expected at least one character")
    first: dict[str, int] = {}
    for i, c in enumerate(chars):
        if c in first:
            raise ValueError(
                f"{where}: 'chars' holds {c!r} twice (at {first[c]} and {i}); expected distinct "
                "characters, one id each"
            )
        first[c] = i
    return CharTokenizer(chars)


def _load_char_hf(path: Path, data: dict, model: dict) -> CharTokenizer:
    """A char tokenizer from the HF tokenizer.json ``CharTokenizer.to_hf`` writes (an HF export's),
    recognised only where the file is exactly that: another WordLevel file (its own normalizer,
    pre-tokenizer, unknown token...) is refused here and read as an HF tokenizer of its own."""
    where = f"tokenizer file {path} (a WordLevel tokenizer.json)"
    vocab = model.get("vocab")
    ids = list(vocab.values()) if isinstance(vocab, dict) else []
    if (
        not ids
        or any(isinstance(i, bool) or not isinstance(i, int) for i in ids)
        or sorted(ids) != list(range(len(ids)))
        or any(len(c) != 1 for c in vocab)
    ):
        raise ValueError(
            f"{where}: 'model.vocab' is not single characters with the ids 0..n-1; expected the "
            "file CharTokenizer.to_hf writes"
        )
    tok = CharTokenizer(sorted(vocab, key=vocab.__getitem__))
    want = json.loads(tok.to_hf().to_str())
    differ = next((k for k in HF_PIPELINE if data.get(k) != want[k]), None)
    if differ is not None:
        got, expected = (_cut(repr(v)) for v in (data.get(differ), want[differ]))
        raise ValueError(
            f"{where}: its {differ!r} is {got}, not a character tokenizer's {expected}; "
            "expected the file CharTokenizer.to_hf writes"
        )
    return tok


def _cut(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters for a one-line message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _load_bpe(path: Path, text: str, model: dict) -> BPETokenizer:
    """A BPE tokenizer from its file's text, checked for what ``BPETokenizer`` relies on: the
    special tokens, every byte in the vocabulary, and decode giving back what encode read."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import pre_tokenizers

    where = f"tokenizer file {path} (a BPE tokenizer.json)"
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        got = "missing" if "vocab" not in model else json_type(vocab)
        raise ValueError(f"{where}: 'model.vocab' is {got}; expected an object of token -> id")
    for token, i in vocab.items():
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(
                f"{where}: 'model.vocab' gives {token!r} the id {i!r}; expected ids that are "
                "integers >= 0"
            )
    merges = model.get("merges")
    if not isinstance(merges, list):
        got = "missing" if "merges" not in model else json_type(merges)
        raise ValueError(
            f"{where}: 'model.merges' is {got}; expected a list of merges (empty for a "
            "vocabulary of bytes alone)"
        )
    try:
        hf = HFTokenizer.from_str(text)
    except Exception as e:  # tokenizers raises plain Exception from Rust
        reason = " ".join(str(e).split())
        raise ValueError(
            f"{where} cannot be read by Hugging Face tokenizers ({reason}); expected a file "
            "saved by BPETokenizer.save or tokenizers.Tokenizer.save"
        ) from None
    try:
        tok = BPETokenizer(hf)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    # a byte missing from the vocabulary is silently dropped by encode (no unk token)
    missing = [b for b in pre_tokenizers.ByteLevel.alphabet() if hf.token_to_id(b) is None]
    if missing:
        raise ValueError(
            f"{where}: 'model.vocab' lacks {len(missing)} of the 256 byte-level symbols "
            f"(e.g. {sorted(missing)[0]!r}), so encode would drop text; expected a byte-level BPE "
            "vocabulary with every byte"
        )
    back = tok.decode(tok.encode(_PROBE))
    if back != _PROBE:
        raise ValueError(
            f"{where} does not give text back: {_PROBE!r} decodes as {back!r}; expected a "
            "byte-level BPE (ByteLevel pre-tokenizer and decoder, no normalizer)"
        )
    return tok


_PROBE = "Hi there,\n  café 東京 🙂 <eos>"  # spaces, a newline, 2- to 4-byte UTF-8, a special


class HFTokenizerFile:
    """A Hugging Face ``tokenizer.json`` that is not one of ours (e.g. a Llama or GPT-2 one):
    encode with the file's own special tokens (its BOS, if it adds one), decode without them."""

    kind = "hf"
    bos_id = None
    pad_id = None

    def __init__(self, hf, eos_id: int | None = None):
        self.hf = hf
        self.eos_id = eos_id

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in it (a chat template's markers) are
        read as their ids. ``add_special_tokens=False`` adds no BOS (a rendered chat has its own)."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)


def load_any_tokenizer(path: str | Path):
    """Our tokenizer file, else any Hugging Face ``tokenizer.json`` (e.g. a Llama or GPT-2 one;
    its special ids come from the files beside it: ``tokenizer_files.open_tokenizer``); a file
    that is neither is a one-line error."""
    try:
        return load_tokenizer(path)
    except ValueError as ours:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise ValueError(
                f"cannot read {path}: not an llm-foundry tokenizer ({ours}) and not a "
                f"Hugging Face tokenizers file ({e})"
            ) from None
        return HFTokenizerFile(hf)


# ----------------------------------------------------------------------------------------------
# Batch encoding, here or in worker processes (``prepare --input --workers N``): this module
# imports neither torch nor the data package, so a worker process stays small


class BatchEncoder:
    """Token ids of a batch of texts with a tokenizer.json's tokenizer: (the ids one after
    another as ``dtype``, each text's number of ids). Special tokens written in the texts are
    encoded as text."""

    def __init__(self, tokenizer_json: str, dtype: str):
        import numpy as np
        from tokenizers import Tokenizer as HFTokenizer

        self.hf = HFTokenizer.from_str(tokenizer_json)
        self.hf.encode_special_tokens = True
        self.dtype = np.dtype(dtype)
        self._batch = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)

    def __call__(self, texts: list[str]):
        import itertools

        import numpy as np

        ids = [e.ids for e in self._batch(texts, add_special_tokens=False)]
        lengths = np.array([len(x) for x in ids], dtype=np.int64)
        flat = np.fromiter(itertools.chain.from_iterable(ids), self.dtype, int(lengths.sum()))
        return flat, lengths


_worker: BatchEncoder | None = None


PARENT_CHECK_S = 1.0  # how often a worker looks whether the process it works for still runs


def start_encoding_worker(tokenizer_json: str, dtype: str, parent: int) -> None:
    """A worker process's start: its encoder; Ctrl-C left to the parent process (``parent``,
    its pid); one thread; and a watch that ends the worker once that process is gone (killed
    outright, it cannot end its workers, which would otherwise wait for work forever)."""
    import os
    import signal
    import threading
    import time

    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker = BatchEncoder(tokenizer_json, dtype)

    def watch() -> None:
        # a worker's parent is the forkserver, which ends with the process it serves (and the
        # worker is reparented): a changed parent pid means the work is gone, and unlike a pid
        # test it cannot be fooled by the pid being reused
        first = os.getppid()
        while True:
            time.sleep(PARENT_CHECK_S)
            if os.getppid() != first:
                os._exit(1)
            try:
                os.kill(parent, 0)
            except (ProcessLookupError, PermissionError):  # gone (its pid another user's now)
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def encode_in_worker(texts: list[str]):
    """``BatchEncoder(texts)`` in a worker process started by ``start_encoding_worker``."""
    return _worker(texts)
