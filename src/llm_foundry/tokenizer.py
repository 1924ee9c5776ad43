"""Tokenizers: text <-> integer ids, each saved to (and loaded from) one JSON file.

- ``CharTokenizer``: one id per character of the training corpus, the sorted set of its characters
  (nanoGPT's ``shakespeare_char``: 65 symbols for tiny Shakespeare). No special tokens.
- ``BPETokenizer``: byte-level BPE (GPT-2's scheme) trained with Hugging Face ``tokenizers``.
  Its 256-byte base alphabet makes any Unicode string encodable and decodable exactly; special
  tokens ``<bos>``, ``<eos>``, ``<pad>`` take ids 0, 1, 2. The saved file *is* a Hugging Face
  ``tokenizer.json``, so ``tokenizers.Tokenizer.from_file`` and ``transformers`` read it too.

``load_tokenizer(path)`` reads either kind back; ``build_tokenizer(kind, texts)`` trains one.
"""

from __future__ import annotations

import json
import numbers
import warnings
from collections.abc import Iterable
from pathlib import Path

TOKENIZER_KINDS = ("char", "bpe")
SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")
BYTE_ALPHABET = 256
DEFAULT_BPE_VOCAB = 4096


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
            raise ValueError(f"BPE tokenizer lacks the special tokens {missing}")
        self.bos_id, self.eos_id, self.pad_id = ids

    @classmethod
    def train(cls, texts: str | Iterable[str], vocab_size: int = DEFAULT_BPE_VOCAB) -> BPETokenizer:
        """Learn merges from ``texts`` until ``vocab_size`` ids (256 bytes + 3 specials + merges).

        A corpus too small to supply that many merges yields a smaller vocabulary (with a warning).
        """
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        minimum = BYTE_ALPHABET + len(SPECIAL_TOKENS)
        if not isinstance(vocab_size, numbers.Integral) or vocab_size < minimum:
            raise ValueError(
                f"BPE vocab_size must be an integer >= {minimum} (256 bytes + "
                f"{len(SPECIAL_TOKENS)} special tokens); got {vocab_size!r}"
            )
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=int(vocab_size),
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator([texts] if isinstance(texts, str) else texts, trainer=trainer)
        got = hf.get_vocab_size()
        if got < vocab_size:
            warnings.warn(
                f"BPE training stopped at {got} ids (asked for {vocab_size}): the corpus has no "
                "more pairs to merge",
                stacklevel=2,
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
    """Read a tokenizer saved by ``save``: a char JSON or a Hugging Face BPE ``tokenizer.json``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"tokenizer file {path} is not valid JSON: {e}") from None
    if isinstance(data, dict) and data.get("type") == "char":
        return CharTokenizer(data["chars"])
    model = data.get("model") if isinstance(data, dict) else None
    if isinstance(model, dict) and model.get("type") == "BPE":
        from tokenizers import Tokenizer as HFTokenizer

        return BPETokenizer(HFTokenizer.from_file(str(path)))
    found = sorted(data) if isinstance(data, dict) else type(data).__name__
    raise ValueError(
        f"tokenizer file {path} is neither a char tokenizer ({{'type': 'char', ...}}) nor a "
        f"Hugging Face BPE tokenizer.json (model.type == 'BPE'); top-level keys: {found}"
    )
