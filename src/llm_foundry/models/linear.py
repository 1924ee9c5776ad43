"""``Linear``, every projection of the model: ``nn.Linear`` that owns its init and FLOPs, and
whose one-token case, under ``torch.compile``, is a fused multiply-and-sum (``matvec``) instead
of a BLAS gemv call. Decoding one token at a time reads every
weight once per token, so it is bound by how fast weights stream from memory; the fused
reduction streams them faster on CPU (benchmarks/README.md, bench_generate); outside a compiled
one-token step it is ``nn.Linear``."""

from __future__ import annotations

import torch
import torch.nn as nn


def matvec(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for a single row x (..., 1 row, in) as a multiply-and-sum: under
    torch.compile it becomes one fused, vectorised reduction that streams the weight faster than
    a BLAS gemv call on CPU (benchmarks/README.md, bench_generate)."""
    return (x.unsqueeze(-2) * weight).sum(-1)


class Linear(nn.Linear):
    """nn.Linear whose one-token (decode) case, when compiled, is ``matvec``."""

    def init_weights(self, std: float) -> None:
        """Weights N(0, std), bias zero."""
        nn.init.normal_(self.weight, mean=0.0, std=std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 2 per weight forward, 4 backward (Kaplan et al. 2020)."""
        return 6 * self.weight.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and x.shape[:-1].numel() == 1 and x.device.type == "cpu":
            y = matvec(x, self.weight)  # the shape test is static: resolved at trace time
            return y if self.bias is None else y + self.bias
        return super().forward(x)
