"""``quantize --to int4`` with a group size that divides no projection's inputs quantizes nothing:
refused in one line (the group size, the input widths, the group sizes that fit) before
anything is written, instead of a copy "1.00x less" that exits 0; ``generate``/``serve
--quantize int4``, which quantize as they load, refuse it in the same line."""

from __future__ import annotations

import pytest
import torch

from llm_foundry.checkpoint import save_checkpoint
from llm_foundry.cli import main
from llm_foundry.config import ModelConfig
from llm_foundry.models import Transformer
from llm_foundry.models.quant import GROUP_SIZES, fits


def _checkpoint(tmp_path, **fields):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, n_layers=1, n_heads=4, max_seq_len=32, **fields)
    return save_checkpoint(Transformer(cfg), tmp_path / "ckpt"), cfg


def test_a_group_size_that_fits_no_projection_is_refused_naming_the_widths(tmp_path, capsys):
    ckpt, cfg = _checkpoint(tmp_path, dim=64, hidden_dim=96)  # inputs 64 wide (w2: 96)
    out = tmp_path / "q"
    argv = ["quantize", "--checkpoint", str(ckpt), "--to", "int4", "--out", str(out)]
    assert main([*argv, "--group-size", "128"]) == 2
    err = capsys.readouterr().err
    linears = [m for m in Transformer(cfg).modules() if isinstance(m, torch.nn.Linear)]
    assert err.count("\n") == 1, err
    assert f"int4 in groups of 128 inputs quantizes none of its {len(linears)} projections" in err
    assert "input widths (64, 96) are not multiples of 128; --group-size 32 or 64 fits" in err
    assert not out.exists()
    # the group sizes named are those the kernel takes for some projection, and each works
    assert [g for g in GROUP_SIZES if any(fits("int4", m, g) for m in linears)] == [32, 64]
    for group in (32, 64):
        done = sum(fits("int4", m, group) for m in linears)
        assert main([*argv[:-1], str(out / str(group)), "--group-size", str(group)]) == 0
        assert f"{done} projections quantized" in capsys.readouterr().out


def test_no_group_size_fitting_points_to_int8(tmp_path, capsys):
    ckpt, _ = _checkpoint(tmp_path, dim=48, hidden_dim=80)  # 48 and 80: no multiple of 32
    out = tmp_path / "q"
    argv = ["quantize", "--checkpoint", str(ckpt), "--to", "int4", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "input widths (48, 80) are not multiples of 64; --to int8 takes any width" in err
    assert not out.exists()


def test_quantizing_at_load_refuses_it_alike_in_generate_and_serve(tmp_path, capsys):
    """generate/serve --quantize int4 (the model quantized in memory as it loads) with a group
    size that fits no projection: the same line, naming --quantize where no group size fits,
    instead of decoding with every projection left in fp32."""
    from llm_foundry.serve import load_served

    ckpt, cfg = _checkpoint(tmp_path, dim=64, hidden_dim=96)
    n = sum(isinstance(m, torch.nn.Linear) for m in Transformer(cfg).modules())
    argv = ["generate", "--checkpoint", str(ckpt), "--prompt-ids", "1,2", "--max-new-tokens", "2"]
    assert main([*argv, "--quantize", "int4", "--group-size", "128"]) == 2
    err = capsys.readouterr().err
    want = (f"{ckpt}: int4 in groups of 128 inputs quantizes none of its {n} projections: their "
            "input widths (64, 96) are not multiples of 128; --group-size 32 or 64 fits")  # fmt: skip
    assert err.count("\n") == 1 and err.rstrip("\n").endswith(want), err
    with pytest.raises(ValueError) as e:
        load_served(ckpt, quantize="int4", group_size=128)
    assert str(e.value) == want
    # a group size that fits some projections decodes as before
    assert main([*argv, "--quantize", "int4", "--group-size", "64"]) == 0
    # no group size fits: int8 is named by the flag that picks it
    small, _ = _checkpoint(tmp_path / "small", dim=48, hidden_dim=80)
    with pytest.raises(ValueError, match=r"not multiples of 64; --quantize int8 takes any width$"):
        load_served(small, quantize="int4", group_size=64)
