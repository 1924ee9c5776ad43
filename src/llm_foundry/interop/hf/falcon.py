"""Falcon, both layouts: the original (parallel or sequential blocks, MHA or MQA) and
new_decoder_architecture (GQA, parallel blocks with one or two norms). RoPE only: Falcon's
ALiBi is not ours. q/k/v are fused key/value head by key/value head."""

from __future__ import annotations

from typing import Any

from llm_foundry.config import ModelConfig
from llm_foundry.interop.hf.core import DENSE, Family, Need, Rule, Table, lookup
from llm_foundry.interop.hf.core import weight_bias as wb
from llm_foundry.interop.hf.registry import register
from llm_foundry.interop.hf.rope import rope_from_hf, rope_to_hf

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


def falcon_weights(cfg: ModelConfig) -> Table:
    """Falcon's names; its norms depend on the block: input_layernorm (+ post_attention_layernorm
    in sequential blocks), or ln_attn + ln_mlp (two norms in parallel, Falcon-40B). q/k/v are
    fused key/value head by key/value head ([q of the group's heads, k, v] per group), which is
    also the old layouts' order: MQA (one group) and MHA (a group per head)."""
    h = "transformer.h.{i}."
    norms = {**wb(h + "input_layernorm", "layers.{i}.attn_norm")}
    if cfg.parallel_block and cfg.parallel_norms == 2:
        norms = {
            **wb(h + "ln_attn", "layers.{i}.attn_norm"),
            **wb(h + "ln_mlp", "layers.{i}.mlp_norm"),
        }
    elif not cfg.parallel_block:
        norms.update(wb(h + "post_attention_layernorm", "layers.{i}.mlp_norm"))
    qkv = ("layers.{i}.attn.wq", "layers.{i}.attn.wk", "layers.{i}.attn.wv")
    return {
        "transformer.word_embeddings.weight": "tok_emb.weight",
        **wb("transformer.ln_f", "norm"),
        "lm_head.weight": "lm_head.weight",
        **norms,
        h + "self_attention.query_key_value.weight": Rule(
            tuple(f"{n}.weight" for n in qkv), groups="kv_heads"
        ),
        h + "self_attention.query_key_value.bias": Rule(
            tuple(f"{n}.bias" for n in qkv), groups="kv_heads"
        ),
        **wb(h + "self_attention.dense", "layers.{i}.attn.wo"),
        **wb(h + "mlp.dense_h_to_4h", "layers.{i}.mlp.w1"),
        **wb(h + "mlp.dense_4h_to_h", "layers.{i}.mlp.w2"),
    }


def _falcon_from_hf(c: Any, problems: list[str]) -> dict[str, Any]:
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
    mlp, approx = lookup(c, "activation", FALCON_ACTS, problems)
    return dict(
        vocab_size=c.vocab_size,
        dim=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=kv if kv != heads else None,
        hidden_dim=getattr(c, "ffn_hidden_size", None) or 4 * c.hidden_size,
        max_seq_len=c.max_position_embeddings,
        pos_encoding="rope",
        **rope_from_hf(c, problems),
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
        **rope_to_hf(cfg),
    )


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

# token ids None: Falcon's defaults are no tokens of a tiny vocabulary
_TINY = dict(
    hidden_size=48,
    num_hidden_layers=2,
    max_position_embeddings=64,
    bos_token_id=None,
    eos_token_id=None,
)
register(
    Family(
        model_type="falcon",
        title="Falcon",
        config_class="FalconConfig",
        model_class="FalconForCausalLM",
        pos_encoding="rope",
        weights=falcon_weights,
        ignored=(),
        prefix="transformer.",
        from_hf=_falcon_from_hf,
        to_hf=_falcon_to_hf,
        needs=FALCON_NEEDS,
        examples={
            "falcon_7b_layout_mqa": dict(_TINY, num_attention_heads=4, multi_query=True),
            "falcon_sequential_mha_bias": dict(
                _TINY, num_attention_heads=4, multi_query=False, parallel_attn=False, bias=True
            ),
            "falcon_40b_layout_gqa_two_norms": dict(
                _TINY, num_attention_heads=6, num_kv_heads=2, new_decoder_architecture=True
            ),
            "falcon_new_layout_one_norm_untied": dict(
                _TINY,
                num_attention_heads=4,
                num_kv_heads=2,
                new_decoder_architecture=True,
                num_ln_in_parallel_attn=1,
                tie_word_embeddings=False,
            ),
        },
    )
)
