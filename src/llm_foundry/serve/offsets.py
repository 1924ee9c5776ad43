"""Where each generated token starts in a completion's text: the ``logprobs.text_offset`` of
OpenAI's (legacy) completions, whole or streamed.

    text_offsets(decode, ids, text, token_bytes=None) -> [offset per token]
    StreamedOffsets(decode, token_bytes=None).chunk(piece, records) / .end() -> (records, offsets)

Definition: ``text_offset[i]`` is the character offset in the returned text where token i's
contribution starts: decoding the tokens cumulatively, the first character that the tokens
before it do not yet give as final text. A byte-level token holding the first bytes of a
character (alone it decodes to U+FFFD) contributes nothing yet; it starts, as the token that
completes the character does, at that character. So the offsets never decrease, lie in
[0, len(text)], and ``text[offset[i]:offset[i + 1]]`` (the last to the end) joined give the text
back. Tokens past a stop string, whose text is cut, start at the text's end.

vLLM adds up the lengths of each token's own decoded string (so a piece that decodes to U+FFFD
moves every later offset), llama-cpp-python (its PR #1037) the length of the completion
detokenized up to each token: where pieces and prefixes decode cleanly, all three agree.
Measuring each prefix against the final text, as here, keeps the offsets exact for any decoder
(pieces that decode to U+FFFD or to nothing, decoders that change earlier text), and the same
whole or streamed. Cost: one decode of the prefix per token, quadratic in the reply's length.

Where the decoder is the UTF-8 (errors replaced) of the tokens' bytes joined (``token_bytes``
given: a byte-level BPE, a character tokenizer), the same offsets come in linear time from one
incremental UTF-8 decoder: the prefix before token j decodes to the characters the decoder has
given so far, then the bytes it holds decoded as an end (one U+FFFD for a character to come,
more where they are already invalid: ED A3 is two) (``Joined``).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable

from llm_foundry.stops import UNFINISHED

Decode = Callable[[list[int]], str]


def common_prefix(a: str, b: str) -> int:
    """The number of leading characters ``a`` and ``b`` share (string compares, not a loop over
    characters: a prefix's text is as long as the completion)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case: one starts the other
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid)
    return lo


def text_offsets(
    decode: Decode,
    ids: list[int],
    text: str | None = None,
    first: int = 0,
    floor: int = 0,
    token_bytes: Callable[[int], bytes] | None = None,
) -> list[int]:
    """The offsets of ``ids[first:]`` (a completion's token ids; ``ids[:first]`` those sent
    before, the last at ``floor``): token j starts where ``decode(ids[:j])`` stops agreeing with
    the final text, ``decode(ids)`` less a trailing U+FFFD (bytes of a character to come), and
    at most at the end of ``text``, the returned text (a stop string may have cut it; None: the
    final text). ``token_bytes``: each token's bytes, where ``decode`` joins them (linear)."""
    if token_bytes is not None:
        joined = Joined(token_bytes)
        joined.add(ids)
        return joined.offsets(None if text is None else len(text), first, floor)
    final = decode(ids).rstrip(UNFINISHED)
    end = len(final) if text is None else len(text)
    out, at = [], floor
    for j in range(first, len(ids)):
        at = max(at, common_prefix(decode(ids[:j]), final))
        out.append(min(at, end))
    return out


class Joined:
    """``text_offsets`` where ``decode(ids)`` is the UTF-8 of the tokens' bytes joined, errors
    replaced (each invalid or cut sequence one U+FFFD), kept as tokens come: per token, the
    characters decoded before it and how many U+FFFD the bytes held then make at an end."""

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self.token_bytes = token_bytes
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.starts: list[tuple[int, int]] = []
        self.length = 0  # characters decoded so far
        self.trailing = 0  # how many of them at the end are U+FFFD
        self.replaced: set[int] = set()  # where U+FFFD stands among them

    def add(self, ids: list[int]) -> None:
        for i in ids:
            held = self.decoder.getstate()[0]
            self.starts.append((self.length, len(held.decode("utf-8", "replace"))))
            piece = self.decoder.decode(self.token_bytes(i))
            at = piece.find(UNFINISHED)
            while at >= 0:
                self.replaced.add(self.length + at)
                at = piece.find(UNFINISHED, at + 1)
            kept = len(piece.rstrip(UNFINISHED))
            self.trailing = len(piece) - kept + (self.trailing if kept == 0 else 0)
            self.length += len(piece)

    def offsets(self, end: int | None, first: int = 0, floor: int = 0) -> list[int]:
        """The offsets of tokens ``first``.. (``text_offsets``'s ``first``, ``floor``), at most
        ``end`` (None: the final text's length)."""
        final = self.length - self.trailing  # bytes still waiting are a trailing U+FFFD too
        end = final if end is None else end
        out, at = [], floor
        for chars, held in self.starts[first:]:
            # decode(ids[:j]) is the decoded characters, then ``held`` U+FFFD: those agree with
            # the final text only where the final text has U+FFFD too
            agree = chars
            while agree < min(chars + held, final) and agree in self.replaced:
                agree += 1
            at = max(at, min(agree, final))
            out.append(min(at, end))
        return out


class StreamedOffsets:
    """A streamed completion's offsets, chunk by chunk, equal to the whole completion's. A
    chunk sends the records (token, ...) of the tokens that start within the text sent so far;
    the others wait: for the text a stop string holds back, or for ``end`` (tokens past a stop
    string, which start at the text's end)."""

    def __init__(self, decode: Decode, token_bytes: Callable[[int], bytes] | None = None):
        self.decode = decode
        self.joined = Joined(token_bytes) if token_bytes is not None else None
        self.ids: list[int] = []
        self.waiting: list = []
        self.sent = 0  # characters of text sent
        self.floor = 0  # the last offset sent

    def chunk(self, piece: str, records: list) -> tuple[list, list[int]]:
        """(records, offsets) to send with ``piece``, the text of this chunk; ``records``:
        those of the tokens generated since the last chunk."""
        self.ids += [r[0] for r in records]
        self.waiting += records
        self.sent += len(piece)
        first = len(self.ids) - len(self.waiting)
        if self.joined is not None:
            self.joined.add([r[0] for r in records])
            offsets = self.joined.offsets(None, first, self.floor)
        else:
            offsets = text_offsets(self.decode, self.ids, None, first, self.floor)
        ready = sum(1 for at in offsets if at <= self.sent)  # offsets never decrease
        return self._send(ready, offsets[:ready])

    def end(self) -> tuple[list, list[int]]:
        """(records, offsets) of the tokens still waiting when the completion ends: past the
        text (a stop string cut it), at its end."""
        return self._send(len(self.waiting), [self.sent] * len(self.waiting))

    def _send(self, n: int, offsets: list[int]) -> tuple[list, list[int]]:
        records, self.waiting = self.waiting[:n], self.waiting[n:]
        if offsets:
            self.floor = offsets[-1]
        return records, offsets
