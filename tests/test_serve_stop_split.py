"""Stop strings whose characters a byte-level BPE splits over tokens, through the real server and
the official client: /v1/completions and /v1/chat/completions, whole and streamed, give the text
cut before the stop string (what ``str.find`` on the finished text gives), and a genuine U+FFFD
(an invalid byte) is sent, in the middle of the text or at its end."""

from __future__ import annotations

import pytest
from _bytes_bpe import TEXT, bytes_bpe, forced_server
from test_serve import client

# each begins in ASCII and goes on into a character whose bytes come in several tokens: while
# they come the text ends in U+FFFD, and the ASCII before it must wait
STOPS = ["! 世", "! 世界", "o 世", " 🙂", "! 界", "🙂! 世界?"]  # the last two never complete


@pytest.fixture(scope="module")
def tok():
    return bytes_bpe()


@pytest.fixture(scope="module")
def server(tok, tmp_path_factory):
    """(url, chat's own stop strings, play(ids): the next request's tokens)."""
    with forced_server(tok, tmp_path_factory.mktemp("serve-stops")) as (url, served, play):
        yield url, served.chat_stop, play


def _cut(text: str, stops) -> str:
    """``text`` up to the first stop string in it (all of it if none is)."""
    return text[: min((text.index(s) for s in stops if s in text), default=len(text))]


def _four_ways(server, ids: list[int], stop: list[str]) -> list[tuple[str, str]]:
    """(text, finish reason) of a completion and a chat reply picking ``ids``, whole and
    streamed (each request with room for every one of them)."""
    url, _, play = server
    c, out = client(url), []
    ask = dict(model="tiny", max_tokens=len(ids), stop=stop)
    play(ids)
    r = c.completions.create(prompt="First", **ask).choices[0]
    out.append((r.text, r.finish_reason))
    play(ids)
    chunks = [ch.choices[0] for ch in c.completions.create(prompt="First", stream=True, **ask)]
    out.append(("".join(ch.text for ch in chunks), chunks[-1].finish_reason))
    messages = [{"role": "user", "content": "Hi"}]
    play(ids)
    r = c.chat.completions.create(messages=messages, **ask).choices[0]
    out.append((r.message.content, r.finish_reason))
    play(ids)
    chunks = [ch.choices[0] for ch in c.chat.completions.create(messages=messages, stream=True,
                                                                  **ask)]  # fmt: skip
    out.append(("".join(ch.delta.content or "" for ch in chunks), chunks[-1].finish_reason))
    return out


@pytest.mark.parametrize("stop", STOPS)
def test_a_stop_string_split_over_tokens_is_never_sent_in_part(tok, server, stop):
    ids = tok.encode(TEXT)
    assert any(tok.decode(ids[:j]).endswith("! \ufffd") for j in range(len(ids)))  # 世 split
    want = _cut(TEXT, [stop, *server[1]])
    reason = "stop" if stop in TEXT else "length"
    assert _four_ways(server, ids, [stop]) == [(want, reason)] * 4


@pytest.mark.parametrize("end", ["length", "eos"])
def test_a_genuine_replacement_character_is_sent_in_the_text_and_at_its_end(tok, server, end):
    """A byte no character starts with, then more text; and the first byte of 世 as the last
    token (at ``max_tokens``, or before the end of text): both are sent as U+FFFD."""
    invalid = next(i for i in range(tok.vocab_size)
                   if tok.decode([i, *tok.encode("ok")]) == "\ufffdok")  # fmt: skip
    first_byte = tok.encode("世")[0]
    ids = [*tok.encode("héllo 世界 🙂! "), invalid, *tok.encode("ok! "), first_byte]
    text = tok.decode(ids)
    assert text == "héllo 世界 🙂! \ufffdok! \ufffd"
    if end == "eos":
        ids.append(tok.eos_id)
    got = _four_ways(server, ids, ["! 世", "ok!?"])
    assert got == [(text, "length" if end == "length" else "stop")] * 4


@pytest.mark.parametrize("stop", ["! 世界", "ïve, über héllo 世", " more"])
def test_a_stop_string_far_into_a_reply_is_found_where_the_whole_text_has_it(tok, server, stop):
    """The engine keeps only the text a stop string can still reach: a stop string a few dozen
    tokens in (one spanning a dozen of them) cuts the reply where ``str.find`` on the whole
    text does, whole and streamed."""
    text = "speak. Café, naïve, über " + TEXT + " more"
    ids = tok.encode(text)
    assert 40 <= len(ids) <= 44, len(ids)  # room in the 64 positions after the chat prompt
    assert tok.decode(ids) == text
    assert _four_ways(server, ids, [stop]) == [(_cut(text, [stop, *server[1]]), "stop")] * 4
