"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) on PyTorch's DTensor: each block's
matrices split across the ``tp`` ranks of a device mesh, so a model bigger than one device fits.

The plan, per block: q/k/v and the MLP's input projections column-wise (each rank computes its
own heads / hidden units), the attention and MLP output projections row-wise (partial sums
reduced into the residual stream). Between blocks the residual stream is split along the
sequence (sequence parallelism, Korthikanti et al. 2022), so the norms run on T/tp positions per
rank and activations take 1/tp of the memory. The token embedding and the head are split by
vocabulary, and the loss is computed on vocabulary shards (``loss_parallel``) without gathering
the logits. Everything outside the blocks that has weights (learned positions, an embedding
norm) is replicated. MQA's single K/V head cannot be split: ``wk``/``wv`` stay whole on every
rank, their output's gradient summed over the ranks.

This module is the one owner of what tensor parallelism accepts and splits: ``tp_problems``
(models), ``settings_problems`` (training settings: ``TrainConfig`` asks) and ``split_dims``
(what each rank holds, read from the plan: the memory report asks).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from llm_foundry.config import is_int
from llm_foundry.models.position import position_traits


def tp_problems(cfg, tp: int, block_size: int | None = None) -> list[str]:
    """Why ``cfg`` cannot be split over ``tp`` ranks (one line each; empty when it can). Query
    heads and K/V heads must divide by ``tp``; MQA's one K/V head is replicated instead. The
    sequence (``block_size``), split evenly over the ranks around the norms, must divide too."""
    p = []
    if block_size is not None and block_size % tp:
        p.append(f"train.block_size={block_size} must divide by the tensor-parallel degree {tp} "
                 "(sequence parallelism gives each rank an equal part of it)")  # fmt: skip
    if cfg.n_heads % tp:
        p.append(f"model.n_heads={cfg.n_heads} must divide by the tensor-parallel degree {tp}")
    if cfg.kv_heads > 1 and cfg.kv_heads % tp:
        p.append(
            f"model.n_kv_heads={cfg.kv_heads} must divide by the tensor-parallel degree {tp} "
            "(or be 1: MQA's one K/V head is replicated)"
        )
    if cfg.n_experts:
        p.append(
            f"model.n_experts={cfg.n_experts}: expert banks are not split across tensor-parallel "
            "ranks (no expert parallelism); use parallel=fsdp or ddp"
        )
    if position_traits(cfg).has_bias:
        p.append(
            f"model.pos_encoding={cfg.pos_encoding!r}: its per-head bias is not split across "
            "tensor-parallel ranks; use parallel=fsdp or ddp"
        )
    return p


def settings_problems(tc, parallel: str) -> list[str]:
    """Why training settings ``tc`` (a ``TrainConfig`` being validated: fields may still be of any
    type) cannot run with tensor parallelism as ``parallel`` (``tc.parallel``, "none" when that is
    no layout) asks for it, one line each."""
    p = []
    if "tp" in parallel:  # tensor parallelism holds DTensor shards of each matrix
        lora = is_int(tc.lora_r) and tc.lora_r > 0
        monitor = is_int(tc.monitor_interval) and tc.monitor_interval > 0
        for name, bad, why in (
            ("dtype", tc.dtype == "fp16", "fp16 with its grad scaler is not supported "
             "(untested) under tensor parallelism; use bf16 or fp32"),
            ("lora_r", lora, "adapters are not split across tensor-parallel ranks; use ddp or fsdp"),
            ("monitor_interval", monitor, "the monitors read whole weights; use ddp or none"),
        ):  # fmt: skip
            if bad:
                p.append(f"{name}={getattr(tc, name)!r} with parallel={tc.parallel!r}: {why}")
    tp_size = tc.tp_size if is_int(tc.tp_size) else 0
    if tp_size and "tp" not in parallel:
        p.append(f"tp_size={tp_size} with parallel={tc.parallel!r}: tp_size applies to "
                 "parallel=tp and fsdp+tp only")  # fmt: skip
    if tp_size == 1 and tc.parallel == "fsdp+tp":
        p.append("tp_size=1 with parallel='fsdp+tp': one rank per tensor-parallel group is "
                 "plain FSDP; use parallel=fsdp, or tp_size >= 2")  # fmt: skip
    return p


class Replicated(ParallelStyle):
    """Whole weights on every rank (Replicate DTensors). ``input_layout`` says what each rank's
    input is: the whole tensor (Replicate) or its share of the heads (Shard(2) of (B, T, H, hd)).
    With ``partial_grad`` the output's gradient is a per-rank partial sum (its consumers are
    split by head, as MQA's one K/V head is), reduced over the ranks."""

    def __init__(self, input_layout=None, partial_grad: bool = False):
        super().__init__()
        self.input_layout = input_layout or Replicate()
        self.partial_grad = partial_grad

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        layout = [self.input_layout]
        grad = [Partial()] if self.partial_grad else layout

        def params(name, mod, mesh):
            for n, p in list(mod.named_parameters(recurse=False)):
                d = nn.Parameter(distribute_tensor(p, mesh, [Replicate()]), p.requires_grad)
                mod.register_parameter(n, d)

        def inputs(mod, args, mesh):
            return tuple(
                DTensor.from_local(a, mesh, layout, run_check=False)
                if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
                else a
                for a in args
            )

        def outputs(mod, out, mesh):
            return out.to_local(grad_placements=grad) if isinstance(out, DTensor) else out

        return distribute_module(module, mesh, params, inputs, outputs)


def settle_grads(model: nn.Module) -> None:
    """Reduce gradients left as per-rank partial sums (whole weights fed by split activations:
    norms under sequence parallelism, MQA's K/V) once, before clipping and the update."""
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, p.placements)


def tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """Module name -> how it is split, for ``parallelize_module``."""
    seq, rep = Shard(1), Replicate()
    mqa = model.cfg.kv_heads == 1
    plan: dict[str, ParallelStyle] = {
        # vocabulary-split lookup; the sum over ranks comes back whole for the position stage
        "tok_emb": RowwiseParallel(input_layouts=rep, output_layouts=rep),
        # the head reads the sequence-split stream, writes logits split by vocabulary
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }  # fmt: skip
    for stage in ("pos", "emb_norm"):  # before the blocks: whole weights, whole inputs
        for name, mod in getattr(model, stage).named_modules(prefix=stage):
            if any(True for _ in mod.parameters(recurse=False)):
                plan[name] = Replicated()
    if not isinstance(model.norm, nn.Identity):
        plan["norm"] = SequenceParallel(use_local_output=True)
    nones = (None,) * 5  # a block's other inputs: pos, start, mask, need_weights, kv
    for i, block in enumerate(model.layers):
        b = f"layers.{i}"
        if i == 0:  # the stream enters the blocks split along the sequence
            plan[b] = PrepareModuleInput(
                input_layouts=(rep, *nones),
                desired_input_layouts=(seq, *nones),
                use_local_output=True,
            )
        for n, norm in block.named_children():
            if n.endswith("norm") and not isinstance(norm, nn.Identity):
                plan[f"{b}.{n}"] = SequenceParallel(use_local_output=True)
        plan[f"{b}.attn"] = PrepareModuleInput(
            input_layouts=(seq, *nones), desired_input_layouts=(rep, *nones), use_local_output=True
        )
        plan[f"{b}.attn.wq"] = ColwiseParallel()
        qk_norm = any(True for _ in block.attn.q_norm.parameters())
        if qk_norm:  # per-head norms: whole weights on each rank's heads
            plan[f"{b}.attn.q_norm"] = Replicated(input_layout=Shard(2))
        if mqa:  # one K/V head read by every rank's query heads: whole, gradient summed
            plan[f"{b}.attn.wk"] = Replicated(partial_grad=not qk_norm)
            plan[f"{b}.attn.wv"] = Replicated(partial_grad=True)
            if qk_norm:
                plan[f"{b}.attn.k_norm"] = Replicated(partial_grad=True)
        else:
            plan[f"{b}.attn.wk"] = plan[f"{b}.attn.wv"] = ColwiseParallel()
            if qk_norm:
                plan[f"{b}.attn.k_norm"] = Replicated(input_layout=Shard(2))
        plan[f"{b}.attn.wo"] = RowwiseParallel(output_layouts=seq)
        plan[f"{b}.mlp"] = PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(rep,), use_local_output=True
        )
        for n in ("w1", "w3"):
            if hasattr(block.mlp, n):
                plan[f"{b}.mlp.{n}"] = ColwiseParallel()
        plan[f"{b}.mlp.w2"] = RowwiseParallel(output_layouts=seq)
    return plan


def split_dims(model: nn.Module) -> dict[str, int | None]:
    """Parameter name -> the dimension ``tp_plan`` splits over the tensor-parallel ranks, None for
    a parameter every rank holds whole (what the memory accounting counts per rank). Column-wise:
    a linear's output features, its bias too (dim 0); row-wise: its input features (dim 1), the
    bias whole; an embedding split row-wise holds its vocabulary rows (dim 0)."""
    plan = tp_plan(model)
    dims: dict[str, int | None] = {}
    for prefix, module in model.named_modules():
        style = plan.get(prefix)
        for name, _ in module.named_parameters(recurse=False):
            dim = None
            if isinstance(style, ColwiseParallel):
                dim = 1 if isinstance(module, nn.Embedding) else 0
            elif isinstance(style, RowwiseParallel):
                dim = 0 if isinstance(module, nn.Embedding) else (1 if name == "weight" else None)
            dims[f"{prefix}.{name}" if prefix else name] = dim
    return dims


def parallelize(model: nn.Module, mesh: DeviceMesh, block_size: int | None = None) -> nn.Module:
    """Split ``model`` over the 1-D ``mesh`` in place (see the module docstring); ties kept.
    ``block_size``: the training sequence length, checked to split evenly."""
    problems = tp_problems(model.cfg, mesh.size(), block_size)
    if problems:
        raise ValueError("tensor parallelism: " + "; ".join(problems))
    tied = model.lm_head.weight is model.tok_emb.weight
    # DTensor logs a warning per rank whenever a 2-D collective takes two steps (the gradient norm,
    # the checkpoint's gather): once a step at most, so its advice is noise in a training log
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    parallelize_module(model, mesh, tp_plan(model))
    if tied:  # both hold the (vocab, dim) matrix split by rows: one shared DTensor again
        model.lm_head.weight = model.tok_emb.weight
    return model


def loss_context():
    """Where the loss is computed on vocabulary shards (and its backward runs)."""
    return loss_parallel()


def local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: the local value of a replicated DTensor (the loss under ``loss_context``)."""
    return t.to_local() if isinstance(t, DTensor) else t
