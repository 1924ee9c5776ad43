"""RMSNorm and LayerNorm against their formulas."""

import torch

from llm_foundry.config import ModelConfig
from llm_foundry.models.norm import RMSNorm, build_norm, rms_norm


def test_rmsnorm_formula():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    w = torch.randn(16, dtype=torch.float64)
    expected = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(rms_norm(x, w, 1e-6), expected)
    norm = RMSNorm(16, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(w)
    torch.testing.assert_close(norm(x), expected)


def test_rmsnorm_output_has_unit_rms_and_is_scale_invariant():
    x = torch.randn(4, 64)
    y = RMSNorm(64, eps=0.0)(x)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(4))
    torch.testing.assert_close(RMSNorm(64, eps=0.0)(10 * x), y)


def test_layernorm_formula():
    torch.manual_seed(0)
    cfg = ModelConfig(dim=16, n_heads=2, norm="layernorm", norm_eps=1e-5)
    norm = build_norm(cfg)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(2, 7, 16)
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    expected = (x - mean) / torch.sqrt(var + 1e-5) * norm.weight + norm.bias
    torch.testing.assert_close(norm(x), expected)


def test_factory_and_parameter_counts():
    rms = build_norm(ModelConfig(dim=32, n_heads=4, norm="rmsnorm"))
    ln = build_norm(ModelConfig(dim=32, n_heads=4, norm="layernorm"))
    assert sum(p.numel() for p in rms.parameters()) == 32  # scale only
    assert sum(p.numel() for p in ln.parameters()) == 64  # scale and shift
    ln_nobias = build_norm(ModelConfig(dim=32, n_heads=4, norm="layernorm", norm_bias=False))
    assert sum(p.numel() for p in ln_nobias.parameters()) == 32
