"""Training memory per device, estimated before anything is allocated: the report under each
parallel layout (``memory_report``, ``llm-foundry params --memory``), and a one-line refusal of a
run that cannot fit the device it would train on (``check_training_memory``).

The estimate counts weights, gradients, optimizer state and the activations one micro-batch
keeps for backward (``accounting.activation_bytes``), per rank, after the splits the layouts make:
tensor parallelism's as its plan makes them (``tensor_parallel.split_dims``), on the models it
accepts (``tensor_parallel.tp_problems``). A training run adds the step's input batches. Built on
the ``meta`` device it costs nothing at any size; every block is the same, so a run's estimate
is computed for one and two blocks and extended to ``n_layers`` (exact: each row is linear in the
block count), which keeps a config with millions of layers as cheap to check as a small one. It
leaves out what it cannot know (allocator slack, temporary buffers, the CUDA context), so a run
it lets through may still not fit; one it refuses cannot.
"""

from __future__ import annotations

import torch

from llm_foundry.accounting import activation_bytes, human, meta_model
from llm_foundry.checkpoint import meta_transformer
from llm_foundry.config import ModelConfig
from llm_foundry.machine import memory_total
from llm_foundry.models.lora import frozen_base_bytes
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.optim import muon_params
from llm_foundry.train.tensor_parallel import split_dims, tp_problems

STRATEGIES = ("ddp", "fsdp", "tp", "fsdp+tp")
MEMORY_ROWS = ("weights", "working_weights", "gradients", "optimizer", "activations")
GiB = 1024**3


def tp_degrees(devices: int) -> list[int]:
    """The TP degrees a mesh of ``devices`` devices can have: the divisors of ``devices``."""
    return [t for t in range(1, devices + 1) if devices % t == 0]


def check_tp_degree(cfg: ModelConfig, t: int) -> None:
    """Raise ValueError (one line) when ``cfg``'s heads do not split ``t`` ways: the problems
    ``tensor_parallel.tp_problems`` finds at ``t`` and not at 1. What no degree splits (experts,
    a per-head bias) is left to the report, which lists those layouts as unavailable."""
    if t < 1:
        raise ValueError(f"the TP degree must be at least 1, got {t}")
    whatever = set(tp_problems(cfg, 1))
    problems = [p for p in tp_problems(cfg, t) if p not in whatever]
    if problems:
        raise ValueError("; ".join(problems))


def _local_numel(shape: torch.Size, split: int | None, t: int, d: int) -> int:
    """Elements one rank holds: ``split`` cut t ways by TP, then dim 0 cut d ways by FSDP2
    (both pad the last shard, so a rank holds the ceiling)."""
    dims = list(shape)
    if split is not None:
        dims[split] = -(-dims[split] // t)
    if d > 1:
        dims[0] = -(-dims[0] // d)
    n = 1
    for x in dims:
        n *= x
    return n


def memory_report(
    cfg: ModelConfig,
    devices: int,
    tp: int,
    optimizer: str = "adamw",
    dtype: str = "fp32",
    batch_size: int = 1,
    seq_len: int | None = None,
    activation_checkpointing: bool = False,
) -> dict:
    """Training memory per device, in bytes, for DDP, FSDP, TP and FSDP+TP on ``devices`` devices.

    Meshes (data x tensor): ddp devices x 1 (every rank whole); fsdp devices x 1 (FSDP2 splits
    every tensor's dim 0 ``devices`` ways); tp 1 x devices (one TP group of every device, split
    as ``tensor_parallel.split_dims`` reads the plan); fsdp+tp (devices/tp) x tp (TP inside,
    FSDP2 over the TP shards).

    Per device, with P the parameters a rank holds after the splits:
    - weights 4P and gradients 4P: fp32 in both dtypes (``bf16`` is autocast: weights,
      gradients and optimizer state stay fp32, matmuls and their saved activations are bf16);
    - optimizer: AdamW 8 bytes per parameter (two fp32 moments); Muon 4 (one momentum) on the
      parameters ``llm_foundry.train.optim.muon_params`` gives it (the blocks' 2-D weights) and
      AdamW's 8 on the rest, its momentum sharded like the weights (the whole update matrix each
      rank gathers for Newton-Schulz, one at a time, and step counters are not counted);
    - working weights: FSDP's unsharded copies while they are in use: the root (embeddings,
      final norm, head: FSDP2 keeps the root gathered from forward to backward) plus one block,
      4 bytes a parameter (2 in bf16, FSDP's bf16 all-gather); under DDP and TP in bf16, the bf16
      copies autocast makes of the matmul weights (kept for backward); prefetching a second block,
      DDP's gradient buckets and unsharded gradients before the reduce-scatter are not counted;
    - activations: ``activation_bytes`` with this strategy's TP degree.

    The tp and fsdp+tp layouts are unavailable where tensor parallelism refuses the model, for
    the reasons ``tensor_parallel.tp_problems`` gives (experts, a per-head bias, heads that do
    not divide); a ``tp`` the model could be split by, but not that many ways, is an error.
    Returns ``strategies`` (name -> mesh and bytes), ``unavailable`` (name -> why) and ``params``
    (totals the test checks: all, TP-split, TP-replicated, Muon's, per block, outside blocks).
    """
    if devices < 1:
        raise ValueError(f"devices must be at least 1, got {devices}")
    if tp < 1:
        raise ValueError(f"the TP degree must be at least 1, got {tp}")
    if devices % tp:
        raise ValueError(
            f"devices={devices} is not a multiple of the TP degree {tp}: give one of "
            f"{', '.join(map(str, tp_degrees(devices)))}"
        )
    check_tp_degree(cfg, tp)
    if optimizer not in ("adamw", "muon"):
        raise ValueError(f"optimizer={optimizer!r} is not one of adamw, muon")
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype={dtype!r} is not one of fp32, bf16")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    if seq_len is not None and seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be at least 1")
    seq_len = seq_len or cfg.max_seq_len
    model = meta_model(cfg)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    muon_ids = {id(p) for p in muon_params(model)}
    dims = split_dims(model)  # tensor parallelism's plan, per parameter
    tied = cfg.tie_embeddings  # the token embedding is then also the head's matmul weight
    params = [
        dict(
            shape=p.shape,
            split=dims[name],
            block=name.startswith("layers."),
            # what FSDP gathers at once: the root (never resharded in a step) and one block
            root_or_first=not name.startswith("layers.") or name.startswith("layers.0."),
            muon=optimizer == "muon" and id(p) in muon_ids,
            matmul=p.dim() >= 2 and (id(p) not in embeddings or (tied and "tok_emb" in name)),
        )
        for name, p in model.named_parameters()
    ]
    meshes = dict(ddp=(devices, 1, False), fsdp=(devices, 1, True), tp=(1, devices, False))
    meshes["fsdp+tp"] = (devices // tp, tp, True)
    unavailable = {}
    for name, t in (("tp", devices), ("fsdp+tp", tp)):
        problems = tp_problems(cfg, t)
        if problems:
            unavailable[name] = "; ".join(problems)
    gather = 2 if dtype == "bf16" else 4
    strategies = {}
    for name, (d, t, sharded) in meshes.items():
        if name in unavailable:
            continue
        fsdp_d = d if sharded else 1
        for p in params:
            p["held"] = _local_numel(p["shape"], p["split"], t, fsdp_d)
            p["whole"] = _local_numel(p["shape"], p["split"], t, 1)  # after TP only
        if sharded and d > 1:
            working = gather * sum(p["whole"] for p in params if p["root_or_first"])
        elif dtype == "bf16":
            working = 2 * sum(p["whole"] for p in params if p["matmul"])
        else:
            working = 0
        held = sum(p["held"] for p in params)
        row = dict(
            data=d,
            tensor=t,
            weights=4 * held,
            working_weights=working,
            gradients=4 * held,
            optimizer=sum((4 if p["muon"] else 8) * p["held"] for p in params),
            activations=activation_bytes(
                cfg, t, batch_size, seq_len, dtype, activation_checkpointing
            ),
        )
        row["total"] = sum(row[k] for k in MEMORY_ROWS)
        strategies[name] = row

    def count(keep) -> int:
        return sum(p["shape"].numel() for p in params if keep(p))

    return dict(
        devices=devices,
        tp=tp,
        optimizer=optimizer,
        dtype=dtype,
        batch_size=batch_size,
        seq_len=seq_len,
        activation_checkpointing=activation_checkpointing,
        strategies=strategies,
        unavailable=unavailable,
        params=dict(
            total=count(lambda p: True),
            tp_split=count(lambda p: p["split"] is not None),
            tp_replicated=count(lambda p: p["split"] is None),
            muon=count(lambda p: p["muon"]),
            per_block=count(lambda p: p["root_or_first"] and p["block"]),
            outside_blocks=count(lambda p: not p["block"]),
        ),
    )


def format_memory(rep: dict) -> str:
    """The memory report as a table of GiB per device, one column per strategy."""
    names = list(rep["strategies"])
    opt = {"adamw": "AdamW", "muon": "Muon"}[rep["optimizer"]]
    ckpt = ", activation checkpointing" if rep["activation_checkpointing"] else ""
    lines = [
        f"memory per device, GiB: {rep['devices']} devices, {opt}, {rep['dtype']}, "
        f"batch {rep['batch_size']} x {rep['seq_len']} tokens{ckpt}",
        f"{'':<18}" + "".join(f"{n:>10}" for n in names),
    ]
    s = rep["strategies"]
    mesh = [f"{s[n]['data']}x{s[n]['tensor']}" for n in names]
    lines.append(f"{'mesh (data x tp)':<18}" + "".join(f"{m:>10}" for m in mesh))
    for key in (*MEMORY_ROWS, "total"):
        label = key.replace("_", " ")
        lines.append(f"{label:<18}" + "".join(f"{s[n][key] / GiB:>10.2f}" for n in names))
    for n, why in rep["unavailable"].items():
        lines.append(f"{n}: not available: {why}")
    return "\n".join(lines)


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
        out = {**{k: chosen[k] for k in MEMORY_ROWS}, "params": rep["params"]["total"]}
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
    out["total"] = sum(out[k] for k in (*MEMORY_ROWS, "batches"))
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
