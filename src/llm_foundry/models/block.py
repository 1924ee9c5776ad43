"""Transformer blocks, chosen by ``ModelConfig.norm_position`` and ``parallel_block``: where the
norms sit relative to the residual adds, and whether attention and MLP run in sequence.

  pre-norm (GPT-2, LLaMA)      post-norm (Vaswani 2017)      parallel (GPT-J, Falcon)

  x ──┬─ norm ─ attn ─┐         x ──┬─ attn ─┐                x ──┬─ norm ─┬─ attn ─┐
      └──────────── (+)             └───── (+) ─ norm             │        └─ mlp ──┤
  h ──┬─ norm ─ mlp ──┐         h ──┬─ mlp ──┐                    └────────────── (+)
      └──────────── (+)             └───── (+) ─ norm

Pre-norm keeps an identity path from output to input, so gradients reach early layers
undamped; post-norm renormalises the residual stream and needs warmup to train deep models.
``residual=False`` swaps the skip-add for "keep only the branch" (gradient-flow ablation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from llm_foundry.models.attention import Attention
from llm_foundry.models.mlp import build_mlp
from llm_foundry.models.moe import MoE
from llm_foundry.models.norm import build_norm, init_norm

if TYPE_CHECKING:
    from llm_foundry.config import ModelConfig


def add_skip(x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    return x + branch


def no_skip(x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    return branch


SKIPS = {True: add_skip, False: no_skip}


class Block(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h))."""

    mlp_norm_of_its_own = True  # False: the MLP reads attention's norm (a shared-norm block)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = build_norm(cfg)
        self.attn = Attention(cfg)
        if self.mlp_norm_of_its_own:
            self.mlp_norm = build_norm(cfg)
        self.mlp = build_feed_forward(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.skip = SKIPS[cfg.residual]

    def norms(self) -> list[nn.Module]:
        return [n for n in (self.attn_norm, getattr(self, "mlp_norm", None)) if n is not None]

    def init_weights(self, std: float, residual_std: float) -> None:
        """Unit norms; attention and MLP each say which of their projections take
        ``residual_std`` (those writing into the residual stream)."""
        for norm in self.norms():
            init_norm(norm)
        self.attn.init_weights(std, residual_std)
        self.mlp.init_weights(std, residual_std)

    def flops_per_token(self, context: int) -> int:
        """Training FLOPs per token of attention over ``context`` keys and of the MLP."""
        return self.attn.flops_per_token(context) + self.mlp.flops_per_token(context)

    def active_params(self) -> int:
        """Parameters each token uses: the norms', and what attention and the MLP report."""
        norms = sum(p.numel() for norm in self.norms() for p in norm.parameters())
        return norms + self.attn.active_params() + self.mlp.active_params()

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


class ParallelBlock(Block):
    """Parallel block: x + attn(norm(x)) + mlp(norm(x)) with one shared norm (GPT-J, Falcon-7B)."""

    mlp_norm_of_its_own = False

    def forward(self, x, pos, start, mask, need_weights=False, kv=None):
        h = self.attn_norm(x)
        a, weights = self.attn(h, pos, start, mask, need_weights, kv)
        return self.skip(x, self.drop(a)) + self.drop(self.mlp(h)), weights


class TwoNormParallelBlock(ParallelBlock):
    """Parallel block with a norm each (Falcon-40B): x + attn(norm1(x)) + mlp(norm2(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.mlp_norm = build_norm(cfg)  # after the MLP: the parameter order checkpoints hold

    def forward(self, x, pos, start, mask, need_weights=False, kv=None):
        a, weights = self.attn(self.attn_norm(x), pos, start, mask, need_weights, kv)
        return self.skip(x, self.drop(a)) + self.drop(self.mlp(self.mlp_norm(x))), weights


def build_feed_forward(cfg: ModelConfig) -> nn.Module:
    """Routed experts when ``cfg.n_experts`` > 0, else the MLP ``cfg.mlp`` names."""
    return MoE(cfg) if cfg.n_experts else build_mlp(cfg)


BLOCKS = {"pre": Block, "post": PostNormBlock}
NORM_POSITION_NAMES = BLOCKS.keys()  # ``ModelConfig.norm_position``'s values (a live view)
PARALLEL_BLOCKS = {1: ParallelBlock, 2: TwoNormParallelBlock}  # by ``ModelConfig.parallel_norms``


def build_block(cfg: ModelConfig) -> nn.Module:
    """The block named by ``cfg.norm_position``, or a parallel block (``cfg.parallel_block``)
    with ``cfg.parallel_norms`` norms."""
    if cfg.parallel_block:
        return PARALLEL_BLOCKS[cfg.parallel_norms](cfg)
    return BLOCKS[cfg.norm_position](cfg)
