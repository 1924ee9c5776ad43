"""Feed-forward layers, chosen by ``ModelConfig.mlp``: two matrices with GELU or ReLU, or three
with a gate (SwiGLU, GeGLU). Shapes: x (B, T, D) -> (B, T, D)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch.nn as nn
import torch.nn.functional as F

from llm_foundry.models.linear import Linear

if TYPE_CHECKING:
    from llm_foundry.config import ModelConfig


class MLP(nn.Module):
    """Two matrices: w2(act(w1 x)) with a 4x-wide hidden layer (GPT-2, BLOOM, Falcon)."""

    def __init__(self, cfg: ModelConfig, act):
        super().__init__()
        self.w1 = Linear(cfg.dim, cfg.ffn_dim, bias=cfg.mlp_bias)
        self.w2 = Linear(cfg.ffn_dim, cfg.dim, bias=cfg.mlp_bias)
        self.act = act

    def forward(self, x):
        return self.w2(self.act(self.w1(x)))

    def init_weights(self, std: float, residual_std: float) -> None:
        """``w1`` ~ N(0, std); ``w2`` writes into the residual stream, so N(0, residual_std)."""
        self.w1.init_weights(std)
        self.w2.init_weights(residual_std)

    def flops_per_token(self, context: int) -> int:
        """Training FLOPs per token of every projection (``context`` does not matter here)."""
        return sum(m.flops_per_token() for m in self.children() if hasattr(m, "flops_per_token"))

    def active_params(self) -> int:
        """Parameters each token uses: all of them (a mixture of experts uses fewer)."""
        return sum(p.numel() for p in self.parameters())


class GatedMLP(MLP):
    """Three matrices: w2(act(w1 x) * w3 x) (Shazeer 2020: SwiGLU with SiLU, GeGLU with GELU).

    The hidden width is 2/3 of the two-matrix MLP's so the parameter count stays the same.
    """

    def __init__(self, cfg: ModelConfig, act):
        nn.Module.__init__(self)
        self.w1 = Linear(cfg.dim, cfg.ffn_dim, bias=cfg.mlp_bias)  # gate
        self.w3 = Linear(cfg.dim, cfg.ffn_dim, bias=cfg.mlp_bias)  # up
        self.w2 = Linear(cfg.ffn_dim, cfg.dim, bias=cfg.mlp_bias)  # down
        self.act = act

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float, residual_std: float) -> None:
        """``w1``, ``w3`` ~ N(0, std); ``w2`` writes into the residual stream: N(0, residual_std)."""
        self.w1.init_weights(std)
        self.w3.init_weights(std)
        self.w2.init_weights(residual_std)


def _gelu(cfg: ModelConfig):
    return partial(F.gelu, approximate=cfg.gelu_approx)


# name -> (module class, its activation for a config)
MLPS = {
    "gelu": (MLP, _gelu),
    "relu": (MLP, lambda cfg: F.relu),
    "swiglu": (GatedMLP, lambda cfg: F.silu),
    "geglu": (GatedMLP, _gelu),
}
MLP_NAMES = MLPS.keys()  # the values ``ModelConfig.mlp`` accepts (a live view)


def is_gated(mlp: str) -> bool:
    """Whether ``mlp`` names a three-matrix (gated) kind: ModelConfig.ffn_dim keeps parameters
    equal by making it 2/3 as wide."""
    return issubclass(MLPS[mlp][0], GatedMLP)


def activation(cfg: ModelConfig):
    """The nonlinearity ``cfg.mlp`` names (experts of a mixture use it too)."""
    return MLPS[cfg.mlp][1](cfg)


def build_mlp(cfg: ModelConfig) -> nn.Module:
    """The feed-forward layer named by ``cfg.mlp``."""
    cls, act = MLPS[cfg.mlp]
    return cls(cfg, act(cfg))
