"""Training memory estimated before anything is allocated, and a one-line refusal of a run that
cannot fit the device it would train on.

The estimate is ``accounting.memory_report``'s (weights, gradients, optimizer state, the
activations one micro-batch keeps for backward) plus the step's input batches. Built on the
``meta`` device it costs nothing at any size; every block is the same, so it is computed for one
and two blocks and extended to ``n_layers`` (exact: each row is linear in the block count), which
keeps a config with millions of layers as cheap to check as a small one. It leaves out what it
cannot know (allocator slack, temporary buffers, the CUDA context), so a run it lets through may
still not fit; one it refuses cannot.
"""

from __future__ import annotations

import torch

from llm_foundry.accounting import human, memory_report
from llm_foundry.checkpoint import meta_transformer
from llm_foundry.config import ModelConfig
from llm_foundry.machine import memory_total
from llm_foundry.models.lora import frozen_base_bytes
from llm_foundry.train.config import TrainConfig

ROWS = ("weights", "working_weights", "gradients", "optimizer", "activations")


def training_bytes(
    mc: ModelConfig, tc: TrainConfig, devices: int = 1, tp: int = 1, strategy: str = "ddp"
) -> dict[str, int]:
    """Bytes per device of training ``mc`` with ``tc``: ``memory_report``'s rows for
    ``strategy`` on ``devices`` (``tp`` per tensor-parallel group), ``batches`` (the step's
    token ids: inputs and targets of every micro-batch) and ``total``; ``params`` is the
    parameter count. bf16, fp16 and auto are counted as bf16 (the smaller activations); a LoRA
    run has no gradients or optimizer state for its frozen base (the adapters' are left out).
    Raises ValueError (one line) for a model too large to exist."""
    meta_transformer(mc.replace(n_layers=1))  # a tensor past 2**63 bytes: named, not a crash
    dtype = "fp32" if tc.dtype == "fp32" else "bf16"

    def rows(n_layers: int) -> dict[str, int]:
        cfg = mc.replace(n_layers=n_layers)
        rep = memory_report(cfg, devices, tp, tc.optimizer, dtype,
                            tc.batch_size, tc.block_size, tc.activation_checkpointing)  # fmt: skip
        chosen = rep["strategies"][strategy]
        out = {**{k: chosen[k] for k in ROWS}, "params": rep["params"]["total"]}
        if tc.lora_r and tc.lora_base_dtype != "fp32":  # the adapted projections held smaller
            held, fp32 = frozen_base_bytes(meta_transformer(cfg, lora=_lora(tc)))
            whole = 4 * rep["params"]["total"]  # fp32 weights on one device; sharded alike
            out["weights"] -= (fp32 - held) * chosen["weights"] // whole
        return out

    one, two = rows(1), rows(2)
    out = {k: one[k] + (mc.n_layers - 1) * (two[k] - one[k]) for k in one}
    if tc.lora_r:
        out["gradients"] = out["optimizer"] = 0
    out["batches"] = 2 * 8 * tc.grad_accum * tc.batch_size * tc.block_size  # int64 x and y
    out["total"] = sum(out[k] for k in (*ROWS, "batches"))
    return out


def _lora(tc: TrainConfig) -> dict:
    """The LoRA settings ``tc`` fine-tunes with, as ``add_lora`` takes them."""
    return dict(r=tc.lora_r, alpha=tc.lora_alpha, dropout=tc.lora_dropout, rslora=tc.lora_rslora,
                targets=tc.lora_targets.split(","), base_dtype=tc.lora_base_dtype)  # fmt: skip


def check_training_memory(
    mc: ModelConfig,
    tc: TrainConfig,
    device: torch.device,
    world=None,
    available: tuple[int, str] | None = None,
) -> dict[str, int] | None:
    """Refuse (ValueError, one line) a run whose estimated memory (``training_bytes``) exceeds
    what ``device`` has, before the model is built; returns the estimate (None when it cannot
    be made: a distributed layout the accounting does not cover). ``world`` (the trainer's
    ``distributed.World``) gives the devices and the layout; ``available`` overrides
    ``machine.memory_total``."""
    if world is not None and world.distributed and tc.parallel != "none":
        try:
            need = training_bytes(mc, tc, world.world_size, world.tp, tc.parallel)
        except (KeyError, ValueError):  # a layout D.wrap refuses, with its own message
            meta_transformer(mc.replace(n_layers=1))
            return None
    else:
        need = training_bytes(mc, tc)
    have = available or memory_total(device)
    if have is None or need["total"] <= have[0]:
        return need
    model = "the model's size (model.dim, model.n_layers, model.vocab_size, model.hidden_dim)"
    batch = "the micro-batch (train.batch_size, train.block_size; train.grad_accum)"
    acts = need["activations"] + need["batches"]
    lower = f"{batch} or {model}" if acts > need["total"] / 2 else f"{model} or {batch}"
    parts = ", ".join(
        f"{name} {human(need[key], 'B')}"
        for name, key in (
            ("weights", "weights"),
            ("gradients", "gradients"),
            ("optimizer state", "optimizer"),
            (f"activations of {tc.batch_size:,} x {tc.block_size:,} tokens", "activations"),
            (f"token ids of {tc.grad_accum:,} micro-batch(es)", "batches"),
        )
        if need[key] >= need["total"] / 1000  # the parts that matter
    )
    raise ValueError(
        f"training this model ({need['params']:,} parameters) needs an estimated "
        f"{need['total']:,} bytes ({human(need['total'], 'B')}: {parts}), but this machine has "
        f"{have[0]:,} bytes ({human(have[0], 'B')}) of {have[1]}: lower {lower}"
    )
