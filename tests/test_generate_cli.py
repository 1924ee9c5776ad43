"""``llm-foundry generate``: text, streaming, stop strings, interactive loop, HF directories."""

from __future__ import annotations

import io
import json

import pytest
import torch

from llm_foundry.checkpoint import save_checkpoint
from llm_foundry.cli import main
from llm_foundry.config import ModelConfig
from llm_foundry.generate import generate
from llm_foundry.models import Transformer
from llm_foundry.tokenizer import CharTokenizer

TEXT = "to be or not to be, that is the question. whether tis nobler in the mind\n" * 5


@pytest.fixture()
def ckpt(tmp_path):
    tok = CharTokenizer.train(TEXT)
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(
            vocab_size=tok.vocab_size,
            dim=32,
            n_layers=2,
            n_heads=2,
            max_seq_len=64,
            pos_encoding="learned",
        )
    ).eval()
    save_checkpoint(model, tmp_path / "ck")
    tok.save(tmp_path / "ck" / "tokenizer.json")
    return tmp_path / "ck", model, tok


def _run(capsys, *args) -> str:
    assert main(["generate", *args]) == 0
    return capsys.readouterr().out


def test_greedy_text_equals_the_python_api(ckpt, capsys):
    path, model, tok = ckpt
    args = ["--checkpoint", str(path), "--prompt", "to be", "--temperature", "0"]
    out = _run(capsys, *args, "--max-new-tokens", "20")
    ref = generate(model, torch.tensor([tok.encode("to be")]), 20, temperature=0)
    assert out == tok.decode(ref[0].tolist()) + "\n"
    assert _run(capsys, *args, "--max-new-tokens", "20", "--stream") == out
    rep = json.loads(_run(capsys, *args, "--max-new-tokens", "20", "--json"))
    assert rep["new_tokens"] == 20 and rep["prompt"] + rep["completion"] == out[:-1]
    assert rep["tokens"] == ref[0].tolist()


def test_stop_string_and_seed(ckpt, capsys):
    path, model, tok = ckpt
    base = ["--checkpoint", str(path), "--prompt", "t", "--max-new-tokens", "40", "--json"]
    full = json.loads(_run(capsys, *base, "--temperature", "0"))["completion"]
    stop = full[5:7]
    cut = json.loads(_run(capsys, *base, "--temperature", "0", "--stop", stop))["completion"]
    assert cut == full[: full.find(stop)]
    a = _run(capsys, *base, "--seed", "7", "--top-k", "5")
    b = _run(capsys, *base, "--seed", "7", "--top-k", "5")
    assert json.loads(a)["tokens"] == json.loads(b)["tokens"]


def test_interactive_loop_reads_prompts_until_empty_line(ckpt, capsys, monkeypatch):
    path, _, _ = ckpt
    monkeypatch.setattr("sys.stdin", io.StringIO("to be\nthe q\n\n"))
    out = _run(capsys, "--checkpoint", str(path), "--interactive", "--temperature", "0",
               "--max-new-tokens", "5")  # fmt: skip
    assert out.count("> ") == 3 and "to be" in out and "the q" in out


def test_run_directory_and_hf_directory(ckpt, tmp_path, capsys):
    import transformers

    path, model, tok = ckpt
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    path.rename(run / "checkpoints" / "step_000010")
    (run / "checkpoints" / "latest.json").write_text(json.dumps({"path": "step_000010"}))
    out = _run(capsys, "--checkpoint", str(run), "--prompt", "to", "--temperature", "0",
               "--max-new-tokens", "3")  # fmt: skip
    assert out.startswith("to") and len(out) == len("to") + 3 + 1

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(str(tmp_path / "hf"))
    out = _run(capsys, "--checkpoint", str(tmp_path / "hf"), "--prompt-ids", "1,2,3",
               "--temperature", "0", "--max-new-tokens", "6")  # fmt: skip
    ref = hf.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6, do_sample=False,
                      eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert out.split() == [str(t) for t in ref[0].tolist()]


def test_errors(ckpt, tmp_path, capsys):
    path, _, _ = ckpt
    assert main(["generate", "--checkpoint", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
    long = ["--checkpoint", str(path), "--prompt", "to be", "--max-new-tokens", "100"]
    assert main(["generate", *long]) == 2  # learned positions: 64 rows
    assert "max_seq_len=64" in capsys.readouterr().err
