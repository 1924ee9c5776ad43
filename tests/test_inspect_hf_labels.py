"""``inspect attention`` on an HF model labels each row and column as AutoTokenizer spells the
token: a special token the tokenizer adds (Llama's <s>) by its literal, not the empty string
decoding leaves."""

from __future__ import annotations

import json

import pytest
from test_gguf_hf_dirs import _bytes_only
from test_hf_import_checks import _saved

transformers = pytest.importorskip("transformers")


def test_special_tokens_are_labelled_by_their_literal(tmp_path, capsys):
    from llm_foundry.cli import main

    tok = _bytes_only()
    _saved(tmp_path / "hf", vocab_size=len(tok))
    tok.save_pretrained(str(tmp_path / "hf"))
    prompt = "The model reads"
    argv = ["inspect", "attention", "--checkpoint", str(tmp_path / "hf"), "--prompt", prompt]
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path / "a.png"), "--json"]) == 0
    labels = json.loads(capsys.readouterr().out)["tokens"]
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ids = auto(prompt).input_ids
    expected = [auto.decode([i]) for i in ids]  # decode keeps specials: <s> stays <s>
    print(labels)
    assert labels == expected and labels[0] == "<s>" == auto.bos_token
