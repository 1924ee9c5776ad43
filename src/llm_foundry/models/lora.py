"""Low-rank adapters (LoRA, Hu et al. 2021) on the model's projections.

    y = W x + s · B (A dropout(x))        W (out, in) frozen; A (r, in); B (out, r)
    s = alpha / r, or alpha / sqrt(r) with rsLoRA (Kalajdzievski 2023)

A starts as nn.Linear's default (Kaiming-uniform, a = sqrt(5)) and B at zero, so an adapted
model starts equal to its base. Merging adds s · B A into W (one matrix again, no extra cost at
inference); unmerging subtracts it. Shapes: x (..., in) -> (..., out).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

# our projection names (the last part of a module's name) a LoRA can target
TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "lm_head")


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float, rslora: bool):
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.r, self.alpha, self.dropout, self.rslora = r, alpha, dropout, rslora
        self.scale = alpha / (math.sqrt(r) if rslora else r)
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False

    def flops_per_token(self) -> int:
        """Training FLOPs per token: the frozen weight's forward and input gradient (4 per
        weight, no weight gradient) plus the adapters' 6 per weight."""
        return 4 * self.base.weight.numel() + 6 * (self.lora_A.numel() + self.lora_B.numel())

    def delta(self) -> torch.Tensor:
        """The update s · B A this adapter adds to the base weight: (out, in)."""
        return self.scale * (self.lora_B @ self.lora_A)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.merged:  # the update is inside base.weight already
            return y
        return y + self.scale * F.linear(F.linear(self.drop(x), self.lora_A), self.lora_B)

    @torch.no_grad()
    def merge(self) -> None:
        if not self.merged:
            self.base.weight += self.delta().to(self.base.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            self.base.weight -= self.delta().to(self.base.weight.dtype)
            self.merged = False


def add_lora(
    model: nn.Module,
    targets: Iterable[str] = ("wq", "wv"),
    r: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    rslora: bool = False,
) -> list[str]:
    """Freeze ``model`` and put a LoRA on every linear layer whose name ends in one of
    ``targets`` (of ``TARGETS``). Returns the adapted modules' names, in model order."""
    targets = tuple(targets)
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown or not targets:
        raise ValueError(f"LoRA targets {unknown or '[]'} are not among {', '.join(TARGETS)}")
    if not (isinstance(r, int) and r >= 1):
        raise ValueError(f"LoRA rank r={r!r} must be a positive integer")
    if not 0 <= dropout < 1:
        raise ValueError(f"LoRA dropout={dropout!r} must be in [0, 1)")
    cfg = getattr(model, "cfg", None)
    if "lm_head" in targets and getattr(cfg, "tie_embeddings", False):
        raise ValueError(
            "lm_head is tied to the token embedding: a LoRA merged into it would change the "
            "embedding too; leave lm_head out of the targets, or untie the model"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    names = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.split(".")[-1] in targets
    ]
    if not names:
        raise ValueError(f"the model has no linear layer named {', '.join(targets)}")
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, leaf)
        setattr(parent, leaf, LoRALinear(base, r, alpha, dropout, rslora))
    return names


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """name -> adapter, for every LoRA in ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its base weight (the model computes the same, one matrix each)."""
    for m in lora_layers(model).values():
        m.merge()


def unmerge_lora(model: nn.Module) -> None:
    for m in lora_layers(model).values():
        m.unmerge()


def lora_settings(model: nn.Module) -> dict | None:
    """What ``add_lora`` was given, read back from the model (None without adapters): saved with
    a checkpoint so that loading rebuilds the same adapters."""
    layers = lora_layers(model)
    if not layers:
        return None
    first = next(iter(layers.values()))
    targets = sorted({name.split(".")[-1] for name in layers})
    return dict(
        r=first.r, alpha=first.alpha, dropout=first.dropout, rslora=first.rslora, targets=targets
    )


def apply_lora_settings(model: nn.Module, settings: dict | None) -> nn.Module:
    """``add_lora`` with settings from ``lora_settings`` (a no-op for None); returns ``model``."""
    if settings:
        add_lora(
            model,
            settings["targets"],
            r=settings["r"],
            alpha=settings["alpha"],
            dropout=settings["dropout"],
            rslora=settings["rslora"],
        )
    return model
