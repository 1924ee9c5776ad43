"""Parameter accounting: where a model's parameters, FLOPs and KV-cache bytes go.

The model is built on the ``meta`` device, so a 8B-parameter preset costs no memory to count.
Every block of a model is identical, so one block's table times ``n_layers`` is the stack.
"""

from __future__ import annotations

import torch

from llm_foundry.config import ModelConfig
from llm_foundry.models import Transformer

# What each parameter tensor is, in the config's own words (module path within its owner -> formula).
FORMULAS = {
    "tok_emb.weight": "vocab_size x dim",
    "pos.emb.weight": "max_seq_len x dim",
    "attn.wq.weight": "dim x (n_heads x head_dim)",
    "attn.wk.weight": "dim x (n_kv_heads x head_dim)",
    "attn.wv.weight": "dim x (n_kv_heads x head_dim)",
    "attn.wo.weight": "(n_heads x head_dim) x dim",
    "attn.wq.bias": "n_heads x head_dim",
    "attn.wk.bias": "n_kv_heads x head_dim",
    "attn.wv.bias": "n_kv_heads x head_dim",
    "attn.wo.bias": "dim",
    "attn.q_norm.weight": "head_dim",
    "attn.k_norm.weight": "head_dim",
    "mlp.w1.weight": "dim x hidden_dim",
    "mlp.w3.weight": "dim x hidden_dim",
    "mlp.w2.weight": "hidden_dim x dim",
    "mlp.w1.bias": "hidden_dim",
    "mlp.w3.bias": "hidden_dim",
    "mlp.w2.bias": "dim",
    "mlp.router.weight": "dim x n_experts",
    "mlp.w1": "n_experts x dim x expert_hidden_dim",
    "mlp.w3": "n_experts x dim x expert_hidden_dim",
    "mlp.w2": "n_experts x expert_hidden_dim x dim",
    "mlp.shared.w1.weight": "dim x (n_shared_experts x expert_hidden_dim)",
    "mlp.shared.w3.weight": "dim x (n_shared_experts x expert_hidden_dim)",
    "mlp.shared.w2.weight": "(n_shared_experts x expert_hidden_dim) x dim",
    "lm_head.weight": "dim x vocab_size",
}


def meta_model(cfg: ModelConfig) -> Transformer:
    """The model with shapes but no storage: free to build at any size."""
    with torch.device("meta"):
        return Transformer(cfg)


def _formula(name: str) -> str:
    if name in FORMULAS:
        return FORMULAS[name]
    return "dim" if name.endswith((".weight", ".bias")) else ""  # norms


def param_report(cfg: ModelConfig, seq_len: int | None = None) -> dict:
    """Per-component parameter counts, totals, FLOPs per token and KV-cache bytes.

    Returns a JSON-ready dict: ``rows`` (component, formula, count, per_layer), ``total``,
    ``non_embedding``, ``active`` (parameters each token uses), ``flops_per_token`` at context
    ``seq_len`` (default ``max_seq_len``), ``kv_cache`` per token and per ``seq_len``-token
    sequence for fp32 and bf16.
    """
    model = meta_model(cfg)
    rows = []
    seen: set[int] = set()
    block_total = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # tied head: same tensor as the token embedding
            rows.append(dict(component=name, formula="shared with tok_emb.weight", count=0))
            continue
        seen.add(id(p))
        if name.startswith("layers."):
            index, local = name.split(".", 2)[1:]
            if index == "0":
                rows.append(
                    dict(component=f"block.{local}", formula=_formula(local), count=p.numel())
                )
                block_total += p.numel()
            continue
        rows.append(dict(component=name, formula=_formula(name), count=p.numel()))
    # place the per-block rows and the stack total where the blocks sit (after the embeddings)
    block_rows = [r for r in rows if r["component"].startswith("block.")]
    other = [r for r in rows if not r["component"].startswith("block.")]
    head_start = next(
        i for i, r in enumerate(other) if r["component"].startswith(("norm.", "lm_head"))
    )
    stack = dict(
        component=f"blocks x {cfg.n_layers}",
        formula=f"{block_total:,} x n_layers",
        count=block_total * cfg.n_layers,
    )
    rows = other[:head_start] + block_rows + [stack] + other[head_start:]
    seq = seq_len or cfg.max_seq_len
    return dict(
        config=cfg.to_dict(),
        rows=rows,
        per_block=block_total,
        total=model.num_params(),
        non_embedding=model.num_params(non_embedding=True),
        active=model.active_params(),
        flops_per_token=model.flops_per_token(seq),
        flops_seq_len=seq,
        kv_cache=dict(
            fp32_per_token=model.kv_cache_bytes_per_token(4),
            bf16_per_token=model.kv_cache_bytes_per_token(2),
            fp32_per_sequence=model.kv_cache_bytes_per_token(4) * seq,
            bf16_per_sequence=model.kv_cache_bytes_per_token(2) * seq,
            seq_len=seq,
        ),
    )


def human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23M' (binary units for bytes)."""
    if unit == "B":
        for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(n) < 1024 or suffix == "TiB":
                return f"{n:.0f} {suffix}" if suffix == "B" else f"{n:.2f} {suffix}"
            n /= 1024
    for suffix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:.0f}"


def format_report(rep: dict, title: str = "") -> str:
    """The report as an aligned text table."""
    lines = [title] if title else []
    w = max(len(r["component"]) for r in rep["rows"]) + 2
    fw = max(len(r["formula"]) for r in rep["rows"]) + 2
    lines.append(f"{'component':<{w}}{'formula':<{fw}}{'parameters':>16}")
    lines.append("-" * (w + fw + 16))
    for r in rep["rows"]:
        lines.append(f"{r['component']:<{w}}{r['formula']:<{fw}}{r['count']:>16,}")
    lines.append("-" * (w + fw + 16))
    lines.append(f"{'total':<{w + fw}}{rep['total']:>16,}  ({human(rep['total'])})")
    ne = rep["non_embedding"]
    lines.append(f"{'non-embedding':<{w + fw}}{ne:>16,}  ({human(ne)})")
    if rep["active"] != rep["total"]:  # only models whose tokens skip parameters (experts)
        a = rep["active"]
        lines.append(f"{'active per token':<{w + fw}}{a:>16,}  ({human(a)})")
    lines.append("")
    f = rep["flops_per_token"]
    lines.append(
        f"training FLOPs per token at seq_len {rep['flops_seq_len']}: {f:,} ({human(f)}FLOP)"
    )
    kv = rep["kv_cache"]
    lines.append(
        f"KV cache per token: {human(kv['fp32_per_token'], 'B')} fp32, "
        f"{human(kv['bf16_per_token'], 'B')} bf16; per {kv['seq_len']}-token sequence: "
        f"{human(kv['fp32_per_sequence'], 'B')} fp32, {human(kv['bf16_per_sequence'], 'B')} bf16"
    )
    return "\n".join(lines)


def lora_report(cfg: ModelConfig, r: int, targets: list[str]) -> dict:
    """What LoRA adapters of rank ``r`` on ``targets`` add: adapter parameters per target kind
    (r x (in + out) per adapted matrix, summed over layers), their share of the model, and the
    AdamW state (two fp32 moments) of a LoRA run against a full fine-tune."""
    from llm_foundry.models.lora import add_lora, lora_layers

    model = meta_model(cfg)
    total = model.num_params()
    add_lora(model, targets, r=r)
    per_kind: dict[str, int] = {}
    for name, lora in lora_layers(model).items():
        kind = name.split(".")[-1]
        per_kind[kind] = per_kind.get(kind, 0) + lora.lora_A.numel() + lora.lora_B.numel()
    trainable = sum(per_kind.values())
    return dict(
        r=r,
        targets=per_kind,
        trainable=trainable,
        fraction=trainable / total,
        adamw_bytes_lora=8 * trainable,
        adamw_bytes_full=8 * total,
    )


def format_lora(rep: dict) -> str:
    lines = [f"LoRA r={rep['r']}: adapter parameters per target"]
    for kind, n in rep["targets"].items():
        lines.append(f"  {kind:<10}{n:>16,}")
    lines.append(
        f"  {'total':<10}{rep['trainable']:>16,}  ({rep['fraction']:.3%} of the model); AdamW "
        f"state {human(rep['adamw_bytes_lora'], 'B')} instead of "
        f"{human(rep['adamw_bytes_full'], 'B')}"
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Activations per device (training memory per layout: llm_foundry.train.memory.memory_report)


def layer_activation_bytes(
    cfg: ModelConfig, t: int, batch_size: int, seq_len: int, act_bytes: int, residual_bytes: int
) -> int:
    """Bytes one block keeps for backward on one TP rank, for one (batch_size, seq_len) micro-batch.

    Korthikanti et al. 2022 (arXiv:2205.05198, section 4.1) count s*b*h*(34 + 5*a*s/h) bytes per
    layer in 16-bit for GPT; this recounts the same tensors for this model's blocks, in units of
    s*b elements: the norm inputs (the residual stream: ``residual_bytes``, fp32 under autocast),
    the attention and MLP input projections' inputs (h each), Q and the attention output
    (n_heads*head_dim each), K and V (n_kv_heads*head_dim each), and the MLP's hidden tensors (a
    gated MLP keeps 4 of width hidden_dim: w1's output, its activation, w3's output and their
    product; a plain one keeps 2; a MoE layer k + n_shared experts' worth). No s x s term: the
    attention is PyTorch's SDPA, whose fused kernels keep no attention matrix; no dropout masks
    (dropout 0). So a GPT-2 block in 16-bit is 32*s*b*h: Korthikanti's 34 less its two masks.

    TP as ``llm_foundry.train.tensor_parallel`` plans it: sequence parallelism between blocks
    (the norm inputs split t ways along the sequence), Q, K, V, the attention output and the MLP's
    hidden tensors split t ways by head / hidden unit; the projections' inputs are gathered whole
    and kept whole for backward (Megatron's sequence parallelism keeps them split and gathers them
    again in backward: Korthikanti's 34/t). A single MQA K/V head stays whole. Per-head q/k norms,
    RoPE and biases are not counted.
    """
    h, q, kv = cfg.dim, cfg.n_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    kv_t = 1 if cfg.kv_heads == 1 else t  # one K/V head is replicated, not split
    norms = 1 if cfg.parallel_block else 2  # a parallel block's norms all read the same input
    inputs = cfg.parallel_norms if cfg.parallel_block else 2  # one normed tensor feeds q/k/v too
    hidden = 4 if cfg.gated else 2
    if cfg.n_experts:  # routed tokens run k experts (and the shared ones); TP refuses MoE
        mlp = hidden * (cfg.experts_per_token + cfg.n_shared_experts) * cfg.expert_ffn_dim
    else:
        mlp = hidden * -(-cfg.ffn_dim // t)
    split = (2 * q) // t + (2 * kv) // kv_t + mlp
    stream = residual_bytes * norms * -(-h // t)  # sequence-split: 1/t of the positions
    return batch_size * seq_len * (stream + act_bytes * (inputs * h + split))


def activation_bytes(
    cfg: ModelConfig,
    t: int,
    batch_size: int,
    seq_len: int,
    dtype: str = "fp32",
    activation_checkpointing: bool = False,
) -> int:
    """Activation bytes on one TP rank for one micro-batch: every block's (see
    ``layer_activation_bytes``) or, with activation checkpointing, each block's input (split t
    ways along the sequence) plus one block's recomputed activations; and the head's: the final
    norm's input (sequence-split), lm_head's input (gathered whole) and the logits,
    s*b*V/t*(act_bytes + 4) (the logits plus cross-entropy's fp32 log-probabilities, both split by
    vocabulary: TP computes the loss on vocabulary shards)."""
    act = 2 if dtype == "bf16" else 4  # bf16 autocast computes matmuls in bf16
    res = 4  # the residual stream (embedding output plus fp32 additions) stays fp32
    layer = layer_activation_bytes(cfg, t, batch_size, seq_len, act, res)
    tokens = batch_size * seq_len
    if activation_checkpointing:
        blocks = cfg.n_layers * tokens * res * -(-cfg.dim // t) + layer
    else:
        blocks = cfg.n_layers * layer
    head = tokens * (res * -(-cfg.dim // t) + act * cfg.dim + -(-cfg.vocab_size // t) * (act + 4))
    return blocks + head
