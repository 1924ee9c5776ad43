"""A reply's text token by token (``serve.detok``) against the tokenizer decoding the whole reply
at every step, for each kind of decoder the server meets: at every step the final pieces and
the open end equal the whole decode of the tokens so far, and at the end the reply's text."""

from __future__ import annotations

import random

import pytest
from test_serve_pieces import TOKENIZERS

from llm_foundry.serve.detok import Utf8Text, WindowText
from llm_foundry.serve.pieces import Pieces

# characters every tokenizer of TOKENIZERS has (the character ones know only these)
TEXTS = ["héllo 世界 🙂!\n", "  hé  llo!\n\nhé", "🙂🙂 界 lo"]


def _replies(tok, n: int = 30, length: int = 48) -> list[list[int]]:
    """Token lists a model could give: encoded texts cut anywhere, and random ids (which split
    characters, put bytes in orders that are not UTF-8, and place special tokens anywhere)."""
    rng = random.Random(0)
    vocab = tok.vocab_size
    out = [tok.encode(t * 2) for t in TEXTS]
    out += [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]
    for _ in range(n):  # pieces of real text with random tokens between them
        ids = []
        while len(ids) < length:
            ids += tok.encode(rng.choice(TEXTS))[: rng.randrange(1, 8)]
            ids += [rng.randrange(vocab) for _ in range(rng.randrange(3))]
        out.append(ids)
    return out


@pytest.mark.parametrize("make", TOKENIZERS.values(), ids=list(TOKENIZERS))
@pytest.mark.parametrize("window", [False, True], ids=["its own", "window"])
def test_text_token_by_token_equals_the_whole_decode_at_every_step(make, window):
    """Both kinds: the one ``Pieces`` picks for the tokenizer, and the window over its decode
    (which the engine uses for any tokenizer it is given bare). Byte-fallback runs broken by an
    invalid byte (each byte then U+FFFD, an ASCII one's too) and special tokens inside a run
    (left out of the text, so the run joins across them) are among the random replies."""
    pieces = Pieces(make())
    kinds = 0
    for ids in _replies(pieces.tok):
        d = WindowText(pieces.text, held=pieces.held) if window else pieces.detokenizer()
        kinds |= 1 if isinstance(d, Utf8Text) else 2
        text = ""
        for k, token in enumerate(ids, 1):
            text += d.add(token)
            assert text + d.unsettled() == pieces.text(ids[:k]), (ids[:k], text)
        assert text + d.end() == pieces.text(ids)
    # byte-level, Fuse and character tokenizers read bytes; a sentencepiece decoder windows
    assert kinds == (2 if window or not pieces.joined else 1)


def test_an_end_of_replaced_bytes_is_what_the_whole_decode_gives():
    """Bytes of a character cut at the end (two of 世's three) are one U+FFFD while open and at
    the end; bytes that are already invalid are given as final U+FFFD at once."""
    tok = {0: "世".encode()[:1], 1: "世".encode()[1:2], 2: b"\xed", 3: b"\xa3", 4: b"a"}
    d = Utf8Text(tok.__getitem__)
    assert (d.add(0), d.unsettled()) == ("", "\ufffd")
    assert (d.add(1), d.unsettled()) == ("", "\ufffd")
    assert (d.add(4), d.unsettled()) == ("\ufffda", "")
    assert d.add(2) + d.add(3) + d.unsettled() == "\ufffd\ufffd"  # ED A3: two, invalid
    assert d.add(0) + d.end() == "\ufffd\ufffd\ufffd"
    joined = b"".join(tok[i] for i in [0, 1, 4, 2, 3, 0]).decode("utf-8", "replace")
    assert joined == "\ufffda\ufffd\ufffd\ufffd"


def test_the_window_stays_short():
    """Each token decodes a window of a few tokens, not the reply: the decode calls stay as
    short over a reply of 20 repeats of the texts as over its first repeat."""
    pieces = Pieces(TOKENIZERS["sentencepiece-like"]())
    lengths: list[int] = []

    def decode(ids):
        lengths.append(len(ids))
        return pieces.text(ids)

    d = WindowText(decode)
    ids = pieces.tok.encode(" ".join(TEXTS) * 20)
    assert len(ids) > 400
    text = "".join(d.add(i) for i in ids) + d.end()
    assert text == pieces.text(ids)
    first = len(pieces.tok.encode(" ".join(TEXTS)))
    assert max(lengths) == max(lengths[:first]) < first, (max(lengths), first)


@pytest.mark.parametrize("name", ["sentencepiece-like", "llama 2 style (byte fallback)"])
def test_a_reply_is_the_text_it_adds_to_its_prompt(name):
    """After a prompt, a reply's text is the whole text less the prompt's (as generate and HF's
    text-generation pipeline slice it): a first token that begins with a sentencepiece space
    keeps it, where decoding the reply alone strips it."""
    pieces = Pieces(TOKENIZERS[name]())
    prompt, ids = (
        pieces.tok.encode("héllo wörld,"),
        pieces.tok.encode("héllo wörld, naïve café 世界"),
    )
    assert ids[: len(prompt)] == prompt
    reply = ids[len(prompt) :]
    assert pieces.text(reply).startswith("naïve")  # alone: the space stripped
    d = pieces.detokenizer(prompt)
    text = "".join(d.add(i) for i in reply) + d.end()
    whole = pieces.text(prompt + reply)
    assert text == whole[len(pieces.text(prompt)) :] and text.startswith(" naïve café")
