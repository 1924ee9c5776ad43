"""Where exports write (``outputs.py``): convert and quantize never write over a file or directory
that exists (the source's own weights, a training run) nor into a run's checkpoints/; a run
directory that also holds a checkpoint is refused as ambiguous; an export that fails leaves
nothing behind; a checkpoint config that names layers the model lacks is one line."""

from __future__ import annotations

import json

import pytest
import torch

from llm_foundry.checkpoint import save_checkpoint
from llm_foundry.cli import main
from llm_foundry.config import ModelConfig
from llm_foundry.loading import load_any
from llm_foundry.models import Transformer
from llm_foundry.tokenizer import CharTokenizer

TEXT = "to be or not to be, that is the question\n" * 4


def _checkpoint(path, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    tok = CharTokenizer.train(TEXT)
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=1, n_heads=2, max_seq_len=32)
    model = Transformer(cfg).eval()
    save_checkpoint(model, path)
    tok.save(path / "tokenizer.json")
    return model


def _run(root, seed: int = 0) -> Transformer:
    """A training run's layout: run.json, checkpoints/step_000001 and latest.json."""
    model = _checkpoint(root / "checkpoints" / "step_000001", seed)
    (root / "checkpoints" / "latest.json").write_text(
        json.dumps({"step": 1, "path": "step_000001"})
    )
    (root / "run.json").write_text(json.dumps({"train": {}}))
    return model


def _refused(capsys, argv: list[str], needle: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err
    return err


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[1, 2, 3, 4]]))[0]


def test_gguf_export_never_overwrites_a_file(tmp_path, capsys):
    pytest.importorskip("gguf")
    ck = tmp_path / "ck"
    _checkpoint(ck)
    weights = (ck / "model.safetensors").read_bytes()
    for target in (ck / "model.safetensors", ck / "config.json"):  # the source's own files
        _refused(capsys, ["convert", "--to-gguf", str(ck), "--out", str(target)], "exists")
    assert (ck / "model.safetensors").read_bytes() == weights
    out = tmp_path / "m.gguf"
    assert main(["convert", "--to-gguf", str(ck), "--out", str(out)]) == 0
    written = out.read_bytes()
    capsys.readouterr()
    _refused(capsys, ["convert", "--to-gguf", str(ck), "--out", str(out)], "exists")
    assert out.read_bytes() == written


def test_an_export_into_a_run_is_refused_and_the_run_still_loads_its_own_model(tmp_path, capsys):
    run = tmp_path / "run"
    trained = _run(run)
    other = tmp_path / "other"
    _checkpoint(other, seed=1)
    hf = tmp_path / "hf"
    assert main(["convert", "--to-hf", str(other), "--out", str(hf)]) == 0
    capsys.readouterr()
    for argv in (
        ["convert", "--from-hf", str(hf), "--out", str(run)],
        ["convert", "--to-hf", str(other), "--out", str(run)],
        ["quantize", "--checkpoint", str(other), "--to", "int8", "--out", str(run)],
    ):
        _refused(capsys, argv, "not empty")
    assert torch.equal(_logits(load_any(run).model), _logits(trained))
    # a directory that holds both a checkpoint and a run: which one was meant is not guessed
    save_checkpoint(load_any(other).model, run)
    _refused(capsys, ["generate", "--checkpoint", str(run), "--prompt", "to"], "holds both")


def test_an_export_inside_a_runs_checkpoints_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    _run(run)
    inside = run / "checkpoints" / "step_000001" / "int8"
    argv = ["quantize", "--checkpoint", str(run), "--to", "int8", "--out", str(inside)]
    _refused(capsys, argv, "rewrites")
    assert not inside.exists()
    argv = ["convert", "--to-hf", str(run), "--out", str(run / "checkpoints" / "hf")]
    _refused(capsys, argv, "rewrites")
    assert main(["quantize", "--checkpoint", str(run), "--to", "int8",
                 "--out", str(run / "int8")]) == 0  # fmt: skip


def test_a_failed_export_leaves_nothing_behind(tmp_path, capsys, monkeypatch):
    import llm_foundry.interop.hf as hf

    ck = tmp_path / "ck"
    _checkpoint(ck)

    def broken(model, out_dir, *args, **kw):
        (out_dir / "config.json").write_text("{}")  # half written, then the disk fills
        raise OSError("No space left on device")

    monkeypatch.setattr(hf, "to_hf", broken)
    out = tmp_path / "hf"
    assert main(["convert", "--to-hf", str(ck), "--out", str(out)]) == 2
    assert "No space left" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [ck]  # no partial directory, no temporary one


def test_a_quantized_config_naming_layers_the_model_lacks_is_one_line(tmp_path, capsys):
    ck = tmp_path / "ck"
    _checkpoint(ck)
    q = tmp_path / "q"
    assert main(["quantize", "--checkpoint", str(ck), "--to", "int8", "--out", str(q)]) == 0
    meta = json.loads((q / "config.json").read_text())
    meta["quantization"]["layers"].append("layers.7.attn.wq")
    (q / "config.json").write_text(json.dumps(meta))
    capsys.readouterr()
    err = _refused(capsys, ["generate", "--checkpoint", str(q), "--prompt", "to"], "layers.7")
    assert str(q / "config.json") in err
