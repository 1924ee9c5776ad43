"""Causal self-attention with H query heads sharing K key/value heads (MHA K = H, GQA 1 < K < H,
MQA K = 1), and the two implementations ``ModelConfig.attn_impl`` chooses between: spelled out
(``manual``, returns the weights) or PyTorch's fused SDPA kernels.

Shape letters: B batch, T query length, S key length, D model width, H query heads, K key/value
heads, hd head width.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from llm_foundry.models.linear import Linear
from llm_foundry.models.norm import RMSNorm, init_norm

if TYPE_CHECKING:
    from llm_foundry.config import ModelConfig


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


def document_mask(doc: torch.Tensor) -> torch.Tensor:
    """Additive mask (B, 1, T, T) keeping attention inside each packed document: 0 where query i
    and key j belong to the same document of their row, -inf elsewhere. doc: (B, T) ids."""
    same = doc[:, :, None] == doc[:, None, :]  # (B, T, T)
    zeros = torch.zeros(same.shape, device=doc.device)
    return zeros.masked_fill(~same, float("-inf"))[:, None]


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
ATTENTION_IMPL_NAMES = ATTENTION_IMPLS.keys()  # ``ModelConfig.attn_impl``'s values (a live view)


class Attention(nn.Module):
    """Causal self-attention with H query heads sharing K key/value heads (MHA, GQA, MQA)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_size
        q_dim, kv_dim = cfg.n_heads * self.head_dim, cfg.kv_heads * self.head_dim
        self.wq = Linear(cfg.dim, q_dim, bias=cfg.attn_bias)
        self.wk = Linear(cfg.dim, kv_dim, bias=cfg.attn_bias)
        self.wv = Linear(cfg.dim, kv_dim, bias=cfg.attn_bias)
        self.wo = Linear(q_dim, cfg.dim, bias=cfg.attn_bias)
        # QK-norm (Qwen3): normalise each head's q and k, bounding the logits before softmax
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.impl = ATTENTION_IMPLS[cfg.attn_impl]
        self.dropout = cfg.dropout

    def init_weights(self, std: float, residual_std: float) -> None:
        """q, k, v ~ N(0, std); ``wo`` writes into the residual stream, so N(0, residual_std)."""
        for proj in (self.wq, self.wk, self.wv):
            proj.init_weights(std)
        self.wo.init_weights(residual_std)
        init_norm(self.q_norm)
        init_norm(self.k_norm)

    def flops_per_token(self, context: int) -> int:
        """Training FLOPs per token: the four projections, plus scores and weighted sum over
        ``context`` keys, 2 * 2 * H * hd * context forward, x3 with backward (PaLM, Chowdhery
        et al. 2022)."""
        projections = sum(p.flops_per_token() for p in (self.wq, self.wk, self.wv, self.wo))
        return projections + 12 * self.n_heads * self.head_dim * context

    def active_params(self) -> int:
        """Parameters each token uses: all of them."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, x, pos, start, mask, need_weights: bool = False, kv=None):
        """x: (B, T, D) -> (B, T, D) and the weights (B, H, T, S) when ``need_weights``.
        ``kv`` = (cache, layer index) stores this step's keys/values and reads the earlier ones."""
        B, T, _ = x.shape
        # heads counted from the projections: under tensor parallelism a rank holds some of them
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        q, k = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2)  # (B, H|K, T, hd)
        q, k = pos.rotate(q, k, start, kv[0].pad if kv is not None else None)
        v = v.transpose(1, 2)
        if kv is not None:
            cache, layer = kv
            k, v = cache.update(layer, k, v, start)  # (B, K, S, hd)
        impl = manual_attention if need_weights else self.impl
        out, weights = impl(q, k, v, mask, self.dropout if self.training else 0.0)
        out = out.transpose(1, 2).reshape(B, T, -1)
        return self.wo(out), weights
