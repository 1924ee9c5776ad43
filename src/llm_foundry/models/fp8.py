"""FP8 matrix products for training (``train.dtype fp8``): the blocks' linear layers multiply in
float8 on GPUs with FP8 tensor cores (compute capability 8.9+: Ada, Hopper), everything else
runs under bf16 autocast as ``train.dtype bf16`` does.

The recipe is torchao's float8 training "tensorwise" one (dynamic scaling, one scale per tensor),
written out here on ``torch._scaled_mm``: each of a linear layer's three products

    forward   y  = x  W^T      x, W in e4m3 (3 mantissa bits, range 448)
    backward  dx = dy W        dy in e5m2 (2 mantissa bits, range 57344: gradients' spread)
              dW = dy^T x

quantizes its operands just before it, with scale = 2^floor(log2(fp8 max / amax)) (a power of
two: scaling is exact, and the same in eager and compiled code), saturating, and passes the
inverse scales to ``_scaled_mm``, which multiplies in fp8 and accumulates in fp32 (the forward
with cuBLAS's fast accumulation, the backward without, as torchao). y and dx come out bf16, dW
fp32 (the weights' dtype). Master weights, optimizer state, norms, attention's softmax, the
embedding, the output head and the loss stay as they are under bf16 autocast; the head is left
in bf16 as torchao's recipes advise for the last layer (and the fused loss needs it whole).

Layouts cuBLAS asks for: the first operand row-major, the second column-major, every dimension a
multiple of 16. A layer whose sizes do not divide (or a batch whose rows do not) multiplies in
bf16 that step. Only in training mode: evaluation and generation use the bf16 product.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from llm_foundry.models.linear import Linear

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
ALIGN = 16  # cuBLAS FP8 kernels: every dimension a multiple of 16
# the product itself, a module attribute so that tests can check the layouts cuBLAS needs
scaled_mm = torch._scaled_mm


def quantize(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t in ``dtype``, the inverse scale as an fp32 scalar): t x scale saturated to the fp8
    range, scale the largest power of two that keeps max |t| inside it (1 for an all-zero t)."""
    big = torch.finfo(dtype).max
    amax = t.detach().abs().amax().float()
    exp = torch.floor(torch.log2(big / amax.clamp(min=1e-30)))
    scale = torch.exp2(exp.clamp(-126, 126))
    q = (t.float() * scale).clamp(-big, big).to(dtype)
    return q, scale.reciprocal()


def column_major(t: torch.Tensor) -> torch.Tensor:
    """t (rows, cols) with the same values laid out column by column."""
    return t.t().contiguous().t()


class _Fp8Matmul(torch.autograd.Function):
    """x (M, K) @ W (N, K)^T -> (M, N) in ``out_dtype``, the three products in fp8."""

    @staticmethod
    def forward(ctx, x, weight, out_dtype):
        x8, x_inv = quantize(x, E4M3)
        w8, w_inv = quantize(weight, E4M3)
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.dtypes = (x.dtype, weight.dtype)
        # w8 (N, K) row-major: its transpose is the column-major (K, N) cuBLAS wants
        return scaled_mm(x8, w8.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=out_dtype,
                         use_fast_accum=True)  # fmt: skip

    @staticmethod
    def backward(ctx, grad):
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g8, g_inv = quantize(grad.contiguous(), E5M2)
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dy (M, N) @ W (N, K)
            dx = scaled_mm(g8, column_major(w8), scale_a=g_inv, scale_b=w_inv,
                           out_dtype=grad.dtype, use_fast_accum=False).to(x_dtype)  # fmt: skip
        if ctx.needs_input_grad[1]:  # dy^T (N, M) @ x (M, K)
            dw = scaled_mm(g8.t().contiguous(), column_major(x8), scale_a=g_inv, scale_b=x_inv,
                           out_dtype=torch.float32, use_fast_accum=False).to(w_dtype)  # fmt: skip
        return dx, dw, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear(x, weight, bias) with the products in fp8; x (..., K), weight (N, K). Output in
    autocast's dtype where autocast is on (bf16), else x's."""
    kind = x.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    x2 = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()
    y = _Fp8Matmul.apply(x2, weight, dtype).reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias.to(y.dtype)


def fits(rows: int, layer: nn.Linear) -> bool:
    """Whether cuBLAS can multiply this layer's products in fp8 for ``rows`` input rows."""
    return all(d % ALIGN == 0 for d in (rows, layer.in_features, layer.out_features))


class Fp8Linear(Linear):
    """``Linear`` whose training-mode products run in fp8 (``fp8_linear``); its parameters and
    state dict are Linear's, so checkpoints do not know it was used."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and fits(x.shape[:-1].numel(), self):
            return fp8_linear(x, self.weight, self.bias)
        return super().forward(x)


def convert_to_fp8(model: nn.Module) -> int:
    """Make every plain ``Linear`` inside the model's blocks (``model.layers``: attention and MLP
    projections, LoRA's frozen bases too; not the output head) an ``Fp8Linear``, in place, the
    same parameters kept; returns how many. Layers whose sizes are not multiples of 16 stay."""
    n = 0
    for module in model.layers.modules():
        if type(module) is Linear and fits(ALIGN, module):
            module.__class__ = Fp8Linear
            n += 1
    return n


def fp8_linear_reference(x, weight, bias=None):
    """What ``fp8_linear`` computes, in fp32 from the dequantized operands (tests compare the two;
    the products themselves differ only by accumulation order and the output's rounding)."""
    x8, x_inv = quantize(x.reshape(-1, x.shape[-1]), E4M3)
    w8, w_inv = quantize(weight, E4M3)
    y = F.linear(x8.float() * x_inv, w8.float() * w_inv).reshape(*x.shape[:-1], -1)
    return y if bias is None else y + bias.float()
