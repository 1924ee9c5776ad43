"""GPT-2: learned positions, LayerNorm with biases, biased Conv1D projections (stored (in, out),
transposed on the way), q/k/v fused along the output dimension in ``c_attn``."""

from __future__ import annotations

from typing import Any

from llm_foundry.config import ModelConfig
from llm_foundry.interop.hf.core import (
    DENSE,
    SEQUENTIAL,
    Family,
    Need,
    Rule,
    Setting,
    Table,
    check_settings,
    lookup,
)
from llm_foundry.interop.hf.core import weight_bias as wb
from llm_foundry.interop.hf.registry import register

# ``activation_function``: the MLP is c_proj(act(c_fc x)) -> our (mlp, gelu_approx)
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

_H = "transformer.h.{i}."
GPT2_WEIGHTS: Table = {
    "transformer.wte.weight": "tok_emb.weight",
    "transformer.wpe.weight": "pos.emb.weight",
    **wb("transformer.ln_f", "norm"),
    "lm_head.weight": "lm_head.weight",
    **wb(_H + "ln_1", "layers.{i}.attn_norm"),
    **wb(_H + "ln_2", "layers.{i}.mlp_norm"),
    _H + "attn.c_attn.weight": Rule(
        ("layers.{i}.attn.wq.weight", "layers.{i}.attn.wk.weight", "layers.{i}.attn.wv.weight"),
        conv1d=True,
    ),
    _H + "attn.c_attn.bias": Rule(
        ("layers.{i}.attn.wq.bias", "layers.{i}.attn.wk.bias", "layers.{i}.attn.wv.bias")
    ),
    _H + "attn.c_proj.weight": Rule(("layers.{i}.attn.wo.weight",), conv1d=True),
    _H + "attn.c_proj.bias": "layers.{i}.attn.wo.bias",
    _H + "mlp.c_fc.weight": Rule(("layers.{i}.mlp.w1.weight",), conv1d=True),
    _H + "mlp.c_fc.bias": "layers.{i}.mlp.w1.bias",
    _H + "mlp.c_proj.weight": Rule(("layers.{i}.mlp.w2.weight",), conv1d=True),
    _H + "mlp.c_proj.bias": "layers.{i}.mlp.w2.bias",
}
GPT2_IGNORED = (r"(^|\.)h\.\d+\.attn\.(bias|masked_bias)$",)  # causal-mask buffers

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


def _gpt2_from_hf(c: Any, problems: list[str]) -> dict[str, Any]:
    check_settings(c, GPT2_SETTINGS, problems)
    mlp, approx = lookup(c, "activation_function", GPT2_ACTS, problems)
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

# token ids None: GPT-2's 50256 is no token of a tiny vocabulary
_TINY = dict(n_embd=64, n_layer=3, n_head=4, n_positions=64, bos_token_id=None, eos_token_id=None)
register(
    Family(
        model_type="gpt2",
        title="GPT-2",
        config_class="GPT2Config",
        model_class="GPT2LMHeadModel",
        pos_encoding="learned",
        weights=GPT2_WEIGHTS,
        ignored=GPT2_IGNORED,
        prefix="transformer.",
        from_hf=_gpt2_from_hf,
        to_hf=_gpt2_to_hf,
        needs=GPT2_NEEDS,
        examples={
            "gpt2": dict(_TINY),
            "gpt2_untied_gelu": dict(
                _TINY, activation_function="gelu", n_inner=80, tie_word_embeddings=False
            ),
        },
    )
)
