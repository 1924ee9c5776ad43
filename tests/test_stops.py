"""``stops.settle`` over the decodes of a real byte-level BPE, one token more each step: the pieces
it lets out join into the finished text cut at its first stop string (``str.find``), for every
stop string cut out of the text (each starting at any character, split ones included) and for
ones that only begin there; never a piece that a later token changes."""

from __future__ import annotations

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


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    at = min((text.index(s) for s in stops if s in text), default=len(text))
    return text[:at], at < len(text)


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
        assert _streamed(tok.decode, ids, stops) == _cut(text, stops), stops


def test_a_genuine_replacement_character_is_let_out(tok):
    """An invalid byte (U+FFFD for good) in the middle, and an unfinished character at the end:
    the text comes out whole, cut only where a stop string occurs."""
    invalid = next(i for i in range(tok.vocab_size)
                   if tok.decode([i, *tok.encode("ok")]) == "\ufffdok")  # fmt: skip
    ids = [*tok.encode("a! "), invalid, *tok.encode("ok! "), tok.encode("世")[0]]
    text = tok.decode(ids)
    assert text == "a! \ufffdok! \ufffd"
    for stops in [[], ["! 世"], ["!?"], ["\ufffdok"], *_cases(text)]:
        assert _streamed(tok.decode, ids, stops) == _cut(text, stops), stops


def test_stop_prefix_is_the_longest_proper_start_the_text_ends_with():
    stops = ["abab", "aaa", "世界!", "x"]
    for text in ["", "a", "ab", "aba", "abab", "zaa", "世界", "ba世", "x"]:
        for stop in stops:
            want = max(k for k in range(len(stop)) if k <= len(text) and text.endswith(stop[:k]))
            assert stop_prefix(text, stop) == want, (text, stop)
