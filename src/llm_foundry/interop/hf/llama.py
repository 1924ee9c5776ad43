"""LLaMA and the families that are LLaMA plus one thing: Mistral (one sliding window on every
layer) and Qwen3 (QK-norm, explicit head_dim). RoPE in the rotate-half layout on both sides,
so q/k load without permutation; RMSNorm; a gated MLP; separate q/k/v and gate/up linears."""

from __future__ import annotations

from typing import Any

from llm_foundry.config import ModelConfig
from llm_foundry.interop.hf.core import (
    DENSE,
    SEQUENTIAL,
    Family,
    Need,
    Table,
    lookup,
    weight_bias,
)
from llm_foundry.interop.hf.registry import register
from llm_foundry.interop.hf.rope import rope_from_hf, rope_to_hf

# ``hidden_act``: the MLP is down(act(gate x) * up x) -> our (mlp, gelu_approx)
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

LLAMA_WEIGHTS: Table = {
    "model.embed_tokens.weight": "tok_emb.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
    **weight_bias("model.layers.{i}.self_attn.q_proj", "layers.{i}.attn.wq"),
    **weight_bias("model.layers.{i}.self_attn.k_proj", "layers.{i}.attn.wk"),
    **weight_bias("model.layers.{i}.self_attn.v_proj", "layers.{i}.attn.wv"),
    **weight_bias("model.layers.{i}.self_attn.o_proj", "layers.{i}.attn.wo"),
    "model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.attn.q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.attn.k_norm.weight",
    **weight_bias("model.layers.{i}.mlp.gate_proj", "layers.{i}.mlp.w1"),
    **weight_bias("model.layers.{i}.mlp.up_proj", "layers.{i}.mlp.w3"),
    **weight_bias("model.layers.{i}.mlp.down_proj", "layers.{i}.mlp.w2"),
}
# HF tensors that hold no weights and are skipped knowingly (buffers of older checkpoints)
LLAMA_IGNORED = (r"\.rotary_emb\.inv_freq$",)

# ----------------------------------------------------------------------------------------------
# HF config -> ours


def llama_fields(c: Any, problems: list[str]) -> dict[str, Any]:
    """Fields shared by LLaMA, Mistral and Qwen3: RoPE, RMSNorm, gated MLP, pre-norm."""
    mlp, approx = lookup(c, "hidden_act", LLAMA_ACTS, problems)
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
        **rope_from_hf(c, problems),
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


def mistral_from_hf(c: Any, problems: list[str]) -> dict[str, Any]:
    """Mistral: LLaMA plus one sliding window on every layer (None: full attention)."""
    return {**llama_fields(c, problems), "sliding_window": c.sliding_window}


def qwen3_from_hf(c: Any, problems: list[str]) -> dict[str, Any]:
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
    return {**llama_fields(c, problems), "qk_norm": True, "sliding_window": window}


# ----------------------------------------------------------------------------------------------
# Our config -> HF


def llama_fields_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF config kwargs LLaMA, Mistral and Qwen3 share."""
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
        **rope_to_hf(cfg),
    )


def _llama_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **llama_fields_to_hf(cfg),
        "attention_bias": cfg.attn_bias,
        "mlp_bias": cfg.mlp_bias,
    }


def mistral_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {**llama_fields_to_hf(cfg), "sliding_window": cfg.sliding_window}


def qwen3_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    window = cfg.sliding_window
    return {
        **llama_fields_to_hf(cfg),
        "attention_bias": cfg.attn_bias,
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": 0 if window is not None else cfg.n_layers,  # 0: every layer slides
    }


# ----------------------------------------------------------------------------------------------
# What a config needs to be exported as each


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


# ----------------------------------------------------------------------------------------------
# The families, with the tiny variants the parity tests build

# sizes of the tiny variants (LLaMA-style configs)
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
TINY_QWEN3 = dict(TINY, rms_norm_eps=1e-6, rope_theta=1e6)

register(
    Family(
        model_type="llama",
        title="LLaMA",
        config_class="LlamaConfig",
        model_class="LlamaForCausalLM",
        pos_encoding="rope",
        weights=LLAMA_WEIGHTS,
        ignored=LLAMA_IGNORED,
        prefix="model.",
        from_hf=llama_fields,
        to_hf=_llama_to_hf,
        needs=LLAMA_NEEDS,
        examples={
            "llama_mha": dict(TINY, num_attention_heads=4, num_key_value_heads=4),
            "llama_gqa_tied": dict(
                TINY, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True
            ),
            "llama_mqa": dict(TINY, num_attention_heads=4, num_key_value_heads=1),
            "llama_bias_geglu_linear_rope": dict(
                TINY,
                num_attention_heads=4,
                num_key_value_heads=2,
                attention_bias=True,
                mlp_bias=True,
                hidden_act="gelu_pytorch_tanh",
                rope_theta=500.0,
                rope_scaling={"rope_type": "linear", "factor": 2.0},
            ),
        },
    )
)
register(
    Family(
        model_type="mistral",
        title="Mistral",
        config_class="MistralConfig",
        model_class="MistralForCausalLM",
        pos_encoding="rope",
        weights=LLAMA_WEIGHTS,
        ignored=LLAMA_IGNORED,
        prefix="model.",
        from_hf=mistral_from_hf,
        to_hf=mistral_to_hf,
        needs=[*MISTRAL_BASE, DENSE],
        examples={
            "mistral_window": dict(
                TINY, num_attention_heads=4, num_key_value_heads=2, sliding_window=5
            ),
        },
    )
)
register(
    Family(
        model_type="qwen3",
        title="Qwen3",
        config_class="Qwen3Config",
        model_class="Qwen3ForCausalLM",
        pos_encoding="rope",
        weights=LLAMA_WEIGHTS,
        ignored=LLAMA_IGNORED,
        prefix="model.",
        from_hf=qwen3_from_hf,
        to_hf=qwen3_to_hf,
        needs=[*QWEN3_BASE, DENSE],
        examples={
            "qwen3": dict(
                TINY_QWEN3,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=24,
                tie_word_embeddings=True,
            ),
            "qwen3_window": dict(
                TINY_QWEN3,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=24,
                use_sliding_window=True,
                sliding_window=6,
                max_window_layers=0,
            ),
        },
    )
)
