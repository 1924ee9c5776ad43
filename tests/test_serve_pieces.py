"""What the server says of tokens (serve/pieces.py) and where they start (serve/offsets.py):
each token's own bytes in chat logprobs (joined, the reply's UTF-8), offsets from those bytes in
linear time equal to the exact prefix-decoding ones, and special tokens left out of the text as
Hugging Face's ``skip_special_tokens`` leaves them, with offsets, stops and logprobs agreeing.
References: Hugging Face ``tokenizers``' own decode, transformers' GPT-2 byte alphabet, the
official ``openai`` client against a real server."""

from __future__ import annotations

import json
import random

import pytest
from _bytes_bpe import TEXT, bytes_bpe, forced_server
from test_serve import client

from llm_foundry.serve.offsets import StreamedOffsets, text_offsets
from llm_foundry.serve.pieces import Pieces, gpt2_bytes
from llm_foundry.tokenizer import CharTokenizer, HFTokenizerFile

tokenizers = pytest.importorskip("tokenizers")


def _byte_level_file() -> HFTokenizerFile:
    """A GPT-2 style tokenizer.json that is not ours: byte-level BPE, two special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    hf.train_from_iterator(["héllo wörld, 世界 🙂 naïve café\n" * 30], trainer)
    return HFTokenizerFile(hf, eos_id=hf.token_to_id("<|endoftext|>"))


def _fuse_file() -> HFTokenizerFile:
    """A character tokenizer written as a tokenizer.json (a Fuse decoder joins the pieces)."""
    return HFTokenizerFile(CharTokenizer.train("héllo 世界🙂!\n").to_hf())


def _metaspace_file() -> HFTokenizerFile:
    """A sentencepiece-style tokenizer.json (Metaspace, byte fallback, a decoder that strips
    the first space): not a join of bytes, so offsets keep the exact general path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from llm_foundry.serve.prompt_size import BYTE_FALLBACK

    hf = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  special_tokens=["<unk>", *BYTE_FALLBACK])  # fmt: skip
    hf.train_from_iterator(["héllo wörld, naïve café\n" * 30], trainer)
    return HFTokenizerFile(hf)


def _llama2_file() -> HFTokenizerFile:
    """A Llama 2 style tokenizer.json: <0x00>..<0xFF> ordinary tokens of the vocabulary (byte
    fallback for characters it lacks: 世, 🙂), Metaspace, a decoder that joins byte runs and
    strips the first space, <s> put in front of a text."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace()
    base.train_from_iterator(["héllo wörld, naïve café\n" * 30], trainers.BpeTrainer(
        vocab_size=120, show_progress=False, special_tokens=["<unk>", "<s>", "</s>"]))  # fmt: skip
    trained = json.loads(base.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    hf = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                              fuse_unk=True))  # fmt: skip
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t in ("<unk>", "<s>", "</s>")])  # fmt: skip
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return HFTokenizerFile(hf, eos_id=2)


TOKENIZERS = {
    "ours (byte-level BPE)": bytes_bpe,
    "byte-level tokenizer.json": _byte_level_file,
    "characters": lambda: CharTokenizer.train("héllo 世界🙂!\n"),
    "characters as tokenizer.json (Fuse)": _fuse_file,
    "sentencepiece-like": _metaspace_file,
    "llama 2 style (byte fallback)": _llama2_file,
}


def test_the_byte_alphabet_is_gpt2s():
    """Read back against transformers' own table and tokenizers' alphabet."""
    from tokenizers import pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert gpt2_bytes() == {c: b for b, c in bytes_to_unicode().items()}
    assert set(gpt2_bytes()) == set(pre_tokenizers.ByteLevel.alphabet())


def _byte_tokens(tok) -> list[int]:
    """The ids of tokens that are one byte each (none for a tokenizer without them)."""
    one = {}
    for i in range(tok.vocab_size):
        b = Pieces(tok).token_bytes(i)
        if len(b) == 1 and i not in Pieces(tok).specials:
            one.setdefault(b[0], i)
    return list(one.values())


def _random_ids(tok, rng: random.Random, n: int, bytes_only: list[int]) -> list[int]:
    """Ids drawn at random (pieces of characters, invalid bytes, special tokens) and the ids
    of real text with them; with ``bytes_only``: single bytes, lead bytes of 2-4 byte
    characters and bytes after them (ED A3 is no character start: two U+FFFD)."""
    if bytes_only:
        return [rng.choice(bytes_only) for _ in range(n)]
    ids = [rng.randrange(tok.vocab_size) for _ in range(n)]
    text = tok.encode(TEXT) if not isinstance(tok, CharTokenizer) else tok.encode("héllo 世界🙂!")
    at = rng.randrange(n)
    return ids[:at] + text + ids[at:]


@pytest.mark.parametrize("make", TOKENIZERS.values(), ids=list(TOKENIZERS))
def test_where_the_text_joins_token_bytes_offsets_from_bytes_equal_the_exact_ones(make):
    """For random ids: where ``joined``, the text is the tokens' bytes joined and decoded as
    the tokenizer's own decode has it, and the linear offsets (whole, and streamed a token at a
    time as the engine sends them) equal the prefix-decoding ones; a special token adds no
    text; the linear path decodes nothing."""
    tok = make()
    pieces = Pieces(tok)
    assert pieces.joined == (make not in (_metaspace_file, _llama2_file))
    rng, calls = random.Random(0), []

    def counting(ids):
        calls.append(1)
        return pieces.text(ids)

    single = _byte_tokens(tok) if pieces.joined else []
    for k in range(60):
        ids = _random_ids(tok, rng, rng.randrange(1, 60), single if k % 2 else [])
        text = pieces.text(ids)
        skipped = [i for i in ids if i not in pieces.specials]
        hf = getattr(tok, "hf", None)
        if hf is not None:  # Hugging Face's own: special tokens skipped
            assert text == hf.decode(skipped, skip_special_tokens=True)
        if not pieces.joined:
            continue
        joined = b"".join(pieces.token_bytes(i) for i in ids)
        assert text == joined.decode("utf-8", errors="replace")
        want = text_offsets(pieces.text, ids, text)
        assert text_offsets(counting, ids, text, token_bytes=pieces.token_bytes) == want
        assert not calls
        for cut in (len(text), len(text) // 2):
            exact, fast = StreamedOffsets(pieces.text), StreamedOffsets(counting,
                                                                        pieces.token_bytes)  # fmt: skip
            sent = 0
            for j in range(len(ids)):
                now = pieces.text(ids[: j + 1])[:cut]
                final = len(now.rstrip("\ufffd")) if j + 1 < len(ids) else len(now)
                piece, sent = now[sent:final], max(sent, final)
                record = [(ids[j], 0.0, [])]
                assert fast.chunk(piece, record) == exact.chunk(piece, record)
            assert fast.end() == exact.end()
        assert not calls


@pytest.fixture(scope="module")
def tok():
    return bytes_bpe()


@pytest.fixture(scope="module")
def server(tok, tmp_path_factory):
    """(url, play(ids): the next request's tokens) of a server on our byte-level BPE."""
    with forced_server(tok, tmp_path_factory.mktemp("serve-pieces")) as (url, _, play):
        yield url, play


def test_chat_logprob_bytes_are_each_tokens_own_and_join_to_the_reply(tok, server):
    """A reply whose characters are split over tokens (each piece alone U+FFFD): every token's
    bytes are its own (one or two bytes of 世, not U+FFFD's three), they join to the reply's
    UTF-8, and each alternative's bytes are its own too."""
    url, play = server
    ids = tok.encode(TEXT)
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # pieces of characters
    play(ids)
    r = client(url).chat.completions.create(model="tiny", messages=[{"role": "user",
                                            "content": "Hi"}], max_tokens=len(ids),
                                            logprobs=True, top_logprobs=3)  # fmt: skip
    reply, content = r.choices[0].message.content, r.choices[0].logprobs.content
    assert reply == TEXT
    assert b"".join(bytes(t.bytes) for t in content) == TEXT.encode()
    for t, i in zip(content, ids, strict=True):
        assert bytes(t.bytes) == bytes(gpt2_bytes()[c] for c in tok.hf.id_to_token(i))
        for alt in [t, *t.top_logprobs]:  # what the token shows is its bytes decoded alone
            assert bytes(alt.bytes).decode("utf-8", errors="replace") == alt.token


def test_special_tokens_are_left_out_of_the_text_and_named_in_logprobs(tok, server):
    """<pad> and <bos> picked mid-reply: the text is Hugging Face's decode with
    skip_special_tokens (no literal "<pad>"), whole and streamed, completions and chat; a stop
    string is met across them as in that text; logprobs name them ("<pad>") with no bytes,
    at the offset where the text goes on, and the other tokens' offsets locate them."""
    url, play = server
    ids = [*tok.encode("héllo"), tok.pad_id, *tok.encode(" 世界"), tok.bos_id, *tok.encode("!")]
    want = tok.hf.decode(ids, skip_special_tokens=True)
    assert want == "héllo 世界!" and "<pad>" in tok.decode(ids)
    c = client(url)
    ask = dict(model="tiny", prompt="First", max_tokens=len(ids), logprobs=1)
    play(ids)
    r = c.completions.create(**ask).choices[0]
    assert r.text == want
    lp = r.logprobs
    assert lp.tokens[len(tok.encode("héllo"))] == "<pad>" and "<bos>" in lp.tokens
    for token, at in zip(lp.tokens, lp.text_offset, strict=True):
        if token not in ("<pad>", "<bos>", "\ufffd"):
            assert want[at : at + len(token)] == token
    assert lp.text_offset[lp.tokens.index("<pad>")] == len("héllo")
    play(ids)
    chunks = list(c.completions.create(**ask, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want
    assert [o for ch in chunks if ch.choices[0].logprobs
            for o in ch.choices[0].logprobs.text_offset] == lp.text_offset  # fmt: skip
    play(ids)
    stopped = c.completions.create(**{**ask, "stop": ["o 世"]}).choices[0]
    assert (stopped.text, stopped.finish_reason) == ("héll", "stop")
    play(ids)
    messages = [{"role": "user", "content": "Hi"}]
    chat = c.chat.completions.create(model="tiny", messages=messages, max_tokens=len(ids),
                                     logprobs=True).choices[0]  # fmt: skip
    assert chat.message.content == want
    pad = next(t for t in chat.logprobs.content if t.token == "<pad>")
    assert pad.bytes == []
    assert b"".join(bytes(t.bytes) for t in chat.logprobs.content) == want.encode()
