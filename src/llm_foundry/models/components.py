"""Components of a decoder-only Transformer: norms, positions, attention, MLPs and the block.

Math lives in pure functions (shapes in each docstring); ``nn.Module`` classes wire them up and
hold parameters. Each variant family has one small factory keyed by its config field
(``build_norm``, ``build_position``, ``build_mlp``, ``build_block``), so forward passes never
branch on the config.

Shape letters: B batch, T query length, S key length, D model width (``dim``), H query heads,
K key/value heads, hd head width.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from llm_foundry.config import ModelConfig

# ----------------------------------------------------------------------------------------------
# Normalisation


def matvec(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for a single row x (..., 1 row, in) as a multiply-and-sum: under
    torch.compile it becomes one fused, vectorised reduction that streams the weight faster than
    a BLAS gemv call on CPU (benchmarks/README.md, bench_generate)."""
    return (x.unsqueeze(-2) * weight).sum(-1)


class Linear(nn.Linear):
    """nn.Linear whose one-token (decode) case, when compiled, is ``matvec``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and x.shape[:-1].numel() == 1 and x.device.type == "cpu":
            y = matvec(x, self.weight)  # the shape test is static: resolved at trace time
            return y if self.bias is None else y + self.bias
        return super().forward(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight. x: (..., D)."""
    # in fp32: the mean of squares overflows in fp16 and loses precision in bf16
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)  # one op (on CPU: several kernels)
    return weight * normed.type_as(x)


class RMSNorm(nn.Module):
    """Scale-only normalisation: no mean subtraction and no bias (LLaMA, Mistral, Qwen3)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def build_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """The normalisation layer named by ``cfg.norm`` over ``dim`` (default ``cfg.dim``) features."""
    dim = dim or cfg.dim
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.norm_bias)


# ----------------------------------------------------------------------------------------------
# Positions: each kind acts at one of three places (embedding, q/k rotation, attention bias);
# the base class makes the other two no-ops, so the model calls all three unconditionally.


def sinusoidal_table(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """Fixed sin/cos positions (Vaswani et al. 2017): even features sin, odd cos. pos: (T,) -> (T, D)."""
    inv_freq = torch.exp(torch.arange(0, dim, 2, device=pos.device) * (-math.log(10000.0) / dim))
    angles = pos.float()[:, None] * inv_freq[None, :]  # (T, D/2)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # interleave sin, cos


def rope_inv_freq(head_dim: int, theta: float, scaling: str = "none", factor: float = 1.0):
    """RoPE rotation speeds theta^(-2i/hd), i < hd/2 (Su et al. 2021), optionally rescaled.

    linear: divide every speed by ``factor`` (position interpolation, Chen et al. 2023).
    ntk: raise the base to theta * factor^(hd/(hd-2)) (NTK-aware scaling, bloc97 2023), which
    stretches slow dimensions and leaves the fastest almost untouched. Returns (hd/2,).
    """
    if scaling == "ntk":
        theta = theta * factor ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling == "linear":
        inv_freq = inv_freq / factor
    return inv_freq.float()


def rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles in rotate-half layout. pos: (T,) -> two (T, hd)."""
    angles = pos.to(inv_freq.dtype)[:, None] * inv_freq[None, :]  # (T, hd/2)
    angles = torch.cat((angles, angles), dim=-1)  # feature i pairs with i + hd/2 (HF LLaMA layout)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + hd/2) feature pair by its angle. x: (B, H, T, hd); cos, sin: (T, hd)."""
    return (x * cos + rotate_half(x) * sin).type_as(x)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi head slopes (Press et al. 2022): 2^(-8/n), 2^(-16/n), ... for n a power of two.

    Other counts take the slopes of the nearest lower power of two, then every other slope of the
    next power of two, as the paper prescribes. Returns (H,).
    """

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    low = 2 ** math.floor(math.log2(n_heads))
    slopes = geometric(low) + geometric(2 * low)[0::2][: n_heads - low]
    return torch.tensor(slopes)


class NoPosition(nn.Module):
    """No explicit positions (NoPE): the causal mask alone tells tokens apart.

    The new tokens' positions arrive as a Python int ``start`` (the first of T contiguous ones),
    so nothing is read back from a tensor and ``torch.compile`` sees no graph break.
    """

    has_bias = False  # whether ``bias`` returns a tensor
    max_positions: int | None = None  # positions it can encode; None: any

    def embed(self, x: torch.Tensor, start: int, pad: torch.Tensor | None = None) -> torch.Tensor:
        """Add absolute positions start..start+T-1 to the embeddings x: (B, T, D); row b counts
        from its first real token when ``pad`` (B,) says it has pad[b] left-padding tokens."""
        return x

    def rotate(self, q: torch.Tensor, k: torch.Tensor, start: int):
        """Rotate q: (B, H, T, hd) and k: (B, K, T, hd) at positions start..start+T-1."""
        return q, k

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """Additive attention bias (H, T, S) for query positions (T,) and key positions (S,)."""
        return None

    def reserve(self, length: int) -> None:
        """Prepare for positions 0..length-1 ahead of use (a compiled decode step then never
        rebuilds a cache)."""


def _row_positions(start: int, T: int, pad: torch.Tensor, limit: int | None = None):
    """Per-row positions (B, T) of left-padded rows: slot start + t of row b is position
    start + t - pad[b] (pads clamp to 0; they are masked out anyway)."""
    pos = (torch.arange(start, start + T, device=pad.device)[None] - pad[:, None]).clamp(min=0)
    # slots inside the table need no read-back of pad (a graph break under torch.compile)
    if limit is not None and start + T > limit and start + T - int(pad.min()) > limit:
        raise ValueError(
            f"position {start + T - 1 - int(pad.min())} is past max_seq_len={limit}: learned "
            "absolute positions have no row beyond it; use a shorter input or rope/alibi"
        )
    return pos


class LearnedPosition(NoPosition):
    """A trained table of max_seq_len position vectors (GPT-2); it has no row past the end."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.max_positions = cfg.max_seq_len  # one trained row per position
        self.emb = nn.Embedding(cfg.max_seq_len, cfg.dim)

    def embed(self, x, start, pad=None):
        end = start + x.shape[1]
        if pad is not None:
            return x + self.emb(_row_positions(start, x.shape[1], pad, self.max_positions))
        if end > self.max_positions:
            raise ValueError(
                f"position {end - 1} is past max_seq_len={self.max_positions}: learned absolute "
                f"positions are a table with one trained row per position 0..{self.max_positions - 1} "
                "and nothing beyond it. Use a shorter input, or a model with pos_encoding='rope' "
                "or 'alibi' (relative positions that run past the training length)."
            )
        return x + self.emb(torch.arange(start, end, device=x.device))


class SinusoidalPosition(NoPosition):
    """Fixed sin/cos table added to the embeddings; defined for any position, nothing to train."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dim = cfg.dim

    def embed(self, x, start, pad=None):
        if pad is not None:
            pos = _row_positions(start, x.shape[1], pad)  # (B, T)
            table = sinusoidal_table(pos.flatten(), self.dim).view(*pos.shape, self.dim)
            return x + table.to(x.dtype)
        pos = torch.arange(start, start + x.shape[1], device=x.device)
        return x + sinusoidal_table(pos, self.dim).to(x.dtype)


ROPE_BLOCK = 64  # positions whose cos/sin are computed together


class RotaryPosition(NoPosition):
    """RoPE: rotate q and k by position-dependent angles so q_m . k_n depends on m - n only."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv_freq = rope_inv_freq(cfg.head_size, cfg.rope_theta, cfg.rope_scaling, cfg.rope_factor)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def _grow(self, length: int) -> None:
        """Extend the cos/sin cache to cover positions 0..length-1, doubling, in blocks of
        ``ROPE_BLOCK`` positions: sized by use, not by max_seq_len, and a position's values never
        depend on the cache size (each block is one same-shaped computation, never redone)."""
        have = self.cos.shape[0] if self.cos.device == self.inv_freq.device else 0
        n = max(length, 2 * have)
        n = -(-n // ROPE_BLOCK) * ROPE_BLOCK
        dev = self.inv_freq.device
        new = [
            rope_cos_sin(torch.arange(s, s + ROPE_BLOCK, device=dev), self.inv_freq)
            for s in range(have, n, ROPE_BLOCK)
        ]
        self.cos = torch.cat([self.cos[:have].to(dev)] + [c for c, _ in new])
        self.sin = torch.cat([self.sin[:have].to(dev)] + [s for _, s in new])

    def reserve(self, length: int) -> None:
        if self.cos.shape[0] < length or self.cos.device != self.inv_freq.device:
            self._grow(length)

    def rotate(self, q, k, start):
        end = start + q.shape[2]
        if self.cos.shape[0] < end or self.cos.device != q.device:
            self._grow(end)
        cos, sin = self.cos[start:end].to(q.dtype), self.sin[start:end].to(q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class AlibiPosition(NoPosition):
    """ALiBi: no embedding; each head adds slope * (key_pos - query_pos) to its attention scores."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # on the meta device (shape checks) the values are not needed: skip the per-head loop
        meta = torch.empty(0).is_meta
        slopes = torch.empty(cfg.n_heads) if meta else alibi_slopes(cfg.n_heads)
        self.register_buffer("slopes", slopes, persistent=False)

    has_bias = True

    def bias(self, q_pos, k_pos):
        distance = (k_pos[None, :] - q_pos[:, None]).to(self.slopes.dtype)  # (T, S), <= 0: past
        return self.slopes[:, None, None] * distance[None]  # (H, T, S)


POSITIONS = {
    "none": lambda cfg: NoPosition(),
    "learned": LearnedPosition,
    "sinusoidal": SinusoidalPosition,
    "rope": RotaryPosition,
    "alibi": AlibiPosition,
}


def build_position(cfg: ModelConfig) -> NoPosition:
    return POSITIONS[cfg.pos_encoding](cfg)


# ----------------------------------------------------------------------------------------------
# Attention


def attention_mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive mask (1 or H, T, S): 0 where query i may see key j (k_pos[j] <= q_pos[i] and
    q_pos[i] - k_pos[j] < window), -inf elsewhere, plus ``bias``. q_pos: (T,), k_pos: (S,).
    Keys may come in any order (a sliding-window cache stores them in a ring)."""
    diff = q_pos[:, None] - k_pos[None, :]  # (T, S): how far back key j lies from query i
    allowed = diff >= 0
    if window is not None:
        allowed &= diff < window
    dtype = bias.dtype if bias is not None else torch.float32
    mask = torch.zeros(allowed.shape, dtype=dtype, device=q_pos.device)
    mask = mask.masked_fill(~allowed, float("-inf"))[None]  # (1, T, S)
    return mask if bias is None else mask + bias


def padding_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """Additive mask (B, 1, T, S) hiding left-padding keys: row b's positions < pad[b] are pads.
    A pad query still sees itself, so its softmax has one finite term (no NaN in the cache)."""
    is_pad = k_pos[None, :] < pad[:, None]  # (B, S)
    itself = q_pos[:, None] == k_pos[None, :]  # (T, S)
    hide = is_pad[:, None, :] & ~itself[None]  # (B, T, S)
    zeros = torch.zeros(hide.shape, device=hide.device)
    return zeros.masked_fill(hide, float("-inf"))[:, None]


def manual_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(hd) + mask) v, spelled out so the weights can be returned.

    q: (B, H, T, hd); k, v: (B, K, S, hd) with H a multiple of K (query head h reads KV head
    h // (H/K)). Returns out (B, H, T, hd) and weights (B, H, T, S).
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, S, hd)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    if mask is None:  # plain causal
        T, S = scores.shape[-2:]
        causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        scores = scores.masked_fill(~causal, float("-inf"))
    else:
        scores = scores + mask.to(scores.dtype)
    weights = torch.softmax(scores.float(), dim=-1).type_as(q)
    out = F.dropout(weights, dropout_p) @ v if dropout_p > 0 else weights @ v
    return out, weights


def sdpa_attention(q, k, v, mask, dropout_p: float = 0.0) -> tuple[torch.Tensor, None]:
    """The same as ``manual_attention`` through PyTorch's fused kernels (flash / memory-efficient
    on GPU); GQA runs without materialising repeated K/V. Returns out (B, H, T, hd), None."""
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=None if mask is None else mask.to(q.dtype),
        dropout_p=dropout_p,
        is_causal=mask is None,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out, None


ATTENTION_IMPLS = {"sdpa": sdpa_attention, "manual": manual_attention}


class Attention(nn.Module):
    """Causal self-attention with H query heads sharing K key/value heads (MHA, GQA, MQA)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_size
        q_dim, kv_dim = cfg.n_heads * self.head_dim, cfg.n_kv_heads * self.head_dim
        self.wq = Linear(cfg.dim, q_dim, bias=cfg.attn_bias)
        self.wk = Linear(cfg.dim, kv_dim, bias=cfg.attn_bias)
        self.wv = Linear(cfg.dim, kv_dim, bias=cfg.attn_bias)
        self.wo = Linear(q_dim, cfg.dim, bias=cfg.attn_bias)
        # QK-norm (Qwen3): normalise each head's q and k, bounding the logits before softmax
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.impl = ATTENTION_IMPLS[cfg.attn_impl]
        self.dropout = cfg.dropout

    def forward(self, x, pos, start, mask, need_weights: bool = False, kv=None):
        """x: (B, T, D) -> (B, T, D) and the weights (B, H, T, S) when ``need_weights``.
        ``kv`` = (cache, layer index) stores this step's keys/values and reads the earlier ones."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2)  # (B, H|K, T, hd)
        q, k = pos.rotate(q, k, start)
        v = v.transpose(1, 2)
        if kv is not None:
            cache, layer = kv
            k, v = cache.update(layer, k, v, start)  # (B, K, S, hd)
        impl = manual_attention if need_weights else self.impl
        out, weights = impl(q, k, v, mask, self.dropout if self.training else 0.0)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.wo(out), weights


# ----------------------------------------------------------------------------------------------
# MLPs


class MLP(nn.Module):
    """Two matrices: w2(act(w1 x)) with a 4x-wide hidden layer (GPT-2, BLOOM, Falcon)."""

    def __init__(self, cfg: ModelConfig, act):
        super().__init__()
        self.w1 = Linear(cfg.dim, cfg.ffn_dim, bias=cfg.mlp_bias)
        self.w2 = Linear(cfg.ffn_dim, cfg.dim, bias=cfg.mlp_bias)
        self.act = act

    def forward(self, x):
        return self.w2(self.act(self.w1(x)))


class GatedMLP(nn.Module):
    """Three matrices: w2(act(w1 x) * w3 x) (Shazeer 2020: SwiGLU with SiLU, GeGLU with GELU).

    The hidden width is 2/3 of the two-matrix MLP's so the parameter count stays the same.
    """

    def __init__(self, cfg: ModelConfig, act):
        super().__init__()
        self.w1 = Linear(cfg.dim, cfg.ffn_dim, bias=cfg.mlp_bias)  # gate
        self.w3 = Linear(cfg.dim, cfg.ffn_dim, bias=cfg.mlp_bias)  # up
        self.w2 = Linear(cfg.ffn_dim, cfg.dim, bias=cfg.mlp_bias)  # down
        self.act = act

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


MLPS = {
    "gelu": lambda cfg: MLP(cfg, partial(F.gelu, approximate=cfg.gelu_approx)),
    "relu": lambda cfg: MLP(cfg, F.relu),
    "swiglu": lambda cfg: GatedMLP(cfg, F.silu),
    "geglu": lambda cfg: GatedMLP(cfg, partial(F.gelu, approximate=cfg.gelu_approx)),
}


def build_mlp(cfg: ModelConfig) -> nn.Module:
    return MLPS[cfg.mlp](cfg)


# ----------------------------------------------------------------------------------------------
# Blocks
#
#   pre-norm (GPT-2, LLaMA)      post-norm (Vaswani 2017)      parallel (GPT-J, Falcon)
#
#   x ──┬─ norm ─ attn ─┐         x ──┬─ attn ─┐                x ──┬─ norm ─┬─ attn ─┐
#       └──────────── (+)             └───── (+) ─ norm             │        └─ mlp ──┤
#   h ──┬─ norm ─ mlp ──┐         h ──┬─ mlp ──┐                    └────────────── (+)
#       └──────────── (+)             └───── (+) ─ norm
#
# Pre-norm keeps an identity path from output to input, so gradients reach early layers
# undamped; post-norm renormalises the residual stream and needs warmup to train deep models.
# ``residual=False`` swaps the skip-add for "keep only the branch" (gradient-flow ablation).


def add_skip(x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    return x + branch


def no_skip(x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    return branch


SKIPS = {True: add_skip, False: no_skip}


class Block(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = build_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = build_norm(cfg)
        self.mlp = build_mlp(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.skip = SKIPS[cfg.residual]

    def forward(self, x, pos, start, mask, need_weights=False, kv=None):
        a, weights = self.attn(self.attn_norm(x), pos, start, mask, need_weights, kv)
        x = self.skip(x, self.drop(a))
        return self.skip(x, self.drop(self.mlp(self.mlp_norm(x)))), weights


class PostNormBlock(Block):
    """Post-norm block: norm(x + attn(x)), then norm(h + mlp(h))."""

    def forward(self, x, pos, start, mask, need_weights=False, kv=None):
        a, weights = self.attn(x, pos, start, mask, need_weights, kv)
        x = self.attn_norm(self.skip(x, self.drop(a)))
        return self.mlp_norm(self.skip(x, self.drop(self.mlp(x)))), weights


class ParallelBlock(nn.Module):
    """Parallel block: x + attn(norm(x)) + mlp(norm(x)) with one shared norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = build_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp = build_mlp(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.skip = SKIPS[cfg.residual]

    def forward(self, x, pos, start, mask, need_weights=False, kv=None):
        h = self.attn_norm(x)
        a, weights = self.attn(h, pos, start, mask, need_weights, kv)
        return self.skip(x, self.drop(a)) + self.drop(self.mlp(h)), weights


def build_block(cfg: ModelConfig) -> nn.Module:
    if cfg.parallel_block:
        return ParallelBlock(cfg)
    return {"pre": Block, "post": PostNormBlock}[cfg.norm_position](cfg)
