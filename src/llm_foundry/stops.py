"""Stop strings over text that grows one token at a time: how much of it is final.

    settle(text, stops, final=False, released=0) -> (end, stopped)

``text[:end]`` may be shown now; ``stopped``: a stop string starts at ``end`` (the text ends
there). Until the last token, two kinds of trailing text are held back:

    unfinished   trailing U+FFFD: a byte-level token holding the first bytes of a character
                 decodes to it, and what that character is, is not known yet
    a stop's     the longest end of the text before them that begins a stop string the next
    start        characters may complete

The start of a stop string is looked for in the text without its trailing U+FFFD: "! 世" with
世's bytes split over two tokens reads "! \ufffd" in between, and "! " must wait for 世. So the
text shown never holds the start of the stop string that ends it: shown piece by piece, it is
the text cut at the stop string. A genuine U+FFFD (an invalid byte) is shown once a character
follows it, or at the end.
"""

from __future__ import annotations

from collections.abc import Iterable

UNFINISHED = "\ufffd"  # what a decoder gives for the bytes of a character still to come


def stop_prefix(text: str, stop: str) -> int:
    """The largest k < len(stop) with ``text`` ending in ``stop[:k]`` (0: none). Only the k whose
    last character is the text's last one are compared."""
    if not text:
        return 0
    k = min(len(stop) - 1, len(text))
    while (i := stop.rfind(text[-1], 0, k)) >= 0:
        if text.endswith(stop[: i + 1]):
            return i + 1
        k = i
    return 0


def settle(
    text: str, stops: Iterable[str], final: bool = False, released: int = 0
) -> tuple[int, bool]:
    """(end, stopped) for ``text`` so far: ``text[:end]`` is final, and ``stopped`` when a stop
    string starts at ``end``. ``final``: no token follows (nothing is held back). ``released``:
    characters already shown, settled before: a stop string is looked for where it could end
    past them."""
    stops = tuple(stops)
    known = text if final else text.rstrip(UNFINISHED)  # a character to come ends no stop
    end = len(text)
    for stop in stops:
        at = known.find(stop, max(0, released - len(stop) + 1))
        if at != -1 and at < end:
            end = at
    if end < len(text):
        return end, True
    if final:
        return end, False
    return len(known) - max((stop_prefix(known, s) for s in stops), default=0), False
