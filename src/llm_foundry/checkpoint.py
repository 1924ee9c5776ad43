"""llm-foundry's own weights format: a directory with ``model.safetensors`` and ``config.json``.

    config.json          {"format": "llm-foundry", "version": 1, "model": {...ModelConfig fields}}
    model.safetensors    the state dict; a tensor shared by two names (tied embeddings) is stored
                         once and re-tied on load

Nothing is unpickled on load: the config is JSON and the tensors are safetensors. Training
checkpoints (``train/state.py``) add their own files next to these two, so ``load_checkpoint``
reads a training step directory as well.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from llm_foundry.config import ModelConfig
from llm_foundry.models.transformer import Transformer

FORMAT = "llm-foundry"
VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under ``torch.compile`` (``_orig_mod``) and DDP/FSDP (``module``) wrappers,
    whose state-dict names would otherwise carry a prefix."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None:
            inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def save_checkpoint(model: torch.nn.Module, path: str | Path) -> Path:
    """Write ``model`` (a ``Transformer``, possibly compiled or DDP-wrapped) to the directory
    ``path`` (created if needed; files already there are replaced). Returns the directory."""
    model = unwrap(model)
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(
            f"save_checkpoint needs an llm-foundry Transformer (a module with a ModelConfig at "
            f".cfg); got {type(model).__name__}"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_model(model, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    meta = {"format": FORMAT, "version": VERSION, "model": cfg.to_dict()}
    (path / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
    return path


def read_config(path: str | Path) -> ModelConfig:
    """The ``ModelConfig`` stored in checkpoint directory ``path`` (format and version checked)."""
    file = Path(path) / CONFIG_FILE
    if not file.exists():
        raise FileNotFoundError(f"{file} not found: {path} is not an llm-foundry checkpoint")
    try:
        meta = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        hint = ""
        if isinstance(meta, dict) and "model_type" in meta:
            hint = (
                f" It looks like a Hugging Face checkpoint (model_type={meta['model_type']!r}): "
                "read it with llm_foundry.interop.hf.from_hf or `llm-foundry convert --from-hf`."
            )
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{file}: format={found!r}, expected {FORMAT!r}.{hint}")
    if meta.get("version") != VERSION:
        raise ValueError(
            f"{file}: version={meta.get('version')!r} is not supported; this code reads "
            f"version {VERSION}"
        )
    return ModelConfig.from_dict(meta["model"])


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Fill ``model``'s parameters from ``path/model.safetensors`` in place (strict: every
    parameter present, no unknown tensor); tied parameters stay tied."""
    model = unwrap(model)
    file = Path(path) / WEIGHTS_FILE
    if not file.exists():
        raise FileNotFoundError(f"{file} not found: {path} is not an llm-foundry checkpoint")
    first = next(iter(model.parameters()), None)
    device = str(first.device) if first is not None else "cpu"
    try:
        load_model(model, str(file), strict=True, device=device)
    except RuntimeError as e:  # names/shapes that don't match the config the model was built from
        raise ValueError(f"{file} does not match the model its config.json describes: {e}") from e


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Transformer:
    """Build the ``Transformer`` saved in directory ``path`` and load its weights; eval mode."""
    model = Transformer(read_config(path)).to(device)
    load_weights(model, path)
    return model.eval()


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint directory ``path`` names: itself, or for a training run directory (or its
    ``checkpoints/`` folder) the step directory that ``latest.json`` points at."""
    if not path.is_dir():
        raise FileNotFoundError(f"--checkpoint {path}: no such directory")
    if (path / "config.json").exists():
        return path
    for root in (path / "checkpoints", path):
        pointer = root / "latest.json"
        if pointer.exists():
            try:
                step = root / json.loads(pointer.read_text())["path"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{pointer} is not a valid latest-checkpoint pointer: {e}"
                ) from None
            if not (step / "config.json").exists():
                raise FileNotFoundError(f"{pointer} points at {step}, which has no config.json")
            return step
    raise FileNotFoundError(
        f"--checkpoint {path}: no config.json (an llm-foundry checkpoint or an HF transformers "
        "directory) and no checkpoints/latest.json (a training run directory)"
    )
