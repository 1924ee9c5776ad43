"""Plots written as PNG files (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from llm_foundry.train.config import TrainConfig  # noqa: E402
from llm_foundry.train.metrics import read_records  # noqa: E402
from llm_foundry.train.schedule import lr_at  # noqa: E402


def read_metrics(path: str | Path) -> tuple[list[dict], list[dict]]:
    """Split ``metrics.jsonl`` into train records and eval records (other kinds, such as
    ``monitor`` records, are left out)."""
    train, evals = [], []
    for rec in read_records(path):
        if "val_loss" in rec:
            evals.append(rec)
        elif "loss" in rec:
            train.append(rec)
    return train, evals


def plot_losses(metrics_path: str | Path, out_png: str | Path, title: str = "") -> Path:
    """Train loss (raw and smoothed) and validation loss against the step."""
    train, evals = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    if train:
        steps = [r["step"] for r in train]
        losses = [r["loss"] for r in train]
        ax.plot(steps, losses, color="tab:blue", alpha=0.25, lw=0.8, label="train (per step)")
        smooth, ema = [], losses[0]
        for v in losses:
            ema = 0.95 * ema + 0.05 * v
            smooth.append(ema)
        ax.plot(steps, smooth, color="tab:blue", lw=1.8, label="train (EMA 0.95)")
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["val_loss"] for r in evals],
            "o-",
            color="tab:orange",
            lw=1.8,
            label="validation",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return Path(out_png)


def plot_lr(cfg: TrainConfig, out_png: str | Path) -> Path:
    """The learning rate of every step of ``cfg``'s schedule."""
    steps = list(range(cfg.max_steps))
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    ax.plot(steps, [lr_at(s, cfg) for s in steps], lw=1.8)
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.set_title(
        f"{cfg.schedule} schedule, warmup {cfg.warmup_steps}, lr {cfg.lr:g} -> {cfg.min_lr:g}"
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return Path(out_png)
