"""What a training run says of itself: the text of its notes and messages, computed from its
settings and saved state (pure functions; the trainer prints them).

    batch_note(state, tc, dp_size)   a resume on another number of data-parallel ranks
    schedule_note(state, tc)         a resume whose settings move the next step's learning rate
    nonfinite(loss, grad_norm)       which of the two a skipped or stopping step found NaN/inf
    skipped_text(skipped, steps)     how many updates train.on_nonfinite=skip left out
    dpo_shown(stats, prefix)         DPO's reward margin and accuracy as printed
"""

from __future__ import annotations

import math

from llm_foundry.train.config import TrainConfig
from llm_foundry.train.schedule import lr_at


def batch_note(state: dict, tc: TrainConfig, now: int) -> str | None:
    """What resuming on ``now`` data-parallel ranks, not the checkpoint's, did to the global
    batch, and how to keep it; None where the global batch is the same."""
    was = state.get("data_parallel")
    saved = state.get("train_config") or {}
    if not was or "batch_size" not in saved:
        return None
    before = saved["batch_size"] * saved.get("grad_accum", 1) * was
    after = tc.batch_size * tc.grad_accum * now
    if before == after:
        return None
    keep = before / (tc.batch_size * now)
    how = (f"--train.grad_accum {int(keep)} keeps it" if keep == int(keep)
           else "set batch_size x grad_accum x ranks to keep it")  # fmt: skip
    return (
        f"note: the run trained on {was} data-parallel rank(s), this one has {now}: a "
        f"step now takes {after} sequences, not {before} ({how})"
    )


def schedule_note(state: dict, tc: TrainConfig) -> str | None:
    """What the settings given on resume do to the learning rate of the next step: the saved
    run's schedule against ``tc``'s, and (where the saved run had finished its schedule and the
    lr now jumps up) the flags that go on at its floor; None where the lr of the next step is
    the same."""
    step = state["step"]
    saved = TrainConfig.from_dict(state["train_config"])
    was, now = lr_at(step, saved), lr_at(step, tc)
    if was == now:
        return None
    names = ("schedule", "max_steps", "warmup_steps", "lr", "min_lr", "decay_frac")
    why = ", ".join(f"{k} {getattr(saved, k)!r} -> {getattr(tc, k)!r}" for k in names
                    if getattr(saved, k) != getattr(tc, k))  # fmt: skip
    ratio = f" ({now / was:.3g}x)" if was > 0 else ""
    note = (f"note: the learning-rate schedule changed ({why}): step {step + 1} trains at lr "
            f"{now:.3g}, where the saved schedule gives {was:.3g}{ratio}")  # fmt: skip
    if step >= saved.max_steps and now > was > 0:  # the run had decayed: how to stay there
        keep = f"--train.schedule constant --train.lr {was:.4g}"
        if tc.optimizer == "muon":  # Muon's lr is lr x muon_lr / lr: its floor given too
            keep += f" --train.muon_lr {saved.muon_lr * was / saved.lr:.4g}"
        note += f"; to go on at that floor instead: {keep}"
    return note


def nonfinite(loss: float, grad_norm: float) -> str:
    """Which of a step's loss and gradient norm was NaN/inf, with its value: 'non-finite loss
    (nan)', 'non-finite gradient norm (inf) of a finite loss (2.31)', or both."""
    if not math.isfinite(loss):
        both = "" if math.isfinite(grad_norm) else f" and gradient norm ({grad_norm})"
        return f"non-finite loss ({loss}){both}"
    return f"non-finite gradient norm ({grad_norm}) of a finite loss ({loss:.4g})"


def skipped_text(skipped: int, steps: int) -> str:
    """'3 of 20 steps skipped (non-finite)': how many updates train.on_nonfinite=skip left out."""
    return f"{skipped} of {steps} steps skipped (non-finite)"


def dpo_shown(stats: dict[str, float], prefix: str = "") -> dict[str, str]:
    """DPO's reward margin and accuracy of ``stats`` as printed (none without them)."""
    names = {"margin": "rewards/margins", "acc": "rewards/accuracies"}
    got = {k: stats.get(prefix + v) for k, v in names.items()}
    return {k: f"{v:.3f}" if k == "margin" else f"{v:.2f}" for k, v in got.items() if v is not None}
