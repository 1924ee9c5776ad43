"""What the server says of tokens: the text of a reply's ids, each token's own bytes and its name
in logprobs, read from the tokenizer's pipeline.

    text(ids)        the reply's text: special tokens (<bos>, <pad>, ...) left out, as vLLM and
                     transformers' skip_special_tokens leave them out
    token_bytes(id)  the bytes the token adds to the text: a byte-level BPE token's own bytes
                     (one byte of a character split over tokens, not U+FFFD's three), a
                     character's UTF-8, nothing for a special token; joined, they rebuild the text
    name(id)         the token in logprobs: its text alone (U+FFFD for a piece of a character),
                     a special token's own literal (so an alternative such as <eos> is named)
    joined           True where text(ids) is the UTF-8 of the tokens' bytes joined (errors
                     replaced): offsets can then be read from the bytes in linear time
    detokenizer(p)   a reply's text token by token after prompt ``p`` (``detok``): from the
                     bytes where joined, else a window of ``text`` (byte-fallback tokens held)

Decoders are told apart by a small table keyed by tokenizer.json's decoder type: "ByteLevel"
(GPT-2's byte alphabet), "Fuse" (pieces joined as they are), and the character tokenizer; any
other decoder (a sentencepiece one strips the first space, WordPiece joins with spaces) keeps
the tokenizer's own decode and the exact, general offsets.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable

from llm_foundry.serve.detok import Utf8Text, WindowText


def gpt2_bytes() -> dict[str, int]:
    """GPT-2's byte alphabet read back: symbol -> the byte it spells (``gguf.byte_symbols``)."""
    from llm_foundry.interop.gguf import byte_symbols

    return {c: b for b, c in enumerate(byte_symbols())}


def _byte_level_bytes(hf) -> Callable[[int], bytes]:
    """A ByteLevel decoder's bytes of a token: each character of its vocabulary string one byte
    of GPT-2's alphabet; a token with a character outside it (an added token's text) its own
    UTF-8, as the decoder has it."""
    byte_of = gpt2_bytes()

    def token_bytes(i: int) -> bytes:
        token = hf.id_to_token(i) or ""
        if all(c in byte_of for c in token):
            return bytes(byte_of[c] for c in token)
        return token.encode()

    return token_bytes


def _fuse_bytes(hf) -> Callable[[int], bytes]:
    """A Fuse decoder's bytes of a token: its vocabulary string as it is."""
    return lambda i: (hf.id_to_token(i) or "").encode()


BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")  # a byte-fallback token's spelling

# tokenizer.json's decoder type -> the bytes of one token, where decode joins them
JOINED = {"ByteLevel": _byte_level_bytes, "Fuse": _fuse_bytes}


class Pieces:
    """``text``, ``token_bytes``, ``name`` and ``joined`` (module docstring) for ``tok``, one
    of ``tokenizer``'s; ``tok.decode`` is looked up at each call."""

    def __init__(self, tok):
        self.tok = tok
        self.specials: frozenset[int] = frozenset()
        self._names: dict[int, str] = {}
        self._bytes: Callable[[int], bytes] | None = None
        self.byte_tokens: frozenset[int] = frozenset()  # <0xNN> tokens a ByteFallback joins
        hf = getattr(tok, "hf", None)
        if getattr(tok, "kind", "") == "char":
            self._bytes = lambda i: tok.chars[i].encode()
        elif hf is not None:
            added = hf.get_added_tokens_decoder()
            self._names = {i: t.content for i, t in added.items() if t.special}
            self.specials = frozenset(self._names)
            spec = json.loads(hf.to_str()).get("decoder") or {}
            decoder = spec.get("type")
            if decoder in JOINED:
                self._bytes = JOINED[decoder](hf)
            if "ByteFallback" in {d.get("type") for d in [spec, *spec.get("decoders", [])]}:
                self.byte_tokens = frozenset(i for t, i in hf.get_vocab().items()
                                             if BYTE_TOKEN.fullmatch(t))  # fmt: skip
        # what leaves a byte run open: its bytes, and special tokens (left out of the text, so
        # the bytes on both sides of one join into one run)
        self.held = self.byte_tokens | self.specials if self.byte_tokens else frozenset()
        self.joined = self._bytes is not None

    def text(self, ids) -> str:
        """The text of ``ids``, special tokens left out."""
        if self.specials:
            ids = [i for i in ids if i not in self.specials]
        return self.tok.decode(ids)

    def detokenizer(self, prompt: list[int] | tuple = ()) -> Utf8Text | WindowText:
        """A new reply's text as its tokens come after ``prompt`` (``detok``)."""
        if self.joined:
            return Utf8Text(self.token_bytes)
        return WindowText(self.text, prompt, self.held)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token ``i`` adds to the text (none for a special token)."""
        if i in self.specials:
            return b""
        if self._bytes is None:  # the token's text alone: exact where it is whole characters
            return self.tok.decode([i]).encode()
        return self._bytes(i)

    def name(self, i: int) -> str:
        """Token ``i`` as logprobs show it: the text it adds after an ordinary token (a
        sentencepiece token keeps its space, which decoding it alone strips)."""
        if i in self._names:
            return self._names[i]
        if self.joined or self._anchor is None:
            return self.tok.decode([i])
        return self.tok.decode([self._anchor, i])[len(self.tok.decode([self._anchor])) :]

    @functools.cached_property
    def _anchor(self) -> int | None:
        """An ordinary token (not special, not a byte) whose text is not empty."""
        ordinary = (i for i in range(self.tok.vocab_size)
                    if i not in self.specials and i not in self.held)  # fmt: skip
        return next((i for i in ordinary if self.tok.decode([i])), None)
