"""Position encodings: RoPE relativity and scaling, ALiBi slopes, sinusoidal table, learned limits."""

import math

import pytest
import torch

from llm_foundry.config import ModelConfig
from llm_foundry.models import Transformer
from llm_foundry.models.position import (
    alibi_slopes,
    apply_rope,
    build_position,
    rope_cos_sin,
    rope_inv_freq,
    sinusoidal_table,
)


def rope_at(x, pos, inv_freq):
    cos, sin = rope_cos_sin(torch.tensor([pos]), inv_freq)
    return apply_rope(x, cos, sin)


def test_rope_dot_product_depends_only_on_offset():
    torch.manual_seed(0)
    hd = 16
    inv_freq = rope_inv_freq(hd, 10000.0).double()
    q, k = (
        torch.randn(1, 1, 1, hd, dtype=torch.float64),
        torch.randn(1, 1, 1, hd, dtype=torch.float64),
    )

    def score(m, n):
        return (rope_at(q, m, inv_freq) * rope_at(k, n, inv_freq)).sum().item()

    for offset in (0, 1, 5, 37):
        values = [score(m + offset, m) for m in (0, 3, 100, 1000)]
        assert max(values) - min(values) < 1e-9, (offset, values)
    assert abs(score(5, 0) - score(6, 0)) > 1e-6  # but it does depend on the offset


def test_rope_preserves_norm_and_is_identity_at_zero():
    x = torch.randn(2, 3, 4, 8)
    inv_freq = rope_inv_freq(8, 10000.0)
    cos, sin = rope_cos_sin(torch.arange(4), inv_freq)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])


def test_rope_rotate_half_layout():
    # feature i pairs with i + hd/2 (HF LLaMA layout), not with i + 1 (the paper's interleaving)
    hd = 4
    inv_freq = rope_inv_freq(hd, 10000.0)
    x = torch.tensor([1.0, 0.0, 0.0, 0.0]).view(1, 1, 1, hd)
    y = rope_at(x, 1, inv_freq).flatten()
    assert y[0] == pytest.approx(math.cos(1.0)) and y[2] == pytest.approx(math.sin(1.0))
    assert y[1] == 0 and y[3] == 0


def test_rope_scaling():
    base = rope_inv_freq(64, 10000.0)
    torch.testing.assert_close(rope_inv_freq(64, 10000.0, "linear", 4.0), base / 4)
    ntk = rope_inv_freq(64, 10000.0, "ntk", 4.0)
    assert ntk[0] == pytest.approx(1.0)  # the fastest rotation is untouched
    assert ntk[-1] == pytest.approx(base[-1].item() / 4, rel=0.02)  # the slowest ~ interpolated


def test_rope_cache_grows_past_max_seq_len():
    cfg = ModelConfig(vocab_size=11, dim=16, n_layers=1, n_heads=2, max_seq_len=8)
    pos = build_position(cfg)
    q = torch.randn(1, 2, 20, 8)
    q2, _ = pos.rotate(q, q, 0)
    assert pos.cos.shape[0] >= 20
    inv = rope_inv_freq(8, 10000.0)
    cos, sin = rope_cos_sin(torch.arange(20), inv)
    torch.testing.assert_close(q2, apply_rope(q, cos, sin))


def test_alibi_slopes_eight_heads():
    expected = torch.tensor([2.0 ** -(i + 1) for i in range(8)])  # 1/2 ... 1/256
    torch.testing.assert_close(alibi_slopes(8), expected)


def paper_slopes(n):
    """The ALiBi paper's recipe, written independently: geometric for powers of two, else the
    closest lower power of two plus every other slope of the next one."""

    def pow2(n):
        return [2 ** (-8 * (i + 1) / n) for i in range(n)]

    if math.log2(n).is_integer():
        return pow2(n)
    closest = 2 ** int(math.log2(n))
    return pow2(closest) + pow2(2 * closest)[::2][: n - closest]


@pytest.mark.parametrize("n", range(1, 64))
def test_alibi_slopes_any_head_count(n):
    torch.testing.assert_close(alibi_slopes(n), torch.tensor(paper_slopes(n)))


def test_alibi_bias_is_linear_in_distance():
    cfg = ModelConfig(vocab_size=11, dim=16, n_layers=1, n_heads=4, pos_encoding="alibi")
    bias = build_position(cfg).bias(torch.arange(5), torch.arange(5))
    assert bias.shape == (4, 5, 5)
    slopes = alibi_slopes(4)
    assert bias[1, 4, 1].item() == pytest.approx(-3 * slopes[1].item())
    assert bias[0, 3, 3].item() == 0.0


def test_sinusoidal_table():
    table = sinusoidal_table(torch.arange(10), 8)
    assert table.shape == (10, 8)
    assert table[3, 0].item() == pytest.approx(math.sin(3.0), abs=1e-6)
    assert table[3, 1].item() == pytest.approx(math.cos(3.0), abs=1e-6)
    assert table[3, 2].item() == pytest.approx(math.sin(3 / 10000 ** (2 / 8)), abs=1e-6)


def test_learned_positions_refuse_past_table_with_explanation():
    cfg = ModelConfig(
        vocab_size=11, dim=16, n_layers=1, n_heads=2, max_seq_len=8, pos_encoding="learned"
    )
    model = Transformer(cfg)
    model(torch.zeros(1, 8, dtype=torch.long))  # at the limit: fine
    with pytest.raises(ValueError, match="past max_seq_len=8") as e:
        model(torch.zeros(1, 9, dtype=torch.long))
    assert "rope" in str(e.value) and "alibi" in str(e.value)


@pytest.mark.parametrize("pe", ["rope", "alibi", "none", "sinusoidal"])
def test_relative_and_fixed_positions_run_past_max_seq_len(pe):
    cfg = ModelConfig(vocab_size=11, dim=16, n_layers=1, n_heads=2, max_seq_len=8, pos_encoding=pe)
    logits, _ = Transformer(cfg)(torch.zeros(1, 20, dtype=torch.long))
    assert logits.shape == (1, 20, 11) and torch.isfinite(logits).all()
