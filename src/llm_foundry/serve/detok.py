"""A reply's text as its tokens come, in time that grows with the new tokens, not the reply.

    d = Utf8Text(token_bytes) | WindowText(decode)
    d.add(token) -> str     text that is final now (it never changes again)
    d.unsettled() -> str    the text after it so far, still open: U+FFFD for a character to come
    d.end() -> str          the rest once no token follows (given once)

So at every step ``final pieces joined + unsettled()`` is the text of the tokens so far, and at
the end ``pieces + end()`` the reply's text: what decoding the whole reply per token gives,
without the quadratic cost (an 8,000-token reply: benchmarks/README.md, bench_detok).

``Utf8Text``: where the text is the UTF-8 (errors replaced) of the tokens' bytes joined (a
byte-level BPE, a character tokenizer: ``Pieces.joined``), one incremental UTF-8 decoder; exact.

``WindowText``: any other decoder (a sentencepiece one strips the first space, byte-fallback
tokens join into characters): the new text is read from a short window of tokens, the text of
``ids[start:]`` less that of ``ids[start:read]``, and the window moves on once the text it
adds is whole characters. The window begins a token or more back, so a decoder that treats a
first token apart (a stripped space) treats the window's first token so on both sides. The
prefix/read-offset scheme of text-generation-inference and vLLM's detokenizers; exact wherever
a token changes no text more than a window back (tests/test_serve_detok.py checks it against
whole decodes for the decoders the project imports). Two things it is told:

    context   the prompt's last tokens: the reply's text is what it adds to the prompt's text
              (as ``generate`` and HF's text-generation pipeline slice it), so a reply whose
              first token begins with a sentencepiece space keeps it
    held      byte-fallback tokens (``<0xE4>``): HF's ByteFallback decodes a run of them
              together, each byte a U+FFFD where the run is not UTF-8, so a byte's text (an
              ASCII one's too) is final only once a token that is not a byte ends the run
"""

from __future__ import annotations

import codecs
from collections.abc import Callable

from llm_foundry.stops import UNFINISHED


class Utf8Text:
    """The text of tokens whose bytes, joined, are its UTF-8 (``token_bytes(id)``)."""

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self.token_bytes = token_bytes
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token: int) -> str:
        return self.decoder.decode(self.token_bytes(token))

    def unsettled(self) -> str:
        # the bytes held begin a character: decoded as an end, what a whole decode shows
        return self.decoder.getstate()[0].decode("utf-8", "replace")

    def end(self) -> str:
        return self.decoder.decode(b"", final=True)


CONTEXT = 4  # prompt tokens a reply's window begins with


class WindowText:
    """The text of tokens under any ``decode(ids) -> str``, read through a moving window, after
    ``context`` (a prompt's tokens); ``held``: byte-fallback tokens, whose text waits for the
    end of their run."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        context: list[int] | tuple = (),
        held: frozenset[int] = frozenset(),
    ):
        self.decode, self.held = decode, held
        self.ids: list[int] = list(context[-CONTEXT:])
        self.start = 0  # the window's first token
        self.read = len(self.ids)  # tokens whose text was given as final (the context's)
        self.known = len(decode(self.ids)) if self.ids else 0  # len(decode(ids[start:read]))
        self.open = ""  # the window's text past ``known`` while it is not final

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.decode(self.ids[self.start :])
        if len(text) <= self.known or text.endswith(UNFINISHED) or token in self.held:
            self.open = text[self.known :]
            return ""
        new = text[self.known :]
        self.start, self.read = self.read, len(self.ids)
        self.known = len(self.decode(self.ids[self.start : self.read]))
        self.open = ""
        return new

    def unsettled(self) -> str:
        return self.open

    def end(self) -> str:
        rest, self.open = self.open, ""
        return rest
