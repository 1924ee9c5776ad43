"""Loading weights from files a user did not make: sizes in config.json are checked against the
weight file's header (on the meta device) before anything is allocated, and every damaged file
is one line naming it. Our checkpoints and HF directories alike."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_hf_llama
from safetensors.torch import load_file, save_file

from llm_foundry.checkpoint import load_checkpoint, read_safetensors_header, save_checkpoint
from llm_foundry.cli import main
from llm_foundry.config import ModelConfig
from llm_foundry.generate import generate
from llm_foundry.models import Transformer

TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=64)
# sizes that would take terabytes (or, for the layer count, forever) to build
ABSURD = [
    ("n_layers", 10**9),
    ("vocab_size", 10**12),
    ("dim", 2 * 10**9),
    ("hidden_dim", 10**12),
]


@pytest.fixture
def ckpt(tmp_path) -> Path:
    torch.manual_seed(0)
    return save_checkpoint(Transformer(ModelConfig(**TINY)), tmp_path / "ckpt")


def _edit_config(ckpt: Path, **fields) -> None:
    meta = json.loads((ckpt / "config.json").read_text())
    meta["model"].update(fields)
    (ckpt / "config.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(("field", "value"), ABSURD)
def test_absurd_sizes_in_our_config_are_refused_before_allocation(ckpt, field, value, capsys):
    _edit_config(ckpt, **{field: value})
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as err:
        load_checkpoint(ckpt)
    assert time.perf_counter() - t0 < 10
    msg = str(err.value)
    assert "\n" not in msg and str(ckpt / "model.safetensors") in msg and "config.json" in msg
    for argv in (
        ["generate", "--checkpoint", str(ckpt), "--prompt-ids", "1", "--max-new-tokens", "1"],
        ["eval", "--checkpoint", str(ckpt), "--data", str(ckpt)],
        ["convert", "--to-hf", str(ckpt), "--out", str(ckpt.parent / "hf")],
    ):
        assert main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "model.safetensors" in lines[0], lines


def test_a_long_rope_context_in_the_config_allocates_nothing_until_used(ckpt):
    _edit_config(ckpt, max_seq_len=10**12)  # RoPE has no weights per position: nothing to check
    model = load_checkpoint(ckpt)
    out = generate(model, torch.tensor([[1, 2, 3]]), 5, temperature=0)
    assert out.shape == (1, 8)
    assert model.pos.cos.shape[0] <= 64  # the cos/sin cache covers the positions used


def test_rope_cache_values_do_not_depend_on_how_far_it_has_grown():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TINY, "max_seq_len": 512})).eval()
    x = torch.randint(0, 64, (1, 300))
    with torch.no_grad():
        short = model(x[:, :10])[0]  # cache built for 10 positions, then grown for 300
        long = model(x)[0]
        fresh = Transformer(ModelConfig(**{**TINY, "max_seq_len": 512})).eval()
        fresh.load_state_dict(model.state_dict())
        fresh(x)  # built for 300 at once
    assert torch.equal(model.pos.cos[:300], fresh.pos.cos[:300])
    assert torch.equal(model.pos.sin[:300], fresh.pos.sin[:300])
    assert torch.equal(short, model(x[:, :10])[0].detach())
    assert long.shape == (1, 300, 64)


def test_learned_positions_past_the_file_are_refused(tmp_path):
    cfg = ModelConfig(**{**TINY, "pos_encoding": "learned"})
    ckpt = save_checkpoint(Transformer(cfg), tmp_path / "c")
    _edit_config(ckpt, max_seq_len=10**12)
    with pytest.raises(ValueError, match=r"pos.emb.weight is \(64, 32\) in the file"):
        load_checkpoint(ckpt)


def _damage(ckpt: Path, how: str) -> None:
    file = ckpt / "model.safetensors"
    raw = file.read_bytes()
    damaged = {
        "empty": b"",
        "short": raw[:5],
        "truncated": raw[: len(raw) // 2],
        "random": os.urandom(len(raw)),
        "header only": raw[: 8 + int.from_bytes(raw[:8], "little")],
        "huge header length": (2**40).to_bytes(8, "little") + raw[8:],
    }[how]
    file.write_bytes(damaged)


@pytest.mark.parametrize(
    "how", ["empty", "short", "truncated", "random", "header only", "huge header length"]
)
def test_a_damaged_weight_file_is_one_line_naming_it(ckpt, how, capsys):
    _damage(ckpt, how)
    with pytest.raises(ValueError, match=r"model.safetensors is not a safetensors file \(") as e:
        load_checkpoint(ckpt)
    assert "\n" not in str(e.value)
    argv = ["generate", "--checkpoint", str(ckpt), "--prompt-ids", "1", "--max-new-tokens", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a safetensors file" in err[0]


@pytest.mark.parametrize("model", [None, "missing", 3, []])
def test_a_config_whose_model_is_not_a_mapping_is_named(ckpt, model):
    meta = json.loads((ckpt / "config.json").read_text())
    if model == "missing":
        del meta["model"]
    else:
        meta["model"] = model
    (ckpt / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"config.json: 'model' is .*; expected an object"):
        load_checkpoint(ckpt)


def test_weights_with_nan_are_refused_naming_the_tensor(ckpt, capsys):
    model = load_checkpoint(ckpt)
    with torch.no_grad():
        model.layers[1].mlp.w2.weight[0, :3] = float("nan")
    save_checkpoint(model, ckpt)
    with pytest.raises(ValueError, match=r"tensor layers.1.mlp.w2.weight holds 3 non-finite"):
        load_checkpoint(ckpt)


def test_float8_weights_of_an_hf_model_are_refused_in_one_line(tmp_path):
    """float8 tensors (an FP8 checkpoint's, whose scales are not read) are named, not met by
    the NaN check, which torch cannot run on them."""
    from conftest import tiny_hf_llama

    from llm_foundry.loading import load_any

    tiny_hf_llama().save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        load_any(tmp_path)
    assert str(e.value).endswith(
        "tensor layers.0.mlp.w2.weight is float8_e4m3fn; weights are read as float32, float16, "
        "bfloat16, float64 (an FP8 checkpoint needs its scales: use a bf16 or fp32 copy of the "
        "model)"
    )


def test_header_reader_gives_every_shape_without_the_data(tmp_path):
    tensors = {"a": torch.zeros(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    save_file(tensors, str(tmp_path / "t.safetensors"), metadata={"format": "pt"})
    assert read_safetensors_header(tmp_path / "t.safetensors") == {"a": (3, 4), "b": (5,)}


# ----------------------------------------------------------------------------------------------
# HF directories


@pytest.fixture
def hf_dir(tmp_path) -> Path:
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                 num_key_value_heads=1)  # fmt: skip
    tiny_hf_llama(**sizes).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_hidden_layers", 10**9), ("vocab_size", 10**12), ("intermediate_size", 10**12)],
)
def test_absurd_sizes_in_an_hf_config_are_refused_before_allocation(hf_dir, field, value, capsys):
    from llm_foundry.interop.hf import from_hf

    conf = json.loads((hf_dir / "config.json").read_text())
    conf[field] = value
    (hf_dir / "config.json").write_text(json.dumps(conf))
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as err:
        from_hf(hf_dir)
    assert time.perf_counter() - t0 < 10
    assert "\n" not in str(err.value) and str(hf_dir) in str(err.value)
    argv = ["generate", "--checkpoint", str(hf_dir), "--prompt-ids", "1", "--max-new-tokens", "1"]
    assert main(argv) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_truncated_hf_weight_file_is_named(hf_dir):
    from llm_foundry.interop.hf import from_hf

    file = hf_dir / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"model.safetensors is not a safetensors file"):
        from_hf(hf_dir)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(ckpt, capsys):
    """Ids past the embedding would fail at the first token they meet (an IndexError in
    generate, a dead server): the mismatch is named when the model loads."""
    from llm_foundry.loading import load_any
    from llm_foundry.tokenizer import CharTokenizer

    tok = CharTokenizer.train("".join(chr(0x100 + i) for i in range(TINY["vocab_size"] + 1)))
    tok.save(ckpt / "tokenizer.json")
    with pytest.raises(ValueError, match=r"has 65 tokens but the model's vocab_size is 64"):
        load_any(ckpt)
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "\u0100"]) == 2
    assert "vocab_size is 64" in capsys.readouterr().err
    CharTokenizer.train("abc").save(ckpt / "tokenizer.json")  # smaller is fine: ids all fit
    assert load_any(ckpt).tokenizer.vocab_size == 3


def test_a_file_given_as_a_checkpoint_is_named_a_file(tmp_path, capsys):
    from llm_foundry.cli import main

    (f := tmp_path / "held-out.txt").write_text("text")
    assert main(["convert", "--to-hf", str(f), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"--to-hf {f} is a file: give a run or checkpoint directory" in err
    assert err.count("\n") == 1 and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_weights_get_the_permissions_of_the_other_files(tmp_path, mask):
    """safetensors creates its files for their owner alone; a checkpoint's weights are as
    readable as its config.json under the process's umask."""
    from llm_foundry.export import convert_to_hf
    from llm_foundry.train.state import save_train_checkpoint

    old = os.umask(mask)
    try:
        model = Transformer(ModelConfig(**TINY))
        path = save_checkpoint(model, tmp_path / "ckpt")
        hf = convert_to_hf(path, tmp_path / "hf")  # an HF export's weights too
        opt = torch.optim.AdamW(model.parameters())
        model(torch.zeros(1, 4, dtype=torch.long))[0].sum().backward()
        opt.step()  # a training checkpoint's optimizer file too
        step = save_train_checkpoint(tmp_path / "run", 1, model, opt.state_dict(), {})
    finally:
        os.umask(old)
    files = [f for f in step.iterdir() if f.suffix == ".safetensors"]
    assert len(files) == 2 and {f.stat().st_mode & 0o777 for f in files} == {0o666 & ~mask}
    modes = {f.name: f.stat().st_mode & 0o777 for f in path.iterdir()}
    assert modes == {"config.json": 0o666 & ~mask, "model.safetensors": 0o666 & ~mask}
    assert (Path(hf) / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask
