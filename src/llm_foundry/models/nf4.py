"""4-bit blockwise quantization of frozen weights: NF4 and double quantization (QLoRA,
Dettmers et al. 2023), the base a LoRA fine-tune holds in about an eighth of fp32's memory.

    w (out, in), flattened, in blocks of 64:   w ≈ table[code] · absmax[block]
    absmax (blocks,), double quantized:        absmax ≈ dynamic[acode] · ascale[ablock] + offset
                                               acode uint8 in blocks of 256, ascale fp32 per
                                               block of 256, offset the mean of absmax (fp32)

    bits per weight: 4 + 8/64 + 32/(64·256) = 4.127 (the paper's 4.127; 4.5 without the second
    quantization)

Grids (``GRIDS``), each sorted, with an exact zero:
- ``nf4``: NormalFloat, the 16 values of the paper's Appendix E (and bitsandbytes'): quantiles
  of N(0, 1), 8 on the positive side and 7 on the negative, normalised to [-1, 1]
  (``normal_quantile_table`` derives them);
- ``int4``: the uniform symmetric grid k/7, k = -7..7 (15 codes; code 15 unused, as int8's -128).
  models/quant.py's int4 (asymmetric per-row groups with bf16 scale and zero, for decoding
  kernels) is another scheme: this one keeps NF4's blocks and double quantization, only the grid
  differs, so the two 4-bit bases cost the same bytes and differ in the values they can hold.

Codes are the nearest grid value to w / absmax (ties to the lower one); two per byte, the first
in the high nibble. The 8-bit grid of the absmax constants is the dynamic data type of Dettmers
(2016, 8-bit approximations for parallelism): a sign, a decimal exponent 10^-6..10^0 and a
linear fraction whose resolution grows as the exponent does (``dynamic_table``). This is the
layout bitsandbytes' ``quantize_4bit(..., quant_type="nf4", compress_statistics=True)`` produces
(tests/test_nf4.py checks codes, constants and dequantized weights against it).
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import torch

BLOCK = 64  # weights per absmax constant (the paper's choice)
ABSMAX_BLOCK = 256  # absmax constants per second-level scale (the paper's choice)

# QLoRA, Appendix E: the NF4 data type's values, as bitsandbytes holds them
NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip


def normal_quantile_table() -> torch.Tensor:
    """NF4 from its definition: fp64 (16,). The quantiles of N(0, 1) at probabilities evenly
    spaced from 1 - d to 1/2, 9 of them for the positive half and 8 for the negative (each
    half's 1/2 gives the shared zero), scaled so the largest is 1. d = (1/30 + 1/32) / 2 keeps
    the outermost quantile finite (half way between the 15- and 16-level choices)."""
    d = (1 / 30 + 1 / 32) / 2
    positive = torch.special.ndtri(torch.linspace(1 - d, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(1 - d, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat((negative, torch.zeros(1, dtype=torch.float64), positive)).sort().values
    return values / values.abs().max()


def dynamic_table() -> torch.Tensor:
    """The 8-bit dynamic data type, fp32 (256,) sorted: for each decimal exponent e = 0..6, the
    midpoints of 2^e equal steps of [0.1, 1] times 10^(e - 6), with both signs (254 values),
    then 0 and 1."""
    values = [0.0, 1.0]
    for e in range(7):
        steps = torch.linspace(0.1, 1, 2**e + 1, dtype=torch.float32)
        mids = (steps[:-1] + steps[1:]) / 2 * 10.0 ** (e - 6)  # fp32 throughout
        values += mids.tolist() + (-mids).tolist()
    return torch.tensor(values, dtype=torch.float32).sort().values


GRIDS = {
    "nf4": torch.tensor(NF4_VALUES, dtype=torch.float32),
    "int4": torch.arange(-7, 8, dtype=torch.float32) / 7,
}
DYNAMIC = dynamic_table()


@cache
def _cached_table(name: str, device: torch.device) -> torch.Tensor:
    return (DYNAMIC if name == "dynamic" else GRIDS[name]).to(device)


def _table_on(name: str, device: torch.device) -> torch.Tensor:
    """``GRIDS[name]`` (or ``DYNAMIC`` for "dynamic") on ``device``, copied there once."""
    if torch.compiler.is_compiling():  # traced: a constant of the graph (dynamo warns on caches)
        return (DYNAMIC if name == "dynamic" else GRIDS[name]).to(device)
    return _cached_table(name, device)


def quantize_blockwise(
    x: torch.Tensor, table: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n,) -> (codes uint8 (blocks · block,), absmax fp32 (blocks,)), blocks = ceil(n /
    block): each block's values over its largest magnitude, coded as the nearest of ``table``
    (k,) sorted, ties to the lower; the tail past n is zeros. An all-zero block codes zeros
    (absmax 0)."""
    x = x.detach().float().flatten()
    x = torch.nn.functional.pad(x, (0, -x.numel() % block)).reshape(-1, block)
    absmax = x.abs().amax(dim=1)  # (blocks,)
    tiny = torch.finfo(torch.float32).tiny
    scaled = x / absmax.clamp(min=tiny)[:, None]  # divided by a tensor: the same on CPU and CUDA
    table = table.to(x.device)
    bounds = (table[:-1] + table[1:]) / 2  # (k - 1,) midpoints (halving is exact anywhere)
    codes = torch.bucketize(scaled.clamp(-1, 1), bounds)
    return codes.to(torch.uint8).flatten(), absmax


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor, block: int
) -> torch.Tensor:
    """codes uint8 (blocks · block,), absmax (blocks,) -> fp32 (blocks · block,):
    table[code] · absmax[block]."""
    values = table.to(codes.device)[codes.long()].reshape(-1, block)
    return (values * absmax[:, None]).flatten()


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 (2m,) -> uint8 (m,): codes 2i (high nibble) and 2i + 1 (low)."""
    return (codes[0::2] << 4) | codes[1::2]


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (m,) -> the codes uint8 (2m,), in order."""
    return torch.stack((packed >> 4, packed & 15), dim=-1).flatten()


class Quantized4bit(NamedTuple):
    """A weight of ``numel`` values, blocks = ceil(numel / BLOCK): ``packed`` uint8
    (blocks · BLOCK / 2,), ``absmax_codes`` uint8 (blocks,), ``absmax_scale`` fp32
    (ceil(blocks / ABSMAX_BLOCK),), ``absmax_offset`` fp32 (1,)."""

    packed: torch.Tensor
    absmax_codes: torch.Tensor
    absmax_scale: torch.Tensor
    absmax_offset: torch.Tensor


def quantize_4bit(w: torch.Tensor, grid: str = "nf4") -> Quantized4bit:
    """w (any shape) -> its 4-bit blockwise codes on ``GRIDS[grid]``, the absmax constants
    double quantized (their mean subtracted, the rest on the dynamic 8-bit grid in blocks of
    256)."""
    codes, absmax = quantize_blockwise(w, GRIDS[grid], BLOCK)
    offset = absmax.mean().reshape(1)
    absmax_codes, absmax_scale = quantize_blockwise(absmax - offset, DYNAMIC, ABSMAX_BLOCK)
    absmax_codes = absmax_codes[: absmax.numel()].clone()  # its own storage, not a view (files)
    return Quantized4bit(pack_nibbles(codes), absmax_codes, absmax_scale, offset)


def dequantize_absmax(
    absmax_codes: torch.Tensor, absmax_scale: torch.Tensor, absmax_offset: torch.Tensor
) -> torch.Tensor:
    """The absmax constants fp32 (blocks,) back from their 8-bit codes: dynamic[code] ·
    scale[block of 256] + offset."""
    blocks = absmax_codes.numel()
    codes = torch.nn.functional.pad(absmax_codes, (0, -blocks % ABSMAX_BLOCK))
    dynamic = _table_on("dynamic", codes.device)
    absmax = dequantize_blockwise(codes, absmax_scale, dynamic, ABSMAX_BLOCK)[:blocks]
    return absmax + absmax_offset


def dequantize_4bit(q: Quantized4bit, shape: torch.Size | tuple, grid: str = "nf4") -> torch.Tensor:
    """``quantize_4bit``'s output -> fp32 ``shape``: grid[code] · absmax[block], the absmax
    constants dequantized first."""
    absmax = dequantize_absmax(q.absmax_codes, q.absmax_scale, q.absmax_offset)
    w = dequantize_blockwise(
        unpack_nibbles(q.packed), absmax, _table_on(grid, q.packed.device), BLOCK
    )
    return w[: torch.Size(shape).numel()].reshape(shape)
