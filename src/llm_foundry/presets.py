"""Presets: real architectures with their published hyper-parameters, plus small trainable ones.

Presets are data. Each real one cites the ``config.json`` it was read from; its parameter total is
checked against ``transformers`` in ``tests/test_params.py``.
"""

from __future__ import annotations

from typing import Any

from llm_foundry.config import ModelConfig

# Shared family traits: the preset tables below only state sizes on top of these.
GPT2_FAMILY = dict(
    pos_encoding="learned",
    norm="layernorm",
    norm_position="pre",
    mlp="gelu",
    gelu_approx="tanh",
    attn_bias=True,
    mlp_bias=True,
    tie_embeddings=True,
    norm_eps=1e-5,
)
LLAMA_FAMILY = dict(
    pos_encoding="rope",
    norm="rmsnorm",
    norm_position="pre",
    mlp="swiglu",
    attn_bias=False,
    mlp_bias=False,
    tie_embeddings=False,
)

PRESETS: dict[str, dict[str, Any]] = {
    # https://huggingface.co/openai-community/gpt2/blob/main/config.json
    "gpt2": dict(GPT2_FAMILY, vocab_size=50257, dim=768, n_layers=12, n_heads=12, max_seq_len=1024),
    # https://huggingface.co/openai-community/gpt2-medium/blob/main/config.json
    "gpt2-medium": dict(
        GPT2_FAMILY, vocab_size=50257, dim=1024, n_layers=24, n_heads=16, max_seq_len=1024
    ),
    # https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json
    "llama2-7b": dict(
        LLAMA_FAMILY,
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        hidden_dim=11008,
        max_seq_len=4096,
        norm_eps=1e-5,
    ),
    # https://huggingface.co/TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T/blob/main/config.json
    "tinyllama-1.1b": dict(
        LLAMA_FAMILY,
        vocab_size=32000,
        dim=2048,
        n_layers=22,
        n_heads=32,
        n_kv_heads=4,
        hidden_dim=5632,
        max_seq_len=2048,
        norm_eps=1e-5,
    ),
    # https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
    "mistral-7b": dict(
        LLAMA_FAMILY,
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        hidden_dim=14336,
        max_seq_len=32768,
        sliding_window=4096,
        norm_eps=1e-5,
    ),
    # https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json
    "qwen3-8b": dict(
        LLAMA_FAMILY,
        vocab_size=151936,
        dim=4096,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        hidden_dim=12288,
        max_seq_len=40960,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        qk_norm=True,
    ),
    # https://huggingface.co/bigscience/bloom-560m/blob/main/config.json
    "bloom-560m": dict(
        vocab_size=250880,
        dim=1024,
        n_layers=24,
        n_heads=16,
        max_seq_len=2048,
        pos_encoding="alibi",
        norm="layernorm",
        embed_norm=True,
        mlp="gelu",
        gelu_approx="tanh",
        attn_bias=True,
        mlp_bias=True,
        tie_embeddings=True,
        norm_eps=1e-5,
    ),
    # https://huggingface.co/tiiuae/falcon-7b/blob/main/config.json
    "falcon-7b": dict(
        vocab_size=65024,
        dim=4544,
        n_layers=32,
        n_heads=71,
        n_kv_heads=1,
        max_seq_len=2048,
        pos_encoding="rope",
        norm="layernorm",
        mlp="gelu",
        parallel_block=True,
        attn_bias=False,
        mlp_bias=False,
        tie_embeddings=True,
        norm_eps=1e-5,
    ),
    # https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json
    "mixtral-8x7b": dict(
        LLAMA_FAMILY,
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        max_seq_len=32768,
        rope_theta=1e6,
        norm_eps=1e-5,
        n_experts=8,
        experts_per_token=2,
        expert_hidden_dim=14336,
        moe_renormalize=True,
        moe_aux_loss_coef=0.02,
    ),
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (every layer sparse:
    # decoder_sparse_step 1, mlp_only_layers [])
    "qwen3-30b-a3b": dict(
        LLAMA_FAMILY,
        vocab_size=151936,
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        max_seq_len=40960,
        rope_theta=1e6,
        norm_eps=1e-6,
        qk_norm=True,
        n_experts=128,
        experts_per_token=8,
        expert_hidden_dim=768,
        moe_renormalize=True,
        moe_aux_loss_coef=0.001,
    ),
    # nanoGPT's "baby GPT" for shakespeare_char (6 layers, 6 heads, 384 dim, context 256), GPT-2 style
    "gpt2-shakespeare": dict(
        GPT2_FAMILY, vocab_size=65, dim=384, n_layers=6, n_heads=6, max_seq_len=256
    ),
    # the same size, LLaMA style: RoPE, RMSNorm, SwiGLU (2/3 * 4 * dim), GQA with 2 KV heads
    "llama-shakespeare": dict(
        LLAMA_FAMILY,
        vocab_size=65,
        dim=384,
        n_layers=6,
        n_heads=6,
        n_kv_heads=2,
        hidden_dim=1024,
        max_seq_len=256,
    ),
    # nanoGPT's CPU recipe model for shakespeare_char (4 layers, 4 heads, 128 dim, block 64, no
    # bias, exact GELU): the GPT-2-style baseline of benchmarks/bench_shakespeare.py
    "gpt2-shakespeare-char": dict(
        GPT2_FAMILY,
        vocab_size=65,
        dim=128,
        n_layers=4,
        n_heads=4,
        max_seq_len=64,
        attn_bias=False,
        mlp_bias=False,
        norm_bias=False,
        gelu_approx="none",
    ),
    # the default of `llm-foundry train`: LLaMA style at the same budget, sized for 2 CPU cores
    "llama-shakespeare-char": dict(
        LLAMA_FAMILY,
        vocab_size=65,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=384,
        max_seq_len=64,
    ),
    # llama-shakespeare-char with 4 routed experts (2 per token) of half its MLP width in every
    # block: the same active MLP parameters per token, twice the total
    "moe-shakespeare-char": dict(
        LLAMA_FAMILY,
        vocab_size=65,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=64,
        n_experts=4,
        experts_per_token=2,
        expert_hidden_dim=192,
    ),
}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The named preset as a validated ``ModelConfig``; ``overrides`` replace fields."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; available presets: {', '.join(PRESETS)}")
    return ModelConfig.from_dict({**PRESETS[name], **overrides})
