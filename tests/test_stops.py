"""``stops.settle`` over the decodes of a real byte-level BPE, one token more each step, and over
random byte strings decoded one byte more each step: the pieces it lets out join into the text
known at the first step where a stop string appears, cut at its first stop string (``str.find``),
for every stop string cut out of the text (each starting at any character, split ones included),
for ones that only begin there and for random sets of them; never a piece that a later token
changes."""

from __future__ import annotations

import random

import pytest
from _bytes_bpe import TEXT, bytes_bpe

from llm_foundry.stops import UNFINISHED, settle, stop_prefix


@pytest.fixture(scope="module")
def tok():
    return bytes_bpe()


def _streamed(decode, ids: list[int], stops: list[str]) -> tuple[str, bool]:
    """The text shown piece by piece as each token comes (the last one final), and whether a
    stop string ended it; every piece is checked to be a part of the finished text."""
    shown = ""
    for j in range(len(ids)):
        text = decode(ids[: j + 1])
        end, stopped = settle(text, stops, final=j + 1 == len(ids), released=len(shown))
        assert end >= len(shown) and text[: len(shown)] == shown
        shown = text[:end]
        if stopped:
            return shown, True
    return shown, False


def _cut(decode, ids: list[int], stops: list[str]) -> tuple[str, bool]:
    """The reference: the text known at the first step where a stop string appears in it (the
    decode of the tokens so far, less its trailing U+FFFD unless no token follows), cut at the
    first stop string there; the whole text when no step holds one."""
    for j in range(1, len(ids) + 1):
        text = decode(ids[:j])
        known = text if j == len(ids) else text.rstrip(UNFINISHED)
        at = min((known.find(s) for s in stops if s in known), default=-1)
        if at >= 0:
            return known[:at], True
    return (decode(ids) if ids else ""), False


def _cases(text: str) -> list[list[str]]:
    """Every piece of ``text`` of 1 to 4 characters as a stop string, the same piece with a
    character it never goes on with (it begins there only), and pairs of them."""
    pieces = {text[i : i + n] for n in range(1, 5) for i in range(len(text) - n + 1)}
    cases = [[p] for p in sorted(pieces)] + [[p + "?"] for p in sorted(pieces)]
    return cases + [[a + "?", b] for a, b in zip(sorted(pieces), sorted(pieces)[::-1], strict=True)]


@pytest.mark.parametrize("text", [TEXT, "a! 世! 世界🙂🙂 x", "世"])
def test_streamed_text_is_the_finished_text_cut_at_its_first_stop(tok, text):
    ids = tok.encode(text)
    assert any(tok.decode(ids[:j]).endswith(UNFINISHED) for j in range(len(ids)))  # split
    for stops in _cases(text):
        assert _streamed(tok.decode, ids, stops) == _cut(tok.decode, ids, stops), stops


def test_a_genuine_replacement_character_is_let_out(tok):
    """An invalid byte (U+FFFD for good) in the middle, and an unfinished character at the end:
    the text comes out whole, cut only where a stop string occurs."""
    invalid = next(i for i in range(tok.vocab_size)
                   if tok.decode([i, *tok.encode("ok")]) == "\ufffdok")  # fmt: skip
    ids = [*tok.encode("a! "), invalid, *tok.encode("ok! "), tok.encode("世")[0]]
    text = tok.decode(ids)
    assert text == "a! \ufffdok! \ufffd"
    for stops in [[], ["! 世"], ["!?"], ["\ufffdok"], *_cases(text)]:
        assert _streamed(tok.decode, ids, stops) == _cut(tok.decode, ids, stops), stops


def test_stop_prefix_is_the_longest_proper_start_the_text_ends_with():
    stops = ["abab", "aaa", "世界!", "x"]
    for text in ["", "a", "ab", "aba", "abab", "zaa", "世界", "ba世", "x"]:
        for stop in stops:
            want = max(k for k in range(len(stop)) if k <= len(text) and text.endswith(stop[:k]))
            assert stop_prefix(text, stop) == want, (text, stop)


# characters whose UTF-8 bytes come one at a time (1 to 4 bytes), and an invalid byte
ALPHABET = [b"a", b"b", b" ", "\u00e9".encode(), "\u4e16".encode(), "\U0001f642".encode(), b"\xff"]


def _random_case(rng: random.Random) -> tuple[list[int], list[str]]:
    """Bytes of 1 to 8 characters, sometimes cut inside the last one; 1 to 3 stop strings: pieces
    of the finished text, and pairs of characters that may not occur in it."""
    raw = b"".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 8)))
    if rng.random() < 0.2 and raw[-1] >= 0x80:
        raw = raw[: -rng.randint(1, 2)] or raw
    text = _decode_bytes(list(raw))
    chars = [c.decode("utf-8", "replace") for c in ALPHABET]
    stops = set()
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.6:
            i = rng.randrange(len(text))
            stops.add(text[i : i + rng.randint(1, 3)])
        else:
            stops.add(rng.choice(chars) + rng.choice(chars))
    return list(raw), sorted(stops)


def _decode_bytes(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", "replace")


def test_random_texts_decoded_byte_by_byte_with_random_stop_sets():
    rng = random.Random(0)
    for _ in range(3000):
        ids, stops = _random_case(rng)
        want = _cut(_decode_bytes, ids, stops)
        assert _streamed(_decode_bytes, ids, stops) == want, (bytes(ids), stops)
