"""Learning-rate schedules as pure functions of the step; ``SCHEDULES`` is their one list (the
names ``TrainConfig.schedule`` accepts)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llm_foundry.train.config import TrainConfig


def _progress(step: int, cfg: TrainConfig) -> float:
    """Fraction of the post-warmup steps done, in [0, 1]."""
    return min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))


def cosine(step: int, cfg: TrainConfig) -> float:
    """Half a cosine from lr to min_lr (Loshchilov & Hutter 2017)."""
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * _progress(step, cfg))) * (
        cfg.lr - cfg.min_lr
    )


def linear(step: int, cfg: TrainConfig) -> float:
    """A straight line from lr to min_lr."""
    return cfg.lr + _progress(step, cfg) * (cfg.min_lr - cfg.lr)


def constant(step: int, cfg: TrainConfig) -> float:
    return cfg.lr


def wsd(step: int, cfg: TrainConfig) -> float:
    """Warmup-stable-decay (Hu et al. 2024, MiniCPM): hold lr, then decay linearly to min_lr
    over the last decay_frac of the steps (one at least), each of them lower, the last at
    min_lr."""
    n = max(1, int(cfg.decay_frac * cfg.max_steps))
    decay_start = cfg.max_steps - n
    if step < decay_start:
        return cfg.lr
    frac = min(1.0, (step - decay_start + 1) / n)
    return cfg.lr + frac * (cfg.min_lr - cfg.lr)


# the registry: name -> schedule after warmup; TrainConfig accepts exactly these names
SCHEDULES = {"cosine": cosine, "linear": linear, "constant": constant, "wsd": wsd}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): a linear warmup over
    ``warmup_steps`` (Goyal et al. 2017), then the schedule named by ``cfg.schedule``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return SCHEDULES[cfg.schedule](step, cfg)
