"""Normalisation layers, chosen by ``ModelConfig.norm``: LayerNorm (Ba et al. 2016) or RMSNorm
(Zhang & Sennrich 2019). Shapes: x (..., D)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

if TYPE_CHECKING:
    from llm_foundry.config import ModelConfig


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


def init_norm(norm: nn.Module) -> None:
    """Unit scale and zero shift: a freshly initialised norm only normalises (no-op on Identity)."""
    if getattr(norm, "weight", None) is not None:
        nn.init.ones_(norm.weight)
    if getattr(norm, "bias", None) is not None:
        nn.init.zeros_(norm.bias)


NORMS = {
    "layernorm": lambda cfg, dim: nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.norm_bias),
    "rmsnorm": lambda cfg, dim: RMSNorm(dim, cfg.norm_eps),
}
NORM_NAMES = NORMS.keys()  # the values ``ModelConfig.norm`` accepts (a live view)


def build_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """The normalisation layer named by ``cfg.norm`` over ``dim`` (default ``cfg.dim``) features."""
    return NORMS[cfg.norm](cfg, dim or cfg.dim)
