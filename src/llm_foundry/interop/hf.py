"""Convert models between llm-foundry and Hugging Face ``transformers``, exactly or not at all.

Families: LLaMA (``LlamaConfig``), Mistral (``MistralConfig``: sliding window), Qwen3
(``Qwen3Config``: QK-norm, explicit head_dim), GPT-2 (``GPT2Config``: learned positions,
LayerNorm with biases, fused Conv1D q/k/v), and the mixtures of experts Mixtral
(``MixtralConfig``) and Qwen3-MoE (``Qwen3MoeConfig``), read with their experts stored one
tensor per expert (as on the Hub and as ``save_pretrained`` writes them, the layout written
here) or fused per layer (transformers 5 in memory). Every HF setting is either mapped to the
``ModelConfig`` field that computes the same function, or refused with a ``ConversionError``
naming the setting, its value and what is supported; nothing is approximated silently.

    config_from_hf(hf_config) -> ModelConfig         config_to_hf(cfg) -> PretrainedConfig
    from_hf(model_or_dir) -> Transformer             to_hf(model, out_dir) -> out_dir
    convert_from_hf(src_dir, out_ckpt)               convert_to_hf(ckpt_dir, out_dir)

Weights are renamed with tables (HF name -> ours, ``{i}`` the layer index, ``{e}`` the expert). LLaMA-family RoPE
uses the rotate-half layout on both sides, so q/k load without permutation; GPT-2's Conv1D stores
(in, out) and its ``c_attn`` fuses q, k, v along the output dimension. Checkpoint directories are
read with safetensors only (never pickle). Training-time dropout is not carried over from HF.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from llm_foundry.checkpoint import (
    check_finite,
    check_layer_count,
    meta_transformer,
    read_safetensors_header,
    unwrap,
)
from llm_foundry.config import ModelConfig
from llm_foundry.models.transformer import Transformer

try:
    import transformers
except ImportError as e:  # pragma: no cover - depends on the environment
    from llm_foundry.package import install_line

    raise ImportError(
        f"llm_foundry.interop.hf needs the transformers package: {install_line('hf')}"
    ) from e

# transformers 5 keeps rope_theta and the scaling in one ``rope_parameters`` dict
_HF_V5 = int(transformers.__version__.split(".")[0]) >= 5
log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"


class ConversionError(ValueError):
    """A config or checkpoint cannot be converted exactly; the message says what and why."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or [message]


# ----------------------------------------------------------------------------------------------
# Activations and RoPE scaling: HF name <-> ours

# LLaMA-family ``hidden_act``: the MLP is down(act(gate x) * up x) -> our (mlp, gelu_approx)
LLAMA_ACTS = {
    "silu": ("swiglu", "none"),
    "swish": ("swiglu", "none"),
    "gelu": ("geglu", "none"),
    "gelu_pytorch_tanh": ("geglu", "tanh"),
    "gelu_new": ("geglu", "tanh"),
}
LLAMA_ACTS_OUT = {  # our mlp -> gelu_approx -> hidden_act
    "swiglu": {"none": "silu", "tanh": "silu"},
    "geglu": {"none": "gelu", "tanh": "gelu_pytorch_tanh"},
}
# GPT-2 ``activation_function``: the MLP is c_proj(act(c_fc x)) -> our (mlp, gelu_approx)
GPT2_ACTS = {
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "gelu": ("gelu", "none"),
    "relu": ("relu", "none"),
}
GPT2_ACTS_OUT = {
    "gelu": {"tanh": "gelu_new", "none": "gelu"},
    "relu": {"none": "relu", "tanh": "relu"},
}
# HF rope_type -> our rope_scaling; the others are refused with the reason
ROPE_TYPES = {"default": "none", "linear": "linear"}
ROPE_TYPES_REFUSED = {
    "dynamic": "dynamic NTK changes the base with the sequence length once it passes "
    "max_position_embeddings; llm-foundry's rope_scaling='ntk' is a fixed base",
    "yarn": "YaRN blends interpolated and extrapolated frequencies and rescales attention",
    "longrope": "LongRoPE uses per-frequency factors that switch with the sequence length",
    "llama3": "Llama 3.1 scaling smooths frequencies band by band",
}


# ----------------------------------------------------------------------------------------------
# Weight-name tables: HF tensor name (as in *ForCausalLM.state_dict()) -> ours


@dataclass(frozen=True)
class Rule:
    """How one HF tensor maps to ours: our tensors concatenated along ``dim`` (several for a
    fused q/k/v or gate/up projection), transposed first where HF stores a GPT-2 Conv1D weight
    as (in, out) instead of nn.Linear's (out, in). A name with ``{e}`` is one expert's slice
    ``expert`` of our stacked expert tensor."""

    ours: tuple[str, ...]
    conv1d: bool = False
    dim: int = 0
    expert: int | None = None
    # a fused q/k/v stored group by group (BLOOM: per head; Falcon: per key/value head): the
    # rows are G groups of [q, k, v] slices; "heads" or "kv_heads" names G, set per model
    groups: str | int | None = None


def _wb(hf: str, ours: str) -> dict[str, str]:
    """Weight and bias of one module under the same suffixes."""
    return {f"{hf}.weight": f"{ours}.weight", f"{hf}.bias": f"{ours}.bias"}


LLAMA_WEIGHTS: dict[str, str | Rule] = {
    "model.embed_tokens.weight": "tok_emb.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
    **_wb("model.layers.{i}.self_attn.q_proj", "layers.{i}.attn.wq"),
    **_wb("model.layers.{i}.self_attn.k_proj", "layers.{i}.attn.wk"),
    **_wb("model.layers.{i}.self_attn.v_proj", "layers.{i}.attn.wv"),
    **_wb("model.layers.{i}.self_attn.o_proj", "layers.{i}.attn.wo"),
    "model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.attn.q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.attn.k_norm.weight",
    **_wb("model.layers.{i}.mlp.gate_proj", "layers.{i}.mlp.w1"),
    **_wb("model.layers.{i}.mlp.up_proj", "layers.{i}.mlp.w3"),
    **_wb("model.layers.{i}.mlp.down_proj", "layers.{i}.mlp.w2"),
}

GPT2_WEIGHTS: dict[str, str | Rule] = {
    "transformer.wte.weight": "tok_emb.weight",
    "transformer.wpe.weight": "pos.emb.weight",
    **_wb("transformer.ln_f", "norm"),
    "lm_head.weight": "lm_head.weight",
    **_wb("transformer.h.{i}.ln_1", "layers.{i}.attn_norm"),
    **_wb("transformer.h.{i}.ln_2", "layers.{i}.mlp_norm"),
    "transformer.h.{i}.attn.c_attn.weight": Rule(
        ("layers.{i}.attn.wq.weight", "layers.{i}.attn.wk.weight", "layers.{i}.attn.wv.weight"),
        conv1d=True,
    ),
    "transformer.h.{i}.attn.c_attn.bias": Rule(
        ("layers.{i}.attn.wq.bias", "layers.{i}.attn.wk.bias", "layers.{i}.attn.wv.bias")
    ),
    "transformer.h.{i}.attn.c_proj.weight": Rule(("layers.{i}.attn.wo.weight",), conv1d=True),
    "transformer.h.{i}.attn.c_proj.bias": "layers.{i}.attn.wo.bias",
    "transformer.h.{i}.mlp.c_fc.weight": Rule(("layers.{i}.mlp.w1.weight",), conv1d=True),
    "transformer.h.{i}.mlp.c_fc.bias": "layers.{i}.mlp.w1.bias",
    "transformer.h.{i}.mlp.c_proj.weight": Rule(("layers.{i}.mlp.w2.weight",), conv1d=True),
    "transformer.h.{i}.mlp.c_proj.bias": "layers.{i}.mlp.w2.bias",
}

BLOOM_WEIGHTS: dict[str, str | Rule] = {
    "transformer.word_embeddings.weight": "tok_emb.weight",
    **_wb("transformer.word_embeddings_layernorm", "emb_norm"),
    **_wb("transformer.ln_f", "norm"),
    "lm_head.weight": "lm_head.weight",
    **_wb("transformer.h.{i}.input_layernorm", "layers.{i}.attn_norm"),
    **_wb("transformer.h.{i}.post_attention_layernorm", "layers.{i}.mlp_norm"),
    "transformer.h.{i}.self_attention.query_key_value.weight": Rule(
        ("layers.{i}.attn.wq.weight", "layers.{i}.attn.wk.weight", "layers.{i}.attn.wv.weight"),
        groups="heads",
    ),
    "transformer.h.{i}.self_attention.query_key_value.bias": Rule(
        ("layers.{i}.attn.wq.bias", "layers.{i}.attn.wk.bias", "layers.{i}.attn.wv.bias"),
        groups="heads",
    ),
    **_wb("transformer.h.{i}.self_attention.dense", "layers.{i}.attn.wo"),
    **_wb("transformer.h.{i}.mlp.dense_h_to_4h", "layers.{i}.mlp.w1"),
    **_wb("transformer.h.{i}.mlp.dense_4h_to_h", "layers.{i}.mlp.w2"),
}


def _falcon_weights(cfg: ModelConfig) -> dict[str, str | Rule]:
    """Falcon's names; its norms depend on the block: input_layernorm (+ post_attention_layernorm
    in sequential blocks), or ln_attn + ln_mlp (two norms in parallel, Falcon-40B). q/k/v are
    fused key/value head by key/value head ([q of the group's heads, k, v] per group), which is
    also the old layouts' order: MQA (one group) and MHA (a group per head)."""
    h = "transformer.h.{i}."
    norms = {**_wb(h + "input_layernorm", "layers.{i}.attn_norm")}
    if cfg.parallel_block and cfg.parallel_norms == 2:
        norms = {
            **_wb(h + "ln_attn", "layers.{i}.attn_norm"),
            **_wb(h + "ln_mlp", "layers.{i}.mlp_norm"),
        }
    elif not cfg.parallel_block:
        norms.update(_wb(h + "post_attention_layernorm", "layers.{i}.mlp_norm"))
    qkv = ("layers.{i}.attn.wq", "layers.{i}.attn.wk", "layers.{i}.attn.wv")
    return {
        "transformer.word_embeddings.weight": "tok_emb.weight",
        **_wb("transformer.ln_f", "norm"),
        "lm_head.weight": "lm_head.weight",
        **norms,
        h + "self_attention.query_key_value.weight": Rule(
            tuple(f"{n}.weight" for n in qkv), groups="kv_heads"
        ),
        h + "self_attention.query_key_value.bias": Rule(
            tuple(f"{n}.bias" for n in qkv), groups="kv_heads"
        ),
        **_wb(h + "self_attention.dense", "layers.{i}.attn.wo"),
        **_wb(h + "mlp.dense_h_to_4h", "layers.{i}.mlp.w1"),
        **_wb(h + "mlp.dense_4h_to_h", "layers.{i}.mlp.w2"),
    }


# Mixtral as saved on disk (per-expert tensors, as the Hub checkpoints and save_pretrained have
# them); in memory transformers 5 fuses each layer's experts into gate_up_proj and down_proj
MIXTRAL_WEIGHTS: dict[str, str | Rule] = {
    **{k: v for k, v in LLAMA_WEIGHTS.items() if ".mlp." not in k},
    "model.layers.{i}.block_sparse_moe.gate.weight": "layers.{i}.mlp.router.weight",
    "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight": "layers.{i}.mlp.w1",
    "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight": "layers.{i}.mlp.w3",
    "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight": "layers.{i}.mlp.w2",
}
QWEN3_MOE_WEIGHTS: dict[str, str | Rule] = {
    **{k: v for k, v in LLAMA_WEIGHTS.items() if ".mlp." not in k},
    "model.layers.{i}.mlp.gate.weight": "layers.{i}.mlp.router.weight",
    "model.layers.{i}.mlp.experts.{e}.gate_proj.weight": "layers.{i}.mlp.w1",
    "model.layers.{i}.mlp.experts.{e}.up_proj.weight": "layers.{i}.mlp.w3",
    "model.layers.{i}.mlp.experts.{e}.down_proj.weight": "layers.{i}.mlp.w2",
}
# the fused layout (transformers 5 in memory, and checkpoints written from it): read, not written
FUSED_EXPERTS: dict[str, str | Rule] = {
    "model.layers.{i}.mlp.gate.weight": "layers.{i}.mlp.router.weight",
    "model.layers.{i}.mlp.experts.gate_up_proj": Rule(
        ("layers.{i}.mlp.w1", "layers.{i}.mlp.w3"), dim=1
    ),
    "model.layers.{i}.mlp.experts.down_proj": "layers.{i}.mlp.w2",
}

# HF tensors that hold no weights and are skipped knowingly (buffers of older checkpoints)
LLAMA_IGNORED = (r"\.rotary_emb\.inv_freq$",)
GPT2_IGNORED = (r"(^|\.)h\.\d+\.attn\.(bias|masked_bias)$",)  # causal-mask buffers


# ----------------------------------------------------------------------------------------------
# HF config -> ours


def _fail(problems: list[str], what: str) -> None:
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConversionError(f"{what} ({len(problems)} problem(s)):\n{lines}", problems)


def _lookup(c: Any, attr: str, table: dict[str, Any], problems: list[str]) -> Any:
    """``table[c.attr]``, or a problem naming the value and the supported ones."""
    value = getattr(c, attr, None)
    if value not in table:
        problems.append(
            f"{attr}={value!r} is not supported for {c.model_type}; supported: "
            f"{', '.join(map(repr, table))}"
        )
        return next(iter(table.values()))
    return table[value]


# (HF attribute, supported values, value when absent, why others cannot be represented)
Setting = tuple[str, tuple, Any, str]
ROPE_FAMILY_SETTINGS: list[Setting] = [
    ("partial_rotary_factor", (None, 1, 1.0), None, "llm-foundry rotates the whole head"),
]
GPT2_SETTINGS: list[Setting] = [
    ("scale_attn_weights", (True,), True, "llm-foundry always scales scores by 1/sqrt(head_dim)"),
    (
        "scale_attn_by_inverse_layer_idx",
        (False,),
        False,
        "llm-foundry has no per-layer attention scaling",
    ),
    (
        "reorder_and_upcast_attn",
        (False,),
        False,
        "llm-foundry does not reproduce this attention ordering/upcasting",
    ),
    ("add_cross_attention", (False,), False, "llm-foundry models are decoder-only"),
]


BLOOM_SETTINGS: list[Setting] = [
    (
        "apply_residual_connection_post_layernorm",
        (False,),
        False,
        "llm-foundry's residual stream carries the block input, not its normalised form",
    ),
]


def _check_settings(c: Any, settings: list[Setting], problems: list[str]) -> None:
    for attr, allowed, absent, why in settings:
        value = getattr(c, attr, absent)
        if value not in allowed:
            problems.append(
                f"{attr}={value!r} is not supported ({why}); supported: "
                f"{', '.join(map(repr, allowed))}"
            )


def _rope_from_hf(c: Any, problems: list[str]) -> dict[str, Any]:
    """rope_theta / rope_scaling / rope_factor from ``rope_parameters`` (transformers 5) or
    ``rope_theta`` + ``rope_scaling`` (transformers 4)."""
    params = getattr(c, "rope_parameters", None) if _HF_V5 else None
    if params is None:
        params = dict(getattr(c, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(c, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        why = ROPE_TYPES_REFUSED.get(rope_type, "unknown RoPE variant")
        problems.append(
            f"rope_type={rope_type!r} is not supported ({why}); supported: "
            f"{', '.join(map(repr, ROPE_TYPES))}"
        )
        rope_type = "default"
    partial = params.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        problems.append(
            f"partial_rotary_factor={partial!r} is not supported (llm-foundry rotates the whole "
            "head); supported: 1.0"
        )
    scaling = ROPE_TYPES[rope_type]
    factor = float(params.get("factor", 1.0)) if scaling != "none" else 1.0
    theta = float(params.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_factor": factor}


def _llama_family_fields(c: Any, problems: list[str]) -> dict[str, Any]:
    """Fields shared by LLaMA, Mistral and Qwen3: RoPE, RMSNorm, gated MLP, pre-norm."""
    _check_settings(c, ROPE_FAMILY_SETTINGS, problems)
    mlp, approx = _lookup(c, "hidden_act", LLAMA_ACTS, problems)
    heads = c.num_attention_heads
    hd = getattr(c, "head_dim", None)
    default_hd = c.hidden_size // heads if c.hidden_size % heads == 0 else None
    kv = getattr(c, "num_key_value_heads", None) or heads
    return dict(
        vocab_size=c.vocab_size,
        dim=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=kv if kv != heads else None,  # None: MHA, as in the presets
        head_dim=hd if hd is not None and hd != default_hd else None,
        hidden_dim=c.intermediate_size,
        max_seq_len=c.max_position_embeddings,
        pos_encoding="rope",
        **_rope_from_hf(c, problems),
        norm="rmsnorm",
        norm_position="pre",
        norm_eps=float(c.rms_norm_eps),
        mlp=mlp,
        gelu_approx=approx,
        attn_bias=bool(getattr(c, "attention_bias", False)),
        mlp_bias=bool(getattr(c, "mlp_bias", False)),
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        init_std=float(getattr(c, "initializer_range", 0.02)),
    )


def _llama_from_hf(c: Any, problems: list[str]) -> dict[str, Any]:
    return _llama_family_fields(c, problems)


def _mistral_from_hf(c: Any, problems: list[str]) -> dict[str, Any]:
    """Mistral: LLaMA plus one sliding window on every layer (None: full attention)."""
    return {**_llama_family_fields(c, problems), "sliding_window": c.sliding_window}


def _qwen3_from_hf(c: Any, problems: list[str]) -> dict[str, Any]:
    """Qwen3: LLaMA plus QK-norm; a sliding window only if every layer uses it (HF slides layers
    i >= max_window_layers when use_sliding_window, ours slides all or none)."""
    layer_types = getattr(c, "layer_types", None)
    if layer_types is None:  # transformers 4 without layer_types
        slide = bool(getattr(c, "use_sliding_window", False))
        start = getattr(c, "max_window_layers", 0)
        layer_types = [
            "sliding_attention" if slide and i >= start else "full_attention"
            for i in range(c.num_hidden_layers)
        ]
    kinds = set(layer_types)
    window = None
    if kinds == {"sliding_attention"}:
        window = c.sliding_window
    elif kinds != {"full_attention"}:
        problems.append(
            f"layer_types mixes {sorted(kinds)} (use_sliding_window="
            f"{getattr(c, 'use_sliding_window', None)!r}, max_window_layers="
            f"{getattr(c, 'max_window_layers', None)!r}); llm-foundry applies one sliding_window "
            "to every layer. Supported: use_sliding_window=False, or max_window_layers=0"
        )
    return {**_llama_family_fields(c, problems), "qk_norm": True, "sliding_window": window}


def _experts_from_hf(
    c: Any, n_experts: int, hidden: int, renormalize: bool, problems: list[str], name: str
) -> dict[str, Any]:
    k = c.num_experts_per_tok
    if not (isinstance(n_experts, int) and n_experts >= 1 and 1 <= k <= n_experts):
        problems.append(
            f"{name}={n_experts!r}, num_experts_per_tok={k!r}: a mixture of experts needs at "
            "least one expert and 1 <= num_experts_per_tok <= the expert count"
        )
        return {}
    return dict(
        hidden_dim=None,  # no dense MLP: every layer's is experts
        n_experts=n_experts,
        experts_per_token=c.num_experts_per_tok,
        expert_hidden_dim=hidden,
        moe_renormalize=renormalize,
        router_jitter=float(getattr(c, "router_jitter_noise", 0.0) or 0.0),
        moe_aux_loss_coef=float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0),
    )


def _mixtral_from_hf(c: Any, problems: list[str]) -> dict[str, Any]:
    """Mixtral: Mistral with every MLP replaced by top-k experts, renormalised over the k."""
    fields = _mistral_from_hf(c, problems)
    experts = _experts_from_hf(
        c, c.num_local_experts, c.intermediate_size, True, problems, "num_local_experts"
    )
    return {**fields, **experts}


def _qwen3_moe_from_hf(c: Any, problems: list[str]) -> dict[str, Any]:
    """Qwen3-MoE: Qwen3 with experts in every layer (renormalised when norm_topk_prob)."""
    step, dense = getattr(c, "decoder_sparse_step", 1), list(getattr(c, "mlp_only_layers", []))
    if step != 1 or dense:
        problems.append(
            f"decoder_sparse_step={step!r}, mlp_only_layers={dense!r}: some layers have a dense "
            "MLP; llm-foundry puts experts in every layer or none (supported: 1 and [])"
        )
    fields = _qwen3_from_hf(c, problems)
    renorm = bool(getattr(c, "norm_topk_prob", False))
    experts = _experts_from_hf(
        c, c.num_experts, c.moe_intermediate_size, renorm, problems, "num_experts"
    )
    return {**fields, **experts}


def _bloom_from_hf(c: Any, problems: list[str]) -> dict[str, Any]:
    """BLOOM: ALiBi, a LayerNorm right after the embedding, LayerNorms and linear layers with
    biases, a tanh-GELU MLP four times as wide, q/k/v fused head by head."""
    _check_settings(c, BLOOM_SETTINGS, problems)
    return dict(
        vocab_size=c.vocab_size,
        dim=c.hidden_size,
        n_layers=c.n_layer,
        n_heads=c.n_head,
        hidden_dim=4 * c.hidden_size,
        max_seq_len=int(getattr(c, "seq_length", None) or 2048),  # ALiBi has no table to size
        pos_encoding="alibi",
        norm="layernorm",
        norm_position="pre",
        norm_bias=True,
        norm_eps=float(c.layer_norm_epsilon),
        embed_norm=True,
        mlp="gelu",
        gelu_approx="tanh",
        attn_bias=True,
        mlp_bias=True,
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        init_std=float(getattr(c, "initializer_range", 0.02)),
    )


FALCON_ACTS = {
    "gelu": ("gelu", "none"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "relu": ("relu", "none"),
}
FALCON_ACTS_OUT = {
    ("gelu", "none"): "gelu",
    ("gelu", "tanh"): "gelu_pytorch_tanh",
    ("relu", "none"): "relu",
}


def _falcon_from_hf(c: Any, problems: list[str]) -> dict[str, Any]:
    """Falcon, both layouts: the original (parallel or sequential blocks, MHA or MQA) and
    new_decoder_architecture (GQA, parallel blocks with one or two norms). RoPE only."""
    if getattr(c, "alibi", False):
        problems.append(
            "alibi=True is not supported: Falcon rounds its ALiBi biases to bfloat16 and scales "
            "them by 1/sqrt(head_dim), which llm-foundry's ALiBi does not; supported: alibi=False"
        )
    new = bool(c.new_decoder_architecture)
    parallel = bool(c.parallel_attn)
    if new and not parallel:
        problems.append(
            "new_decoder_architecture=True with parallel_attn=False has no block in transformers "
            "either; supported: parallel_attn=True"
        )
    n_ln = (getattr(c, "num_ln_in_parallel_attn", None) or 2) if new else 1
    heads = c.num_attention_heads
    kv = c.num_kv_heads if new else (1 if c.multi_query else heads)
    mlp, approx = _lookup(c, "activation", FALCON_ACTS, problems)
    return dict(
        vocab_size=c.vocab_size,
        dim=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=kv if kv != heads else None,
        hidden_dim=getattr(c, "ffn_hidden_size", None) or 4 * c.hidden_size,
        max_seq_len=c.max_position_embeddings,
        pos_encoding="rope",
        **_rope_from_hf(c, problems),
        norm="layernorm",
        norm_position="pre",
        norm_bias=True,
        norm_eps=float(c.layer_norm_epsilon),
        mlp=mlp,
        gelu_approx=approx,
        parallel_block=parallel,
        parallel_norms=n_ln if parallel else 1,
        attn_bias=bool(c.bias),
        mlp_bias=bool(c.bias),
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        init_std=float(getattr(c, "initializer_range", 0.02)),
    )


def _gpt2_from_hf(c: Any, problems: list[str]) -> dict[str, Any]:
    """GPT-2: learned positions, LayerNorm with biases, biased Conv1D projections."""
    _check_settings(c, GPT2_SETTINGS, problems)
    mlp, approx = _lookup(c, "activation_function", GPT2_ACTS, problems)
    return dict(
        vocab_size=c.vocab_size,
        dim=c.n_embd,
        n_layers=c.n_layer,
        n_heads=c.n_head,
        hidden_dim=c.n_inner or 4 * c.n_embd,
        max_seq_len=c.n_positions,
        pos_encoding="learned",
        norm="layernorm",
        norm_position="pre",
        norm_bias=True,
        norm_eps=float(c.layer_norm_epsilon),
        mlp=mlp,
        gelu_approx=approx,
        attn_bias=True,
        mlp_bias=True,
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        init_std=float(getattr(c, "initializer_range", 0.02)),
    )


# ----------------------------------------------------------------------------------------------
# Our config -> HF


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """RoPE settings as HF config kwargs. Static NTK scaling is plain RoPE with a larger base,
    so it exports exactly as ``rope_theta = theta * factor^(hd / (hd - 2))``."""
    theta, params = cfg.rope_theta, {"rope_type": "default"}
    if cfg.rope_scaling == "linear":
        params = {"rope_type": "linear", "factor": float(cfg.rope_factor)}
    elif cfg.rope_scaling == "ntk":
        hd = cfg.head_size
        theta = theta * cfg.rope_factor ** (hd / (hd - 2))
    if _HF_V5:
        return {"rope_parameters": {**params, "rope_theta": float(theta)}}
    scaling = None if params["rope_type"] == "default" else {**params, "type": params["rope_type"]}
    return {"rope_theta": float(theta), "rope_scaling": scaling}


def _llama_family_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_size,
        hidden_act=LLAMA_ACTS_OUT[cfg.mlp][cfg.gelu_approx],
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        **_rope_to_hf(cfg),
    )


def _llama_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **_llama_family_to_hf(cfg),
        "attention_bias": cfg.attn_bias,
        "mlp_bias": cfg.mlp_bias,
    }


def _mistral_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {**_llama_family_to_hf(cfg), "sliding_window": cfg.sliding_window}


def _qwen3_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    window = cfg.sliding_window
    return {
        **_llama_family_to_hf(cfg),
        "attention_bias": cfg.attn_bias,
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": 0 if window is not None else cfg.n_layers,  # 0: every layer slides
    }


def _experts_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return dict(
        num_experts_per_tok=cfg.experts_per_token,
        router_aux_loss_coef=cfg.moe_aux_loss_coef,
        output_router_logits=False,
    )


def _mixtral_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **_mistral_to_hf(cfg),
        **_experts_to_hf(cfg),
        "intermediate_size": cfg.expert_ffn_dim,
        "num_local_experts": cfg.n_experts,
        "router_jitter_noise": cfg.router_jitter,
    }


def _qwen3_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **_qwen3_to_hf(cfg),
        **_experts_to_hf(cfg),
        "moe_intermediate_size": cfg.expert_ffn_dim,
        "num_experts": cfg.n_experts,
        "norm_topk_prob": cfg.moe_renormalize,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _bloom_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        layer_norm_epsilon=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        apply_residual_connection_post_layernorm=False,
        seq_length=cfg.max_seq_len,
    )


def _falcon_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The original layout where it can hold the config (MHA or MQA with one shared norm or
    sequential blocks), else new_decoder_architecture."""
    kv = cfg.kv_heads
    new = cfg.parallel_norms == 2 or kv not in (1, cfg.n_heads)
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_kv_heads=kv,
        new_decoder_architecture=new,
        multi_query=kv == 1 and not new,
        parallel_attn=cfg.parallel_block,
        num_ln_in_parallel_attn=cfg.parallel_norms if new else None,
        alibi=False,
        bias=cfg.attn_bias,
        activation=FALCON_ACTS_OUT[(cfg.mlp, cfg.gelu_approx)],
        ffn_hidden_size=cfg.ffn_dim,
        max_position_embeddings=cfg.max_seq_len,
        layer_norm_epsilon=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        **_rope_to_hf(cfg),
    )


def _gpt2_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return dict(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.max_seq_len,
        n_embd=cfg.dim,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        n_inner=cfg.ffn_dim,
        activation_function=GPT2_ACTS_OUT[cfg.mlp][cfg.gelu_approx],
        layer_norm_epsilon=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        # GPT-2 drops exactly where we do: embeddings, attention weights, residual branches
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        resid_pdrop=cfg.dropout,
    )


# What a config must satisfy to be exported: (field, test, what is needed)
Need = tuple[str, Callable[[ModelConfig], bool], str]
COMMON_NEEDS: list[Need] = [  # what no supported family has
    ("norm_position", lambda c: c.norm_position == "pre", "'pre': every family is pre-norm"),
    ("residual", lambda c: c.residual, "True: every family has residual connections"),
    (
        "pos_encoding",
        lambda c: c.pos_encoding in EXPORT_ORDER,
        "'rope' (LLaMA, Mistral, Qwen3, Mixtral, Qwen3-MoE), 'learned' (GPT-2) or 'alibi' (BLOOM)",
    ),
]
SEQUENTIAL: list[Need] = [  # what every family but BLOOM (embed_norm) and Falcon (parallel) has
    ("parallel_block", lambda c: not c.parallel_block, "False (only Falcon has parallel blocks)"),
    ("embed_norm", lambda c: not c.embed_norm, "False (only BLOOM normalises the embeddings)"),
]
DENSE: Need = (
    "n_experts",
    lambda c: c.n_experts == 0,
    "0 (a dense MLP; Mixtral, Qwen3-MoE: experts)",
)
EXPERTS: list[Need] = [
    ("n_experts", lambda c: c.n_experts > 0, "> 0 (this family routes to experts)"),
    ("n_shared_experts", lambda c: c.n_shared_experts == 0, "0 (no shared experts)"),
    ("mlp_bias", lambda c: not c.mlp_bias, "False"),
    ("mlp", lambda c: c.mlp == "swiglu", "'swiglu'"),
]
ROPE_NEEDS: list[Need] = [
    *SEQUENTIAL,
    ("pos_encoding", lambda c: c.pos_encoding == "rope", "'rope'"),
    ("norm", lambda c: c.norm == "rmsnorm", "'rmsnorm'"),
    ("mlp", lambda c: c.mlp in LLAMA_ACTS_OUT, "a gated MLP: 'swiglu' or 'geglu'"),
]
LLAMA_NEEDS: list[Need] = ROPE_NEEDS + [
    DENSE,
    ("qk_norm", lambda c: not c.qk_norm, "False (Qwen3 has QK-norm)"),
    ("sliding_window", lambda c: c.sliding_window is None, "None (Mistral/Qwen3 have windows)"),
    ("dim", lambda c: c.dim % c.n_heads == 0, "a multiple of n_heads (LlamaConfig checks it)"),
]
MISTRAL_BASE: list[Need] = ROPE_NEEDS + [
    ("qk_norm", lambda c: not c.qk_norm, "False (Qwen3 has QK-norm)"),
    ("attn_bias", lambda c: not c.attn_bias, "False"),
    ("mlp_bias", lambda c: not c.mlp_bias, "False"),
]
QWEN3_BASE: list[Need] = ROPE_NEEDS + [
    ("qk_norm", lambda c: c.qk_norm, "True (Qwen3 always normalises q and k)"),
    ("mlp_bias", lambda c: not c.mlp_bias, "False"),
]
MISTRAL_NEEDS = [*MISTRAL_BASE, DENSE]
QWEN3_NEEDS = [*QWEN3_BASE, DENSE]
MIXTRAL_NEEDS = [
    *MISTRAL_BASE,
    *EXPERTS,
    ("moe_renormalize", lambda c: c.moe_renormalize, "True (Mixtral renormalises the top k)"),
]
QWEN3_MOE_NEEDS = [*QWEN3_BASE, *EXPERTS]
GPT2_NEEDS: list[Need] = [
    DENSE,
    *SEQUENTIAL,
    ("pos_encoding", lambda c: c.pos_encoding == "learned", "'learned'"),
    ("norm", lambda c: c.norm == "layernorm", "'layernorm'"),
    ("norm_bias", lambda c: c.norm_bias, "True"),
    ("mlp", lambda c: c.mlp in GPT2_ACTS_OUT, "'gelu' or 'relu'"),
    ("attn_bias", lambda c: c.attn_bias, "True (Conv1D always has a bias)"),
    ("mlp_bias", lambda c: c.mlp_bias, "True (Conv1D always has a bias)"),
    ("n_kv_heads", lambda c: c.kv_heads == c.n_heads, "n_heads (GPT-2 has no GQA)"),
    (
        "head_dim",
        lambda c: c.dim % c.n_heads == 0 and c.head_size == c.dim // c.n_heads,
        "dim // n_heads",
    ),
    ("qk_norm", lambda c: not c.qk_norm, "False"),
    ("sliding_window", lambda c: c.sliding_window is None, "None"),
]


BLOOM_NEEDS: list[Need] = [
    DENSE,
    ("pos_encoding", lambda c: c.pos_encoding == "alibi", "'alibi'"),
    ("embed_norm", lambda c: c.embed_norm, "True (BLOOM normalises the embeddings)"),
    ("parallel_block", lambda c: not c.parallel_block, "False"),
    ("norm", lambda c: c.norm == "layernorm" and c.norm_bias, "'layernorm' with norm_bias=True"),
    ("mlp", lambda c: c.mlp == "gelu" and c.gelu_approx == "tanh", "'gelu' with tanh"),
    ("attn_bias", lambda c: c.attn_bias, "True"),
    ("mlp_bias", lambda c: c.mlp_bias, "True"),
    ("hidden_dim", lambda c: c.ffn_dim == 4 * c.dim, "4 x dim (BLOOM's MLP width is fixed)"),
    ("n_kv_heads", lambda c: c.kv_heads == c.n_heads, "n_heads (BLOOM has no GQA)"),
    ("head_dim", lambda c: c.head_size * c.n_heads == c.dim, "dim // n_heads"),
    ("qk_norm", lambda c: not c.qk_norm, "False"),
    ("sliding_window", lambda c: c.sliding_window is None, "None"),
]


FALCON_NEEDS: list[Need] = [
    DENSE,
    ("pos_encoding", lambda c: c.pos_encoding == "rope", "'rope' (Falcon's ALiBi is not exact)"),
    ("embed_norm", lambda c: not c.embed_norm, "False"),
    ("norm", lambda c: c.norm == "layernorm" and c.norm_bias, "'layernorm' with norm_bias=True"),
    ("mlp", lambda c: (c.mlp, c.gelu_approx) in FALCON_ACTS_OUT, "'gelu' or 'relu' (two matrices)"),
    (
        "mlp_bias",
        lambda c: c.mlp_bias == c.attn_bias,
        "equal to attn_bias (Falcon's one bias flag)",
    ),
    ("head_dim", lambda c: c.head_size * c.n_heads == c.dim, "dim // n_heads"),
    (
        "parallel_block",
        lambda c: c.parallel_block or c.kv_heads in (1, c.n_heads),
        "True for GQA (sequential blocks exist only in the MHA/MQA layout)",
    ),
    ("qk_norm", lambda c: not c.qk_norm, "False"),
    ("sliding_window", lambda c: c.sliding_window is None, "None"),
]


def _unmet(cfg: ModelConfig, needs: list[Need]) -> list[str]:
    return [
        f"{field}={getattr(cfg, field)!r} blocks export (needs {need})"
        for field, ok, need in needs
        if not ok(cfg)
    ]


# ----------------------------------------------------------------------------------------------
# Families


@dataclass(frozen=True)
class Family:
    """One HF architecture: its classes, weight names and config translations."""

    model_type: str
    config_class: str
    model_class: str
    # the layout written on export (and read); a function of the config where it depends on it
    weights: dict[str, str | Rule] | Callable[[ModelConfig], dict[str, str | Rule]]
    ignored: tuple[str, ...]  # regexes of HF tensors skipped knowingly
    prefix: str  # base-model prefix, absent from some older checkpoints' tensor names
    from_hf: Callable[[Any, list[str]], dict[str, Any]]
    to_hf: Callable[[ModelConfig], dict[str, Any]]
    needs: list[Need]
    also_reads: dict[str, str | Rule] = field(default_factory=dict)  # other layouts in the wild


FAMILIES: dict[str, Family] = {
    "llama": Family(
        model_type="llama",
        config_class="LlamaConfig",
        model_class="LlamaForCausalLM",
        weights=LLAMA_WEIGHTS,
        ignored=LLAMA_IGNORED,
        prefix="model.",
        from_hf=_llama_from_hf,
        to_hf=_llama_to_hf,
        needs=LLAMA_NEEDS,
    ),
    "mistral": Family(
        model_type="mistral",
        config_class="MistralConfig",
        model_class="MistralForCausalLM",
        weights=LLAMA_WEIGHTS,
        ignored=LLAMA_IGNORED,
        prefix="model.",
        from_hf=_mistral_from_hf,
        to_hf=_mistral_to_hf,
        needs=MISTRAL_NEEDS,
    ),
    "qwen3": Family(
        model_type="qwen3",
        config_class="Qwen3Config",
        model_class="Qwen3ForCausalLM",
        weights=LLAMA_WEIGHTS,
        ignored=LLAMA_IGNORED,
        prefix="model.",
        from_hf=_qwen3_from_hf,
        to_hf=_qwen3_to_hf,
        needs=QWEN3_NEEDS,
    ),
    "mixtral": Family(
        model_type="mixtral",
        config_class="MixtralConfig",
        model_class="MixtralForCausalLM",
        weights=MIXTRAL_WEIGHTS,
        ignored=LLAMA_IGNORED,
        prefix="model.",
        from_hf=_mixtral_from_hf,
        to_hf=_mixtral_to_hf,
        needs=MIXTRAL_NEEDS,
        also_reads=FUSED_EXPERTS,
    ),
    "qwen3_moe": Family(
        model_type="qwen3_moe",
        config_class="Qwen3MoeConfig",
        model_class="Qwen3MoeForCausalLM",
        weights=QWEN3_MOE_WEIGHTS,
        ignored=LLAMA_IGNORED,
        prefix="model.",
        from_hf=_qwen3_moe_from_hf,
        to_hf=_qwen3_moe_to_hf,
        needs=QWEN3_MOE_NEEDS,
        also_reads=FUSED_EXPERTS,
    ),
    "bloom": Family(
        model_type="bloom",
        config_class="BloomConfig",
        model_class="BloomForCausalLM",
        weights=BLOOM_WEIGHTS,
        ignored=(),
        prefix="transformer.",
        from_hf=_bloom_from_hf,
        to_hf=_bloom_to_hf,
        needs=BLOOM_NEEDS,
    ),
    "falcon": Family(
        model_type="falcon",
        config_class="FalconConfig",
        model_class="FalconForCausalLM",
        weights=_falcon_weights,
        ignored=(),
        prefix="transformer.",
        from_hf=_falcon_from_hf,
        to_hf=_falcon_to_hf,
        needs=FALCON_NEEDS,
    ),
    "gpt2": Family(
        model_type="gpt2",
        config_class="GPT2Config",
        model_class="GPT2LMHeadModel",
        weights=GPT2_WEIGHTS,
        ignored=GPT2_IGNORED,
        prefix="transformer.",
        from_hf=_gpt2_from_hf,
        to_hf=_gpt2_to_hf,
        needs=GPT2_NEEDS,
    ),
}
# export tries the families of the config's position encoding in this order and takes the first
# that represents the config exactly
EXPORT_ORDER = {
    "learned": ("gpt2",),
    "alibi": ("bloom",),
    "rope": ("llama", "mistral", "qwen3", "mixtral", "qwen3_moe", "falcon"),
}


def _family_of(hf_config: Any) -> Family:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in FAMILIES:
        raise ConversionError(
            f"model_type={model_type!r} is not supported; supported: {', '.join(FAMILIES)}"
        )
    return FAMILIES[model_type]


def config_from_hf(hf_config: Any) -> ModelConfig:
    """The ``ModelConfig`` computing the same function as ``hf_config`` (a LlamaConfig,
    MistralConfig, Qwen3Config or GPT2Config); ``ConversionError`` listing every setting that
    has no exact counterpart."""
    family = _family_of(hf_config)
    problems: list[str] = []
    fields = family.from_hf(hf_config, problems)
    _fail(problems, f"cannot convert {family.config_class} to llm-foundry")
    return ModelConfig(**fields)


def choose_family(cfg: ModelConfig, family: str | None = None) -> Family:
    """The HF family that represents ``cfg`` exactly (``family`` forces one: llama, mistral,
    qwen3, gpt2); ``ConversionError`` naming each field that blocks export."""
    _fail(_unmet(cfg, COMMON_NEEDS), "cannot export to Hugging Face")
    if family is not None and family not in FAMILIES:
        raise ConversionError(f"family={family!r} is not one of {', '.join(FAMILIES)}")
    problems: list[str] = []
    for name in (family,) if family else EXPORT_ORDER[cfg.pos_encoding]:
        unmet = _unmet(cfg, FAMILIES[name].needs)
        if not unmet:
            return FAMILIES[name]
        problems += [f"{name}: {u}" for u in unmet]
    _fail(problems, "cannot export to Hugging Face: no family represents this config exactly")
    raise AssertionError("unreachable")


def config_to_hf(
    cfg: ModelConfig, family: str | None = None, **overrides: Any
) -> transformers.PretrainedConfig:
    """The HF config of the family that represents ``cfg`` exactly. Token ids (bos, eos, pad)
    are not part of a ``ModelConfig``: they default to None; pass them in ``overrides``."""
    fam = choose_family(cfg, family)
    kwargs = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    kwargs.update(fam.to_hf(cfg))
    kwargs.update(overrides)
    hf_config = getattr(transformers, fam.config_class)(**kwargs)
    hf_config.architectures = [fam.model_class]
    return hf_config


# ----------------------------------------------------------------------------------------------
# Weights


def _expand(weights: dict[str, str | Rule], cfg: ModelConfig) -> dict[str, Rule]:
    """The name table with ``{i}`` expanded for every layer and ``{e}`` for every expert: full
    HF name -> Rule."""
    out: dict[str, Rule] = {}
    for hf, ours in weights.items():
        rule = ours if isinstance(ours, Rule) else Rule((ours,))
        for i in range(cfg.n_layers) if "{i}" in hf else (0,):
            for e in range(cfg.n_experts) if "{e}" in hf else (None,):
                names = tuple(o.format(i=i) for o in rule.ours)
                groups = {"heads": cfg.n_heads, "kv_heads": cfg.kv_heads}.get(rule.groups)
                out[hf.format(i=i, e=e)] = Rule(names, rule.conv1d, rule.dim, e, groups)
    return out


def _table(family: Family, cfg: ModelConfig) -> dict[str, str | Rule]:
    return family.weights(cfg) if callable(family.weights) else family.weights


def _ungroup(t: torch.Tensor, sizes: list[int], groups: int) -> list[torch.Tensor]:
    """Rows stored as ``groups`` groups of [part 0, part 1, ...] slices (each part's rows split
    evenly over the groups) -> each part's rows in order. t: (sum(sizes), ...)."""
    per = [s // groups for s in sizes]
    g = t.reshape(groups, sum(per), *t.shape[1:])
    return [p.reshape(s, *t.shape[1:]) for p, s in zip(g.split(per, dim=1), sizes, strict=True)]


def _regroup(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """The inverse of ``_ungroup``: parts (s_i, ...) -> rows in ``groups`` interleaved groups."""
    rest = parts[0].shape[1:]
    g = torch.cat([p.reshape(groups, -1, *rest) for p in parts], dim=1)
    return g.reshape(-1, *rest)


def hf_to_ours(
    hf_tensors: dict[str, torch.Tensor], cfg: ModelConfig, family: Family, shapes: dict
) -> dict[str, torch.Tensor]:
    """Rename and re-lay HF tensors into our state dict (``shapes``: our name -> shape).
    Strict: every one of our tensors filled, every HF tensor used or knowingly ignored."""
    rules = _expand({**family.also_reads, **_table(family, cfg)}, cfg)
    ours: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}  # stacked tensor -> its experts' slices
    unexpected: list[str] = []
    problems: list[str] = []
    for name, tensor in hf_tensors.items():
        key = name if name in rules else family.prefix + name
        if key not in rules or not all(n in shapes for n in rules[key].ours):
            if not any(re.search(p, name) for p in family.ignored):
                unexpected.append(name)
            continue
        if key == "lm_head.weight" and cfg.tie_embeddings:
            continue  # the model ties the head to the embedding, as HF does with this config
        rule = rules[key]
        t = tensor.t() if rule.conv1d else tensor
        want = [shapes[n] if rule.expert is None else shapes[n][1:] for n in rule.ours]
        d = rule.dim
        fused = (*want[0][:d], sum(s[d] for s in want), *want[0][d + 1 :])
        if tuple(t.shape) != fused:
            problems.append(f"{name}: shape {tuple(tensor.shape)} does not fit {rule.ours} {want}")
            continue
        sizes = [s[d] for s in want]
        parts = _ungroup(t, sizes, rule.groups) if rule.groups else t.split(sizes, dim=d)
        for n, part in zip(rule.ours, parts, strict=True):
            if rule.expert is None:
                ours[n] = part.contiguous()
            else:
                experts.setdefault(n, {})[rule.expert] = part
    for n, parts in experts.items():
        absent = sorted(set(range(cfg.n_experts)) - set(parts))
        if absent:
            problems.append(f"{n}: no HF tensor for expert(s) {absent} of {cfg.n_experts}")
        else:
            ours[n] = torch.stack([parts[e] for e in range(cfg.n_experts)]).contiguous()
    if cfg.tie_embeddings and "tok_emb.weight" in ours:
        ours["lm_head.weight"] = ours["tok_emb.weight"]
    missing = sorted(set(shapes) - set(ours))
    if missing:
        problems.append(f"no HF tensor for our {missing}")
    if unexpected:
        problems.append(f"HF tensors with no place in the model: {sorted(unexpected)}")
    _fail(problems, f"cannot load {family.model_class} weights")
    return ours


def ours_to_hf(
    state: dict[str, torch.Tensor], cfg: ModelConfig, family: Family
) -> dict[str, torch.Tensor]:
    """Our state dict as HF tensors (CPU, contiguous); a tied head is stored once, as HF does."""
    rules = _expand(_table(family, cfg), cfg)
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    if cfg.tie_embeddings:
        used.add("lm_head.weight")
        rules.pop("lm_head.weight")
    for key, rule in rules.items():
        if not all(n in state for n in rule.ours):
            continue
        parts = [state[n].detach() for n in rule.ours]
        if rule.expert is not None:
            parts = [p[rule.expert] for p in parts]
        t = _regroup(parts, rule.groups) if rule.groups else torch.cat(parts, dim=rule.dim)
        out[key] = (t.t() if rule.conv1d else t).to("cpu").contiguous()
        used.update(rule.ours)
    left = sorted(set(state) - used)
    _fail([f"no {family.model_class} tensor for our {left}"] if left else [], "cannot export")
    return out


def _check_against_hf(
    tensors: dict[str, torch.Tensor], hf_config: Any, family: Family, cfg: ModelConfig
) -> None:
    """Compare names and shapes with those of the HF model built on the meta device (no memory):
    what ``from_pretrained`` will expect."""
    with torch.device("meta"):
        reference = getattr(transformers, family.model_class)(hf_config)
    if family.also_reads:  # its experts live fused in memory, per expert on disk: both must
        # map onto every one of our tensors and leave nothing over
        ours = {k: tuple(v.shape) for k, v in meta_transformer(cfg).state_dict().items()}
        for what in (reference.state_dict(), tensors):
            hf_to_ours({k: v.to("meta") for k, v in what.items()}, cfg, family, ours)
        return
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    if getattr(hf_config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    problems = [f"missing {k} {s}" for k, s in sorted(expected.items()) if k not in got]
    problems += [f"unexpected {k}" for k in sorted(set(got) - set(expected))]
    problems += [
        f"{k}: shape {got[k]}, {family.model_class} expects {s}"
        for k, s in sorted(expected.items())
        if k in got and got[k] != s
    ]
    _fail(problems, f"exported tensors do not match {family.model_class}")


def _weight_files(path: Path) -> tuple[list[str], dict[str, str]]:
    """The safetensors files of an HF checkpoint directory (``model.safetensors``, or the shards
    named by ``model.safetensors.index.json``) and the index's weight map (empty without one)."""
    index = path / INDEX_FILE
    weight_map: dict[str, str] = {}
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ConversionError(
                f"{index} is not a valid shard index ({e!r}); expected "
                '{"weight_map": {"tensor name": "shard file", ...}}'
            ) from None
    elif (path / WEIGHTS_FILE).exists():
        files = [WEIGHTS_FILE]
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors file in {path}; only safetensors checkpoints are read "
            "(pytorch_model.bin is a pickle and is never loaded: re-save the model with "
            "transformers' save_pretrained, which writes safetensors)"
        )
    return files, weight_map


def read_safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in an HF checkpoint directory, from the file headers alone (no
    tensor data read); each file checked to be whole, each tensor in exactly one shard."""
    path = Path(path)
    files, weight_map = _weight_files(path)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        part = read_safetensors_header(path / file)
        twice = sorted(shapes.keys() & part.keys())
        if twice:
            raise ConversionError(f"{path}: tensors {twice} appear in more than one shard")
        shapes.update(part)
    absent = sorted(set(weight_map) - set(shapes))
    if absent:
        raise ConversionError(f"{path / INDEX_FILE} lists tensors that no shard holds: {absent}")
    return shapes


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory (see ``read_safetensors_shapes``, which checks
    the files first). Pickle files (``pytorch_model.bin``) are never read."""
    path = Path(path)
    read_safetensors_shapes(path)
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(path)[0]:
        tensors.update(load_file(str(path / file)))
    return tensors


def _check_hf_weights_fit(path: Path, cfg: ModelConfig, family: Family) -> dict[str, tuple]:
    """Refuse an HF directory whose config.json does not describe its weights, from the headers
    and on the meta device, before anything is allocated. Returns our tensors' shapes."""
    shapes = read_safetensors_shapes(path)
    check_layer_count(cfg, shapes, path, path / "config.json")
    model = meta_transformer(cfg, path / "config.json", path)
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    try:
        hf_to_ours(meta, cfg, family, ours)  # names and shapes, no data
    except ConversionError as e:
        more = f" (and {len(e.problems) - 2} more)" if len(e.problems) > 2 else ""
        raise ConversionError(
            f"the weights in {path} do not match its config.json: "
            + "; ".join(e.problems[:2])
            + more,
            e.problems,
        ) from None
    return ours


# ----------------------------------------------------------------------------------------------
# Models


def from_hf(model_or_dir: Any, dtype: torch.dtype | None = None) -> Transformer:
    """Our ``Transformer`` (eval mode, float32 unless ``dtype``) computing the same function as
    an HF ``*ForCausalLM`` given in memory or as a checkpoint directory (config.json +
    safetensors, possibly sharded)."""
    if isinstance(model_or_dir, (str, Path)):
        path = Path(model_or_dir)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path / 'config.json'} not found: not an HF checkpoint")
        hf_config = transformers.AutoConfig.from_pretrained(str(path))
        cfg, family = config_from_hf(hf_config), _family_of(hf_config)
        # the config is checked against the weight files before anything is allocated
        shapes = _check_hf_weights_fit(path, cfg, family)
        hf_tensors = read_safetensors_dir(path)
        weights_file: Path = path
    elif isinstance(model_or_dir, transformers.PreTrainedModel):
        hf_config = model_or_dir.config
        hf_tensors = model_or_dir.state_dict()
        cfg, family = config_from_hf(hf_config), _family_of(hf_config)
        shapes = {k: tuple(v.shape) for k, v in meta_transformer(cfg).state_dict().items()}
        weights_file = Path(type(model_or_dir).__name__)
    else:
        raise TypeError(
            "from_hf takes a transformers PreTrainedModel or a checkpoint directory; "
            f"got {type(model_or_dir).__name__}"
        )
    ours = hf_to_ours(hf_tensors, cfg, family, shapes)
    check_finite(ours, weights_file)
    model = Transformer(cfg)
    with torch.no_grad():
        model.load_state_dict(ours, strict=True)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def to_hf(
    model: torch.nn.Module, out_dir: str | Path, family: str | None = None, **overrides: Any
) -> Path:
    """Write ``model`` as an HF checkpoint directory (config.json + model.safetensors) that
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads with no missing or unexpected keys.
    ``family`` forces the HF architecture; ``overrides`` go to the HF config (e.g. token ids)."""
    model = unwrap(model)
    cfg: ModelConfig = model.cfg
    hf_config = config_to_hf(cfg, family, **overrides)
    fam = _family_of(hf_config)
    tensors = ours_to_hf(model.state_dict(), cfg, fam)
    _check_against_hf(tensors, hf_config, fam, cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(str(out))
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Bring ``tokenizer.json`` along when there is one: our BPE file is an HF tokenizers file,
    our character tokenizer has no HF equivalent and stays behind (with a note)."""
    file = src / TOKENIZER_FILE
    if not file.exists():
        return
    if "model" not in json.loads(file.read_text(encoding="utf-8")):
        log.warning(f"note: {file} (a character tokenizer) not copied: HF cannot read it")
        return
    shutil.copyfile(file, dst / TOKENIZER_FILE)


def name_special_tokens(out: Path) -> None:
    """Our BPE tokenizer exported: tokenizer_config.json names its specials, so AutoTokenizer
    (and tools built on it, such as lm-eval's hf backend) knows BOS, EOS and padding."""
    from llm_foundry.tokenizer import SPECIAL_TOKENS, load_tokenizer

    file = out / TOKENIZER_FILE
    try:
        tok = load_tokenizer(file) if file.exists() else None
    except ValueError:
        return
    if getattr(tok, "kind", None) == "bpe":
        bos, eos, pad = SPECIAL_TOKENS
        (out / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": bos,
                    "eos_token": eos,
                    "pad_token": pad,
                    "add_bos_token": False,
                    "clean_up_tokenization_spaces": False,
                },
                indent=2,
            )
        )
