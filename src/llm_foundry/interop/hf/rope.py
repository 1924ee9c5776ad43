"""RoPE settings both ways, for every family with rotary positions: HF ``rope_type`` <->
our ``rope_scaling``, refused with the reason where ours computes something else."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from llm_foundry.config import ModelConfig
from llm_foundry.interop.hf.core import HF_V5

# HF rope_type -> our rope_scaling; the others are refused with the reason
ROPE_TYPES = {"default": "none", "linear": "linear"}
ROPE_TYPES_REFUSED = {
    "dynamic": "dynamic NTK changes the base with the sequence length once it passes "
    "max_position_embeddings; llm-foundry's rope_scaling='ntk' is a fixed base",
    "yarn": "YaRN blends interpolated and extrapolated frequencies and rescales attention",
    "longrope": "LongRoPE uses per-frequency factors that switch with the sequence length",
    "llama3": "Llama 3.1 scaling smooths frequencies band by band",
}


def rope_from_hf(c: Any, problems: list[str]) -> dict[str, Any]:
    """rope_theta / rope_scaling / rope_factor from ``rope_parameters`` (transformers 5) or
    ``rope_theta`` + ``rope_scaling`` (transformers 4)."""
    params = getattr(c, "rope_parameters", None) if HF_V5 else None
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
    if partial not in (None, 1, 1.0) and not hf_rotates_whole_head(c):
        problems.append(
            f"partial_rotary_factor={partial!r} with rope_type={rope_type!r} is not supported "
            f"(transformers' {c.model_type} then computes frequencies for part of each head "
            "only; llm-foundry rotates the whole head); supported: 1.0"
        )
    scaling = ROPE_TYPES[rope_type]
    factor = float(params.get("factor", 1.0)) if scaling != "none" else 1.0
    theta = float(params.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_factor": factor}


def hf_rotates_whole_head(c: Any) -> bool:
    """Whether transformers' own rotary embedding for config ``c`` rotates every dim of a head
    (its ``inv_freq`` has one frequency per pair): a family's default RoPE may ignore
    ``partial_rotary_factor`` where the shared scaled ones honour it. False where it cannot be
    built."""
    modeling = importlib.import_module(type(c).__module__.replace(".configuration_", ".modeling_"))
    rotary = getattr(modeling, type(c).__name__.replace("Config", "RotaryEmbedding"), None)
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    try:
        with torch.device("cpu"):
            return rotary is not None and 2 * rotary(config=c).inv_freq.numel() == head
    except (TypeError, ValueError, KeyError, AttributeError):
        return False


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """RoPE settings as HF config kwargs. Static NTK scaling is plain RoPE with a larger base,
    so it exports exactly as ``rope_theta = theta * factor^(hd / (hd - 2))``."""
    theta, params = cfg.rope_theta, {"rope_type": "default"}
    if cfg.rope_scaling == "linear":
        params = {"rope_type": "linear", "factor": float(cfg.rope_factor)}
    elif cfg.rope_scaling == "ntk":
        hd = cfg.head_size
        theta = theta * cfg.rope_factor ** (hd / (hd - 2))
    if HF_V5:
        return {"rope_parameters": {**params, "rope_theta": float(theta)}}
    scaling = None if params["rope_type"] == "default" else {**params, "type": params["rope_type"]}
    return {"rope_theta": float(theta), "rope_scaling": scaling}
