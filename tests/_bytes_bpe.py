"""A byte-level BPE that splits characters over tokens, a tiny model over it, and a way to make
the server's engine pick given tokens: for tests of text where a character's bytes arrive in
several tokens (each piece alone decodes to U+FFFD)."""

from __future__ import annotations

import contextlib

import torch

from llm_foundry.checkpoint import save_checkpoint
from llm_foundry.models import Transformer
from llm_foundry.presets import get_preset
from llm_foundry.tokenizer import BPETokenizer

# no CJK and no emoji: 世, 界 and 🙂 are left as bytes, each piece a U+FFFD alone
CORPUS = "First Citizen:\nBefore we proceed any further, hear me speak. Café, naïve, über\n" * 20
TEXT = "héllo 世界 🙂! 世界"


def bytes_bpe() -> BPETokenizer:
    """A 300-token byte-level BPE of CORPUS (Hugging Face ``tokenizers``)."""
    return BPETokenizer.train([CORPUS], vocab_size=300)


def bpe_model_checkpoint(tok: BPETokenizer, path):
    """A random 1-layer LLaMA-style model over ``tok`` (64 positions), saved with it at ``path``."""
    torch.manual_seed(0)
    cfg = get_preset("llama-shakespeare-char", vocab_size=tok.vocab_size, n_layers=1, dim=32,
                     n_heads=2, max_seq_len=64)  # fmt: skip
    save_checkpoint(Transformer(cfg), path)
    tok.save(path / "tokenizer.json")
    return path


def force_tokens(monkeypatch):
    """Make the engine pick given tokens in order, whatever the model's logits (a random model
    would rarely split a character); returns ``play(ids)``, which starts a request's list (one
    request at a time)."""
    from llm_foundry.serve import engine

    script: list[int] = []

    def pick(logits, **_):
        return torch.tensor([script.pop(0)])

    monkeypatch.setattr(engine, "sample_next", pick)
    return lambda ids: script.__setitem__(slice(None), list(ids))


@contextlib.contextmanager
def forced_server(tok: BPETokenizer, directory):
    """(url, served, play(ids): the next request's tokens) of a one-slot server on a model of
    ``tok`` saved in ``directory``, each reply the tokens ``play`` was given."""
    import pytest
    from test_serve import running

    path = bpe_model_checkpoint(tok, directory / "ckpt")
    with pytest.MonkeyPatch.context() as mp:
        play = force_tokens(mp)
        with running(path, slots=1) as (url, served):
            yield url, served, play
