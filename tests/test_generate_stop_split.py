"""``llm-foundry generate --stream --stop`` where a byte-level BPE splits the stop string's
characters over tokens: the streamed text equals the finished one, cut before the stop string."""

from __future__ import annotations

import json

import pytest
import torch
from _bytes_bpe import TEXT, bpe_model_checkpoint, bytes_bpe

from llm_foundry.cli import main


@pytest.mark.parametrize(
    "stop",
    ["! 世", "o 世", " 🙂", "! 界"],
)
def test_streamed_text_never_holds_the_start_of_a_split_stop_string(
    tmp_path, capsys, monkeypatch, stop
):
    import llm_foundry.generate as gen

    tok = bytes_bpe()
    path = bpe_model_checkpoint(tok, tmp_path / "bpe")
    script = tok.encode(TEXT)

    def scripted(model, idx, max_new_tokens, **kw):
        for t in script[:max_new_tokens]:
            yield torch.tensor([t])

    monkeypatch.setattr(gen, "stream", scripted)
    args = ["generate", "--checkpoint", str(path), "--prompt", "First", "--max-new-tokens",
            str(len(script)), "--stop", stop]  # fmt: skip
    assert main([*args, "--json"]) == 0
    want = TEXT[: TEXT.index(stop)] if stop in TEXT else TEXT
    assert json.loads(capsys.readouterr().out)["completion"] == want
    assert main(args) == 0
    assert capsys.readouterr().out == "First" + want + "\n"
    assert main([*args, "--stream"]) == 0
    assert capsys.readouterr().out == "First" + want + "\n"
