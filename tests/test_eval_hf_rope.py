"""``eval`` of an HF model that scales its RoPE already (rope_scaling linear x4): --rope-scaling
replaces that scaling, says so, and computes what transformers computes with the scaling named
(the hint's composed linear factor included); a text shorter than the default context (an HF
model's max_position_embeddings) is refused naming --context."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import cli_status, corpus_text
from test_gguf_hf_dirs import _bytes_only

transformers = pytest.importorskip("transformers")

from llm_foundry.evaluate import windows  # noqa: E402
from llm_foundry.loading import load_any  # noqa: E402

CONTEXT = 32


def _hf_dir(path, **fields):
    """A random HF Llama over a byte-level tokenizer, saved with it; weights x4."""
    tok = _bytes_only()
    torch.manual_seed(0)
    sizes = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=2, max_position_embeddings=CONTEXT)  # fmt: skip
    config = transformers.LlamaConfig(**{**sizes, **fields})
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return model


@torch.no_grad()
def _transformers_loss(model, ids: list[int], context: int) -> float:
    """Mean next-token loss of an HF model over the windows ``evaluate.windows`` scores."""
    x, total, count = torch.tensor(ids), 0.0, 0
    for start, skip in windows(len(ids), context, None):
        logits = model(x[None, start : start + context]).logits[0]
        targets = x[start + 1 : start + context + 1]
        losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")[skip:]
        total, count = total + losses.sum().item(), count + len(losses)
    return total / count


def _with_linear(model, factor: float):
    """The same weights under linear RoPE scaling by ``factor`` (transformers' own model)."""
    config = transformers.LlamaConfig.from_dict(model.config.to_dict())
    config.rope_parameters = {**config.rope_parameters, "rope_type": "linear", "factor": factor}
    other = transformers.LlamaForCausalLM(config).eval()
    other.load_state_dict(model.state_dict())
    return other


def _eval(argv, capsys) -> dict:
    from llm_foundry.cli import main

    capsys.readouterr()
    assert main(["eval", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_rope_scaling_replaces_the_model_s_own_and_says_so(tmp_path, capsys):
    rope = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    model = _hf_dir(tmp_path / "hf", rope_parameters=rope)
    text = tmp_path / "t.txt"
    text.write_text(corpus_text(300))
    ids = load_any(tmp_path / "hf").tokenizer.encode(text.read_text())
    base = ["--checkpoint", str(tmp_path / "hf"), "--text", str(text), "--context", str(CONTEXT)]
    own = _eval(base, capsys)
    assert own["notes"] == []
    losses = {"own x4": (own["results"][0]["loss"], _transformers_loss(model, ids, CONTEXT))}
    for factor, reference in ((2, 2.0), (8, 8.0)):
        got = _eval([*base, "--rope-scaling", "linear", "--rope-factor", str(factor)], capsys)
        note = got["notes"][0]
        assert "replaces the model's own rope_scaling=linear x4" in note
        assert "--rope-scaling linear --rope-factor " + f"{4 * factor:g}" in note
        hf = _with_linear(model, reference)
        losses[f"x{factor}"] = (got["results"][0]["loss"], _transformers_loss(hf, ids, CONTEXT))
    print({k: f"ours {a:.6f} transformers {b:.6f}" for k, (a, b) in losses.items()})
    for ours, theirs in losses.values():
        assert ours == pytest.approx(theirs, abs=1e-4)
    assert abs(losses["x2"][0] - losses["own x4"][0]) > 1e-3  # the x4 was not kept under it


def test_a_text_shorter_than_the_default_context_names_context(tmp_path, capsys):
    _hf_dir(tmp_path / "hf", max_position_embeddings=4096)
    text = tmp_path / "t.txt"
    text.write_text("A short text.")
    rc, err = cli_status(["eval", "--checkpoint", str(tmp_path / "hf"), "--text", str(text)],
                         capsys)  # fmt: skip
    assert rc == 2 and err.count("\n") == 1, err
    assert "context 4,096 (the default: the model's max_seq_len)" in err
    assert "give --context N with N at most 13" in err
