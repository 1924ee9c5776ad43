"""A Llama 2 style tokenizer (sentencepiece spaces, byte fallback, a BOS it adds) through the
real server and the official client, each reply's tokens chosen: a completion's prompt is
encoded as ``generate`` and transformers encode it (its <s>), a reply's text is what it adds to
the prompt's (a first token's space kept), a byte run is shown as the whole reply's decode
shows it, and the end-of-text token that ended a reply is counted in its usage."""

from __future__ import annotations

import json

import pytest
from _bytes_bpe import force_tokens
from test_serve import client, running
from test_serve_pieces import _llama2_file

PROMPT = "héllo wörld,"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, tok, play(ids): the next request's tokens) of a one-slot server on a random model
    over the tokenizer, its special tokens named in tokenizer_config.json as a Llama's are."""
    import torch

    from llm_foundry.checkpoint import save_checkpoint
    from llm_foundry.models import Transformer
    from llm_foundry.presets import get_preset

    tok = _llama2_file()
    path = tmp_path_factory.mktemp("serve-llama2") / "ckpt"
    torch.manual_seed(0)
    cfg = get_preset("llama-shakespeare-char", vocab_size=tok.vocab_size, n_layers=1, dim=32,
                     n_heads=2, max_seq_len=64)  # fmt: skip
    save_checkpoint(Transformer(cfg), path)
    tok.hf.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    with pytest.MonkeyPatch.context() as mp:
        play = force_tokens(mp)
        with running(path, slots=1) as (url, _):
            yield url, tok, play


def _reply(tok, continuation: str) -> list[int]:
    """The ids ``continuation`` adds after PROMPT's."""
    prompt, ids = tok.encode(PROMPT), tok.encode(PROMPT + continuation)
    assert ids[: len(prompt)] == prompt
    return ids[len(prompt) :]


def test_a_completion_is_what_its_tokens_add_to_the_prompt_and_its_end_is_counted(server):
    """The prompt with its <s> (usage as transformers' tokenizer counts it); the text keeps the
    first token's space (whole and streamed); </s> ends it and is a completion token."""
    transformers = pytest.importorskip("transformers")
    url, tok, play = server
    reply = _reply(tok, " naïve café 世界")
    prompt = tok.encode(PROMPT)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.hf)
    assert prompt[0] == 1 and hf(PROMPT).input_ids == prompt  # <s> put in front
    whole = tok.decode(prompt + reply)
    want = whole[len(tok.decode(prompt)) :]
    assert want == " naïve café 世界" and not tok.decode(reply).startswith(" ")
    c = client(url)
    play([*reply, 2])
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=40)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(reply) + 1)
    play([*reply, 2])
    chunks = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, stream=True,
                                       stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == len(reply) + 1


@pytest.mark.parametrize("stop", [None, "\ufffdn", "\ufffd\ufffd\ufffdn c"])
def test_a_byte_run_an_invalid_byte_breaks_is_shown_as_the_whole_reply_decodes(server, stop):
    """<0x54> alone reads 'T'; followed by bytes that are no UTF-8 the whole run reads U+FFFD
    per byte, 'T' too: the text sent (and where a stop string cuts it) is the whole reply's."""
    url, tok, play = server
    vocab = tok.hf.get_vocab()
    run = [vocab[f"<0x{b:02X}>"] for b in (0x54, 0x81, 0xBC)]
    reply = [*_reply(tok, " naïve"), *run, vocab["n"], *_reply(tok, " café")]
    prompt = tok.encode(PROMPT)
    text = tok.decode(prompt + reply)[len(tok.decode(prompt)) :]
    assert text == " naïve\ufffd\ufffd\ufffdn café"  # and 'T' while the run was open
    want = text if stop is None else text[: text.index(stop)]
    assert stop is None or stop in text
    c = client(url)
    for stream in (False, True):
        play(reply)
        kw = dict(model="tiny", prompt=PROMPT, max_tokens=len(reply), stop=stop)
        if stream:
            got = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw))
        else:
            got = c.completions.create(**kw).choices[0].text
        assert got == want, (stream, got, want)


def test_logprob_token_names_keep_their_sentencepiece_space(server):
    """Each token named by the text it adds after an ordinary token: joined, the names of a reply
    of whole-character tokens are its text (decoding a token alone strips its space)."""
    url, tok, play = server
    reply = _reply(tok, " naïve café")
    assert any(tok.hf.id_to_token(i).startswith("▁") for i in reply)
    play(reply)
    r = client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=len(reply),
                                       logprobs=0)  # fmt: skip
    choice = r.choices[0]
    assert choice.text == " naïve café" and "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.text_offset[0] == 0
