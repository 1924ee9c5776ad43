"""FP8 products for training (models/fp8.py, ``train.dtype fp8``), checked on the CPU, whose
torch._scaled_mm computes float8 products exactly (oneDNN): the forward and both gradients equal
the products of the dequantized operands, every call is laid out as cuBLAS needs it on a GPU,
training follows bf16, and a device without FP8 tensor cores is refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llm_foundry.config import ConfigError
from llm_foundry.models import Transformer
from llm_foundry.models import fp8 as F8
from llm_foundry.models.linear import Linear
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.distributed import World
from llm_foundry.train.precision import AUTOCAST_DTYPES, check_fp8, choose_precision


def _cpu_fp8_matmul() -> str | None:
    """Why this CPU cannot run float8 torch._scaled_mm (oneDNN), or None when it can."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as e:
        return f"torch._scaled_mm has no float8 kernel on this CPU: {str(e).splitlines()[0]}"
    return None


pytestmark = pytest.mark.skipif(_cpu_fp8_matmul() is not None, reason=str(_cpu_fp8_matmul()))

M, K, N = 48, 64, 32


def _operands(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 3).requires_grad_()
    w = (torch.randn(N, K, generator=g) * 0.05).requires_grad_()
    dy = torch.randn(M, N, generator=g) * 1e-3
    return x, w, dy


def test_quantize_scales_by_a_power_of_two_into_the_range_and_saturates():
    t = torch.tensor([0.0, 1e-3, -2.5, 300.0])
    q, inv = F8.quantize(t, F8.E4M3)
    scale = 1 / inv.item()
    assert scale == 2.0 ** round(torch.log2(torch.tensor(scale)).item())  # a power of two
    assert 448 / 2 < 300 * scale <= 448  # the largest one that keeps amax in range
    assert q.dtype == F8.E4M3 and (q.float() * inv).sub(t).abs().max() <= 300 * 2**-4
    q, inv = F8.quantize(torch.zeros(3), F8.E5M2)
    assert (q.float() == 0).all() and inv > 0
    q, _ = F8.quantize(torch.tensor([1.0, 1e30]), F8.E4M3)
    assert q.float().abs().max() <= 448  # saturated, never inf


def test_forward_and_gradients_are_the_products_of_the_dequantized_operands():
    """y = deq(x8) deq(w8)^T, dx = deq(dy8) deq(w8), dW = deq(dy8)^T deq(x8): the fp8 products
    add nothing but the output's rounding (bf16 for y and dx, fp32 for dW)."""
    x, w, dy = _operands()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = F8.fp8_linear(x, w)
    assert y.dtype == torch.bfloat16
    y.backward(dy.bfloat16())
    x8, xi = F8.quantize(x.detach().bfloat16(), F8.E4M3)
    w8, wi = F8.quantize(w.detach(), F8.E4M3)
    g8, gi = F8.quantize(dy.bfloat16(), F8.E5M2)
    dx, dw, dg = x8.double() * xi, w8.double() * wi, g8.double() * gi
    ref_y, ref_dx, ref_dw = dx @ dw.t(), dg @ dw, dg.t() @ dx
    torch.testing.assert_close(y.double(), ref_y, rtol=2**-8, atol=1e-6 * ref_y.abs().max().item())
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad.double(), ref_dx, rtol=2**-8, atol=1e-12)
    torch.testing.assert_close(w.grad.double(), ref_dw, rtol=1e-6, atol=1e-12)  # fp32 out
    ref = F8.fp8_linear_reference(x.detach().bfloat16(), w.detach())
    torch.testing.assert_close(y.float(), ref, rtol=2**-8, atol=1e-5)


def test_fp8_products_are_close_to_bf16_ones():
    """e4m3 keeps 3 mantissa bits: single products err by up to 2^-4, a dot product of 64 of
    them by a few percent of its scale, not more."""
    x, w, _ = _operands(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y8 = F8.fp8_linear(x, w).float()
    y = F.linear(x, w).detach()
    assert (y8 - y).norm() / y.norm() < 0.05


def _cublas_rules(a, b, scale_a, scale_b, out_dtype, use_fast_accum):
    """What cuBLAS's FP8 matmul (torch._scaled_mm on a GPU) refuses, checked on the CPU."""
    assert a.dim() == b.dim() == 2 and a.shape[1] == b.shape[0]
    assert a.is_contiguous(), "first operand must be row-major"
    assert b.t().is_contiguous(), "second operand must be column-major"
    assert all(d % 16 == 0 for d in (*a.shape, b.shape[1])), (a.shape, b.shape)
    assert {a.dtype, b.dtype} <= {F8.E4M3, F8.E5M2} and (a.dtype, b.dtype) != (F8.E5M2,) * 2
    assert scale_a.dtype == scale_b.dtype == torch.float32 and scale_a.numel() == 1
    assert scale_b.numel() == 1 and out_dtype in (torch.bfloat16, torch.float32)
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)  # fmt: skip


def _model(tiny_config, **fields):
    torch.manual_seed(0)
    return Transformer(tiny_config(**{"vocab_size": 64, **fields}))


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_a_converted_models_products_are_laid_out_as_cublas_needs(tiny_config, monkeypatch, mlp):
    calls = []

    def strict(a, b, **kw):
        calls.append((a.dtype, b.dtype))
        return _cublas_rules(a, b, **kw)

    monkeypatch.setattr(F8, "scaled_mm", strict)
    model = _model(tiny_config, mlp=mlp, hidden_dim=64)
    n = F8.convert_to_fp8(model)
    idx = torch.randint(0, 64, (2, 16))  # 32 rows
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, idx)[1]
    loss.backward()
    assert len(calls) == 3 * n  # forward, dx, dW of every converted layer
    assert (F8.E5M2, F8.E4M3) in calls and (F8.E5M2, F8.E5M2) not in calls


def test_conversion_keeps_the_head_the_parameters_and_eval_in_bf16(tiny_config):
    model = _model(tiny_config, hidden_dim=64)
    plain = _model(tiny_config, hidden_dim=64)
    keys = list(model.state_dict())
    n = F8.convert_to_fp8(model)
    kinds = {type(m) for m in model.layers.modules() if isinstance(m, Linear)}
    assert n == 2 * 7 and kinds == {F8.Fp8Linear}  # wq wk wv wo w1 w2 w3 in each block
    assert type(model.lm_head) is Linear  # the head stays bf16
    assert list(model.state_dict()) == keys  # checkpoints do not know
    model.eval()
    plain.eval()
    idx = torch.randint(0, 64, (2, 10))
    torch.testing.assert_close(model(idx)[0], plain(idx)[0], rtol=0, atol=0)
    model.train()  # 20 rows: not a multiple of 16, so this step multiplies in bf16
    assert not F8.fits(20, model.layers[0].mlp.w1) and F8.fits(32, model.layers[0].mlp.w1)
    odd = _model(tiny_config)  # SwiGLU's default hidden size here, 85: its layers stay bf16
    F8.convert_to_fp8(odd)
    assert type(odd.layers[0].mlp.w1) is Linear and type(odd.layers[0].attn.wq) is F8.Fp8Linear


def test_training_in_fp8_follows_bf16(tiny_config):
    """30 AdamW steps on one batch: the loss falls as in bf16, within a few percent."""
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3))
    losses = {}
    for fp8 in (False, True):
        model = _model(tiny_config, hidden_dim=64)
        if fp8:
            F8.convert_to_fp8(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        run = []
        for _ in range(30):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses[fp8] = run
    first, last = losses[False][0], losses[False][-1]
    assert last < 0.8 * first  # it learns
    assert abs(losses[True][-1] - last) < 0.05 * last


def test_fp8_is_refused_without_fp8_tensor_cores_in_one_line():
    tc = TrainConfig(dtype="fp8")
    with pytest.raises(ValueError) as e:
        choose_precision(tc, torch.device("cpu"), World())
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("train.dtype=fp8 needs FP8 tensor cores")
    assert "compute capability 8.9+" in msg and "this run is on the CPU (" in msg
    assert msg.endswith("use train.dtype bf16 (or auto)")
    with pytest.raises(ValueError, match="this run is on mps"):
        check_fp8("mps")
    assert AUTOCAST_DTYPES["fp8"] == torch.bfloat16
    with pytest.raises(ConfigError, match="dtype='fp8' with parallel='tp'"):
        TrainConfig(dtype="fp8", parallel="tp")


def test_a_run_with_fp8_builds_fp8_layers(tiny_config):
    from llm_foundry.train.build import build_model

    model = build_model(tiny_config(vocab_size=64), TrainConfig(dtype="fp8"), torch.device("cpu"))
    assert any(isinstance(m, F8.Fp8Linear) for m in model.modules())
    model = build_model(tiny_config(vocab_size=64), TrainConfig(dtype="bf16"), torch.device("cpu"))
    assert not any(isinstance(m, F8.Fp8Linear) for m in model.modules())
