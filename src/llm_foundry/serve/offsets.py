"""Where each generated token starts in a completion's text: the ``logprobs.text_offset`` of
OpenAI's (legacy) completions, whole or streamed.

    text_offsets(decode, ids, text) -> [offset per token]
    StreamedOffsets(decode).chunk(piece, records) / .end() -> (records, offsets) to send

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
whole or streamed. Cost: one decode per token, as the engine's own streaming makes.
"""

from __future__ import annotations

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
    decode: Decode, ids: list[int], text: str | None = None, first: int = 0, floor: int = 0
) -> list[int]:
    """The offsets of ``ids[first:]`` (a completion's token ids; ``ids[:first]`` those sent
    before, the last at ``floor``): token j starts where ``decode(ids[:j])`` stops agreeing with
    the final text, ``decode(ids)`` less a trailing U+FFFD (bytes of a character to come), and
    at most at the end of ``text``, the returned text (a stop string may have cut it; None: the
    final text)."""
    final = decode(ids).rstrip(UNFINISHED)
    end = len(final) if text is None else len(text)
    out, at = [], floor
    for j in range(first, len(ids)):
        at = max(at, common_prefix(decode(ids[:j]), final))
        out.append(min(at, end))
    return out


class StreamedOffsets:
    """A streamed completion's offsets, chunk by chunk, equal to the whole completion's. A
    chunk sends the records (token, ...) of the tokens that start within the text sent so far;
    the others wait: for the text a stop string holds back, or for ``end`` (tokens past a stop
    string, which start at the text's end)."""

    def __init__(self, decode: Decode):
        self.decode = decode
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
