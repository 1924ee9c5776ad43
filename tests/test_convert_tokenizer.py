"""``convert --to-hf`` reads the checkpoint's tokenizer once: its special ids (config.json), the
tokenizer.json written for HF and tokenizer_config.json's named specials all come from that one
load (each step loaded it again), by the one reader of tokenizer files
(``tokenizer_files.open_tokenizer``): one that it cannot read is refused, not exported."""

from __future__ import annotations

import pytest
import torch

import llm_foundry.tokenizer as tokenizer_module
from llm_foundry.checkpoint import save_checkpoint
from llm_foundry.cli import main
from llm_foundry.config import ModelConfig
from llm_foundry.models import Transformer
from llm_foundry.tokenizer import CharTokenizer


def _checkpoint(tmp_path):
    tok = CharTokenizer.train("to be or not to be, that is the question\n")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=1, n_heads=2, max_seq_len=32)
    ckpt = save_checkpoint(Transformer(cfg), tmp_path / "ckpt")
    tok.save(ckpt / "tokenizer.json")
    return ckpt


def test_convert_to_hf_loads_the_tokenizer_once(tmp_path, monkeypatch, capsys):
    ckpt = _checkpoint(tmp_path)
    loads = []
    load = tokenizer_module.load_tokenizer

    def counted(*args, **kwargs):
        loads.append(args[0] if args else kwargs)
        return load(*args, **kwargs)

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", counted)
    assert main(["convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert len(loads) == 1, loads


@pytest.mark.parametrize("text", ['{"model": {"type": "Nothing"}}', "not json"])
def test_a_tokenizer_that_no_reader_reads_is_refused_in_one_line(tmp_path, capsys, text):
    """Was: read as no tokenizer, and the file exported as it was (one HF tokenizers cannot
    read either), or a JSON traceback."""
    ckpt = _checkpoint(tmp_path)
    (ckpt / "tokenizer.json").write_text(text)
    assert main(["convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "hf")]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"cannot read {ckpt / 'tokenizer.json'}" in err, err
    assert not (tmp_path / "hf").exists()
