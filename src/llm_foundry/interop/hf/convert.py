"""The conversions themselves: HF config <-> ``ModelConfig`` through the family registry, and
whole models both ways (in memory or as a checkpoint directory)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from llm_foundry.checkpoint import check_finite, check_layer_count, meta_transformer, unwrap
from llm_foundry.config import ModelConfig
from llm_foundry.durable import usual_mode
from llm_foundry.interop.hf.core import ConversionError, Family, fail, transformers
from llm_foundry.interop.hf.files import WEIGHTS_FILE, read_safetensors_dir, read_safetensors_shapes
from llm_foundry.interop.hf.registry import choose_family, family_of
from llm_foundry.interop.hf.weights import (
    check_against_hf,
    hf_to_ours,
    ours_to_hf,
    untie_stored_head,
)
from llm_foundry.models.transformer import Transformer

log = logging.getLogger(__name__)


def config_from_hf(hf_config: Any) -> ModelConfig:
    """The ``ModelConfig`` computing the same function as ``hf_config`` (the config of any
    registered family); ``ConversionError`` listing every setting that has no exact
    counterpart."""
    family = family_of(hf_config)
    problems: list[str] = []
    fields = family.from_hf(hf_config, problems)
    source = getattr(hf_config, "name_or_path", "")  # the directory from_pretrained read
    where = f" ({Path(source) / 'config.json'})" if source else ""
    fail(problems, f"cannot convert {family.config_class}{where} to llm-foundry")
    return ModelConfig(**fields)


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


def from_hf(model_or_dir: Any, dtype: torch.dtype | None = None) -> Transformer:
    """Our ``Transformer`` (eval mode, float32 unless ``dtype``) computing the same function as
    an HF ``*ForCausalLM`` given in memory or as a checkpoint directory (config.json +
    safetensors, possibly sharded)."""
    if isinstance(model_or_dir, (str, Path)):
        path = Path(model_or_dir)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path / 'config.json'} not found: not an HF checkpoint")
        hf_config = transformers.AutoConfig.from_pretrained(str(path))
        cfg, family = config_from_hf(hf_config), family_of(hf_config)
        # the config is checked against the weight files before anything is allocated
        shapes = _check_hf_weights_fit(path, cfg, family)
        hf_tensors = read_safetensors_dir(path)
        weights_file: Path = path
    elif isinstance(model_or_dir, transformers.PreTrainedModel):
        hf_config = model_or_dir.config
        hf_tensors = model_or_dir.state_dict()
        cfg, family = config_from_hf(hf_config), family_of(hf_config)
        shapes = {k: tuple(v.shape) for k, v in meta_transformer(cfg).state_dict().items()}
        weights_file = Path(type(model_or_dir).__name__)
    else:
        raise TypeError(
            "from_hf takes a transformers PreTrainedModel or a checkpoint directory; "
            f"got {type(model_or_dir).__name__}"
        )
    cfg, untied = untie_stored_head(hf_tensors, cfg, family)
    if untied:
        log.warning(
            f"note: {weights_file} ties the head to the embedding (tie_word_embeddings) but stores "
            "an lm_head.weight with other values: loaded untied, as transformers loads it"
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
    fam = family_of(hf_config)
    tensors = ours_to_hf(model.state_dict(), cfg, fam)
    check_against_hf(tensors, hf_config, fam, cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(str(out))
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    usual_mode(out / WEIGHTS_FILE)
    return out
