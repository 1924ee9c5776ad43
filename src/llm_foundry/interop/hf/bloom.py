"""BLOOM: ALiBi, a LayerNorm right after the embedding, LayerNorms and linear layers with
biases, a tanh-GELU MLP four times as wide, q/k/v fused head by head."""

from __future__ import annotations

from typing import Any

from llm_foundry.config import ModelConfig
from llm_foundry.interop.hf.core import DENSE, Family, Need, Rule, Setting, Table, check_settings
from llm_foundry.interop.hf.core import weight_bias as wb
from llm_foundry.interop.hf.registry import register

_QKV = ("layers.{i}.attn.wq", "layers.{i}.attn.wk", "layers.{i}.attn.wv")
BLOOM_WEIGHTS: Table = {
    "transformer.word_embeddings.weight": "tok_emb.weight",
    **wb("transformer.word_embeddings_layernorm", "emb_norm"),
    **wb("transformer.ln_f", "norm"),
    "lm_head.weight": "lm_head.weight",
    **wb("transformer.h.{i}.input_layernorm", "layers.{i}.attn_norm"),
    **wb("transformer.h.{i}.post_attention_layernorm", "layers.{i}.mlp_norm"),
    "transformer.h.{i}.self_attention.query_key_value.weight": Rule(
        tuple(f"{n}.weight" for n in _QKV), groups="heads"
    ),
    "transformer.h.{i}.self_attention.query_key_value.bias": Rule(
        tuple(f"{n}.bias" for n in _QKV), groups="heads"
    ),
    **wb("transformer.h.{i}.self_attention.dense", "layers.{i}.attn.wo"),
    **wb("transformer.h.{i}.mlp.dense_h_to_4h", "layers.{i}.mlp.w1"),
    **wb("transformer.h.{i}.mlp.dense_4h_to_h", "layers.{i}.mlp.w2"),
}

BLOOM_SETTINGS: list[Setting] = [
    (
        "apply_residual_connection_post_layernorm",
        (False,),
        False,
        "llm-foundry's residual stream carries the block input, not its normalised form",
    ),
]


def _bloom_from_hf(c: Any, problems: list[str]) -> dict[str, Any]:
    check_settings(c, BLOOM_SETTINGS, problems)
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

# token ids None: BLOOM's defaults are no tokens of a tiny vocabulary
_TINY = dict(hidden_size=48, n_layer=2, bos_token_id=None, eos_token_id=None)
register(
    Family(
        model_type="bloom",
        title="BLOOM",
        config_class="BloomConfig",
        model_class="BloomForCausalLM",
        pos_encoding="alibi",
        weights=BLOOM_WEIGHTS,
        ignored=(),
        prefix="transformer.",
        from_hf=_bloom_from_hf,
        to_hf=_bloom_to_hf,
        needs=BLOOM_NEEDS,
        examples={
            "bloom_tied": dict(_TINY, n_head=4),
            "bloom_6_heads_untied": dict(_TINY, n_head=6, tie_word_embeddings=False),  # ALiBi 4+2
        },
    )
)
