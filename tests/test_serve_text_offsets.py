"""A completion's ``logprobs.text_offset`` where a byte-level BPE splits characters over tokens
(each piece alone decodes to U+FFFD): checked against Hugging Face ``tokenizers``' own offsets
of the same tokens in the same text, through the real server, whole and streamed, with stop
strings that hold text back or cut it."""

from __future__ import annotations

import pytest
from _bytes_bpe import TEXT, bpe_model_checkpoint, bytes_bpe, force_tokens
from test_serve import client, running

from llm_foundry.serve.offsets import StreamedOffsets, text_offsets


@pytest.fixture(scope="module")
def tok():
    return bytes_bpe()


def _hf_starts(tok, text: str) -> tuple[list[int], list[int]]:
    """(ids of ``text``, where Hugging Face's encoding puts each token's first character)."""
    enc = tok.hf.encode(text, add_special_tokens=False)
    return enc.ids, [start for start, _ in enc.offsets]


def _check(offsets: list[int], text: str) -> None:
    """From 0, never decreasing, inside the text, and the slices between them give it back."""
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
    ends = [*offsets[1:], len(text)]
    assert "".join(text[a:b] for a, b in zip(offsets, ends, strict=True)) == text


@pytest.mark.parametrize("text", [TEXT, "🙂🙂 a", "世", "plain ascii, merged"])
def test_offsets_are_where_hugging_face_encoding_starts_each_token(tok, text):
    ids, want = _hf_starts(tok, text)
    assert tok.decode(ids) == text
    offsets = text_offsets(tok.decode, ids, text)
    _check(offsets, text)
    assert offsets == want


def test_streamed_chunks_give_the_whole_offsets(tok):
    """Fed one token at a time as the engine emits them (text ending in U+FFFD held back), the
    chunks' offsets are the whole text's; a stop string cutting the text: the tokens past it
    come at the end, at the text's end."""
    ids, want = _hf_starts(tok, TEXT)
    for cut in (len(TEXT), TEXT.index("🙂")):
        stream, sent, got = StreamedOffsets(tok.decode), 0, []
        for j in range(len(ids)):
            text = tok.decode(ids[: j + 1])[:cut]
            final = len(text.rstrip("\ufffd")) if j + 1 < len(ids) else len(text)
            piece, sent = text[sent:final], max(sent, final)
            got += stream.chunk(piece, [(ids[j], 0.0, [])])[1]
        got += stream.end()[1]
        assert got == [min(w, cut) for w in want] == text_offsets(tok.decode, ids, TEXT[:cut])


@pytest.fixture(scope="module")
def bpe_checkpoint(tok, tmp_path_factory):
    return bpe_model_checkpoint(tok, tmp_path_factory.mktemp("serve-offsets") / "ckpt")


@pytest.fixture
def forced(tok, monkeypatch):
    """Each call: the engine's next request picks the tokens of TEXT in order."""
    play = force_tokens(monkeypatch)
    return lambda: play(tok.encode(TEXT))


@pytest.mark.parametrize("stop", [[], ["🙂! 世界?"], ["界 "], ["🙂!"]])
def test_server_offsets_of_split_characters_locate_them_in_the_text(
    tok, bpe_checkpoint, forced, stop
):
    """Through the official client: every token's offset is where Hugging Face's encoding puts
    it (clamped to the text a stop string cut), whole and streamed alike."""
    ids, want = _hf_starts(tok, TEXT)
    cut = min((TEXT.index(s) for s in stop if s in TEXT), default=len(TEXT))
    with running(bpe_checkpoint, slots=1) as (url, _):
        c = client(url)
        ask = dict(model="tiny", prompt="First", max_tokens=len(ids), logprobs=1, stop=stop)
        forced()
        r = c.completions.create(**ask)
        text, lp = r.choices[0].text, r.choices[0].logprobs
        assert text == TEXT[:cut]
        assert any(t == "\ufffd" for t in lp.tokens)  # pieces of split characters
        _check(lp.text_offset, text)
        assert lp.text_offset == [min(w, cut) for w in want[: len(lp.tokens)]]
        forced()
        chunks = list(c.completions.create(**ask, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == text
        streamed = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs]
        assert [t for b in streamed for t in b.tokens] == lp.tokens
        assert [o for b in streamed for o in b.text_offset] == lp.text_offset
