"""The mixtures of experts: Mixtral (Mistral with top-k experts, renormalised over the k) and
Qwen3-MoE (Qwen3 with experts, renormalised when norm_topk_prob). Experts are written one
tensor per expert, as the Hub checkpoints and ``save_pretrained`` have them, and read that way
or fused per layer (transformers 5 in memory, and checkpoints written from it)."""

from __future__ import annotations

from typing import Any

from llm_foundry.config import ModelConfig
from llm_foundry.interop.hf.core import Family, Need, Rule, Table
from llm_foundry.interop.hf.llama import (
    LLAMA_IGNORED,
    LLAMA_WEIGHTS,
    MISTRAL_BASE,
    QWEN3_BASE,
    TINY,
    TINY_QWEN3,
    mistral_from_hf,
    mistral_to_hf,
    qwen3_from_hf,
    qwen3_to_hf,
)
from llm_foundry.interop.hf.registry import register

_ATTENTION = {k: v for k, v in LLAMA_WEIGHTS.items() if ".mlp." not in k}
MIXTRAL_WEIGHTS: Table = {
    **_ATTENTION,
    "model.layers.{i}.block_sparse_moe.gate.weight": "layers.{i}.mlp.router.weight",
    "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight": "layers.{i}.mlp.w1",
    "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight": "layers.{i}.mlp.w3",
    "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight": "layers.{i}.mlp.w2",
}
QWEN3_MOE_WEIGHTS: Table = {
    **_ATTENTION,
    "model.layers.{i}.mlp.gate.weight": "layers.{i}.mlp.router.weight",
    "model.layers.{i}.mlp.experts.{e}.gate_proj.weight": "layers.{i}.mlp.w1",
    "model.layers.{i}.mlp.experts.{e}.up_proj.weight": "layers.{i}.mlp.w3",
    "model.layers.{i}.mlp.experts.{e}.down_proj.weight": "layers.{i}.mlp.w2",
}
# the fused layout (transformers 5 in memory, and checkpoints written from it): read, not written
FUSED_EXPERTS: Table = {
    "model.layers.{i}.mlp.gate.weight": "layers.{i}.mlp.router.weight",
    "model.layers.{i}.mlp.experts.gate_up_proj": Rule(
        ("layers.{i}.mlp.w1", "layers.{i}.mlp.w3"), dim=1
    ),
    "model.layers.{i}.mlp.experts.down_proj": "layers.{i}.mlp.w2",
}


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
    fields = mistral_from_hf(c, problems)
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
    fields = qwen3_from_hf(c, problems)
    renorm = bool(getattr(c, "norm_topk_prob", False))
    experts = _experts_from_hf(
        c, c.num_experts, c.moe_intermediate_size, renorm, problems, "num_experts"
    )
    return {**fields, **experts}


def _experts_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return dict(
        num_experts_per_tok=cfg.experts_per_token,
        router_aux_loss_coef=cfg.moe_aux_loss_coef,
        output_router_logits=False,
    )


def _mixtral_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **mistral_to_hf(cfg),
        **_experts_to_hf(cfg),
        "intermediate_size": cfg.expert_ffn_dim,
        "num_local_experts": cfg.n_experts,
        "router_jitter_noise": cfg.router_jitter,
    }


def _qwen3_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **qwen3_to_hf(cfg),
        **_experts_to_hf(cfg),
        "moe_intermediate_size": cfg.expert_ffn_dim,
        "num_experts": cfg.n_experts,
        "norm_topk_prob": cfg.moe_renormalize,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


EXPERTS: list[Need] = [
    ("n_experts", lambda c: c.n_experts > 0, "> 0 (this family routes to experts)"),
    ("n_shared_experts", lambda c: c.n_shared_experts == 0, "0 (no shared experts)"),
    ("mlp_bias", lambda c: not c.mlp_bias, "False"),
    ("mlp", lambda c: c.mlp == "swiglu", "'swiglu'"),
]

register(
    Family(
        model_type="mixtral",
        title="Mixtral",
        config_class="MixtralConfig",
        model_class="MixtralForCausalLM",
        pos_encoding="rope",
        weights=MIXTRAL_WEIGHTS,
        ignored=LLAMA_IGNORED,
        prefix="model.",
        from_hf=_mixtral_from_hf,
        to_hf=_mixtral_to_hf,
        needs=[
            *MISTRAL_BASE,
            *EXPERTS,
            (
                "moe_renormalize",
                lambda c: c.moe_renormalize,
                "True (Mixtral renormalises the top k)",
            ),
        ],
        also_reads=FUSED_EXPERTS,
        examples={
            "mixtral": dict(
                TINY,
                num_local_experts=4,
                num_experts_per_tok=2,
                num_attention_heads=4,
                num_key_value_heads=2,
            ),
            "mixtral_mqa_tied_top1": dict(
                TINY,
                num_local_experts=4,
                num_experts_per_tok=1,
                num_attention_heads=4,
                num_key_value_heads=1,
                tie_word_embeddings=True,
            ),
        },
    )
)

# Qwen3-MoE's tiny variants: six experts of width 48
_TINY_EXPERTS = dict(TINY_QWEN3, moe_intermediate_size=48, num_experts=6, num_experts_per_tok=2)
register(
    Family(
        model_type="qwen3_moe",
        title="Qwen3-MoE",
        config_class="Qwen3MoeConfig",
        model_class="Qwen3MoeForCausalLM",
        pos_encoding="rope",
        weights=QWEN3_MOE_WEIGHTS,
        ignored=LLAMA_IGNORED,
        prefix="model.",
        from_hf=_qwen3_moe_from_hf,
        to_hf=_qwen3_moe_to_hf,
        needs=[*QWEN3_BASE, *EXPERTS],
        also_reads=FUSED_EXPERTS,
        examples={
            "qwen3_moe_renormalised": dict(
                _TINY_EXPERTS,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=24,
                norm_topk_prob=True,
            ),
            "qwen3_moe_tied": dict(
                _TINY_EXPERTS,
                num_attention_heads=6,
                num_key_value_heads=2,
                head_dim=16,
                norm_topk_prob=False,
                tie_word_embeddings=True,
            ),
        },
    )
)
