"""Training run directories, and the one loader for every kind of checkpoint.

    RUN_DIR/
      run.json          what the run was started with (configs, data, code and machine)
      metrics.jsonl     one record a line (train/metrics.py reads it)
      checkpoints/      step_N/ directories and latest.json (train/state.py writes them)

``load(path)`` accepts a run directory (its latest checkpoint), one of our checkpoint
directories, or an HF transformers directory, and returns ``(model, tokenizer, info)``: every
command that reads a model (generate, eval, inspect, convert) goes through it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

RUN_INFO = "run.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"


def read_run_info(run_dir: str | Path) -> dict:
    """``RUN_DIR/run.json``, with errors naming the file ({} when the run wrote none yet)."""
    file = Path(run_dir) / RUN_INFO
    if not file.exists():
        return {}
    try:
        info = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}); the run directory is damaged") from None
    if not isinstance(info, dict):
        raise ValueError(f"{file} holds {type(info).__name__}, not a run description object")
    return info


@dataclass
class RunDir:
    """A training run's directory and what can be read from it."""

    path: Path

    def __post_init__(self) -> None:
        self.path = Path(self.path)

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    def latest(self) -> Path | None:
        """The latest complete checkpoint (None before the first save)."""
        from llm_foundry.train.state import latest_checkpoint

        return latest_checkpoint(self.checkpoints)

    def info(self) -> dict:
        return read_run_info(self.path)

    def metrics(self) -> list[dict]:
        from llm_foundry.train.metrics import read_records

        return read_records(self.path / METRICS)

    def resume_point(self):
        """(checkpoint, model config, train config, data dir or None) of the latest checkpoint,
        from its state.json and run.json; None when there is no checkpoint to resume."""
        from llm_foundry.config import ModelConfig
        from llm_foundry.train.config import TrainConfig
        from llm_foundry.train.state import read_state

        ckpt = self.latest()
        if ckpt is None:
            return None
        state = read_state(ckpt)
        data = (self.info().get("data") or {}).get("dir")
        model = ModelConfig.from_dict(state["model_config"])
        return ckpt, model, TrainConfig.from_dict(state["train_config"]), data


def checkpoint_dir(path: str | Path, flag: str = "--checkpoint") -> Path:
    """The checkpoint directory ``path`` names: itself (ours or an HF one: it has a
    config.json), or for a training run directory (or its ``checkpoints/`` folder) the step
    directory that ``latest.json`` points at."""
    from llm_foundry.train.state import LATEST, latest_checkpoint

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{flag} {path}: no such directory")
    if (path / "config.json").exists():
        if (path / CHECKPOINTS / LATEST).exists():  # which one was meant is not ours to guess
            raise ValueError(
                f"{flag} {path} holds both a checkpoint (config.json) and a training run "
                f"(checkpoints/): give {path / CHECKPOINTS} for the run, or move the checkpoint "
                "into a directory of its own"
            )
        return path
    for root in (path / CHECKPOINTS, path):
        if (root / LATEST).exists():
            step = latest_checkpoint(root)
            if step is None or not (step / "config.json").exists():
                raise FileNotFoundError(
                    f"{root / LATEST} points at a step directory with no config.json"
                )
            return step
    raise FileNotFoundError(
        f"{flag} {path}: no config.json (an llm-foundry checkpoint or an HF transformers "
        "directory) and no checkpoints/latest.json (a training run directory)"
    )


def checkpoint_kind(ckpt: Path) -> tuple[str, dict]:
    """('llm-foundry' | 'hf', config.json's content) of checkpoint directory ``ckpt``."""
    file = ckpt / "config.json"
    try:
        meta = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if isinstance(meta, dict) and meta.get("format") == "llm-foundry":
        return "llm-foundry", meta
    if isinstance(meta, dict) and "model_type" in meta:
        return "hf", meta
    raise ValueError(
        f"{file} is neither an llm-foundry checkpoint config "
        '({"format": "llm-foundry", ...}) nor an HF transformers config (no "model_type")'
    )


@dataclass
class CheckpointInfo:
    """Where a loaded model came from."""

    kind: str  # "llm-foundry" or "hf"
    checkpoint: Path  # the directory the weights were read from
    run: Path | None = None  # the training run directory, when one was given
    eos_ids: set[int] = field(default_factory=set)  # the tokenizer's and config.json's
    config: dict[str, Any] = field(default_factory=dict)  # config.json as read
    lora: dict | None = None  # the LoRA settings folded into the weights (a run's or --adapter's)
    adapter: Path | None = None  # the adapter directory put on the model, when one was given

    def merged_note(self) -> str | None:
        """One line saying that LoRA adapters were merged into the model (None: there were
        none)."""
        from llm_foundry.models.lora import describe_merge

        return (
            describe_merge(self.lora, str(self.adapter) if self.adapter else None)
            if self.lora
            else None
        )


class Loaded(NamedTuple):
    model: Any  # a Transformer in eval mode
    tokenizer: Any  # ours, an HF tokenizers file, or None when the directory has none
    info: CheckpointInfo


def load(
    path: str | Path,
    device: str = "cpu",
    tokenizer: str | Path | None = None,
    quantize: str | None = None,
    group_size: int = 64,
    adapter: str | Path | None = None,
) -> Loaded:
    """The model, tokenizer and provenance of a run directory, one of our checkpoints or an HF
    transformers directory. LoRA adapters come merged into their base weights (a plain model):
    a LoRA run's own, or those of ``adapter`` (a PEFT adapter directory, or a LoRA run or
    checkpoint of ours) put on this model. ``tokenizer`` overrides the directory's
    ``tokenizer.json``; ``quantize`` (int8 | int4, int4 in groups of ``group_size``) quantizes
    the loaded model's projections in memory (``models/quant.py``)."""
    from llm_foundry.tokenizer import load_any_tokenizer

    given = Path(path)
    ckpt = checkpoint_dir(given)
    kind, meta = checkpoint_kind(ckpt)
    if (quantize or adapter) and meta.get("quantization"):
        flag = f"--quantize {quantize}" if quantize else f"--adapter {adapter}"
        raise ValueError(
            f"{flag}: {ckpt} is quantized already ({meta['quantization'].get('scheme')}); "
            + ("load it as it is" if quantize else "put the adapter on the full-precision model")
        )
    lora = None
    if kind == "llm-foundry":
        from llm_foundry.checkpoint import load_checkpoint, read_lora

        lora = read_lora(ckpt)
        model = load_checkpoint(ckpt, device)
    else:
        from llm_foundry.interop.hf import from_hf

        model = from_hf(ckpt).to(device).eval()
    if adapter is not None:
        if lora:
            raise ValueError(
                f"--adapter {adapter}: {ckpt} carries LoRA adapters of its own (merged on load); "
                "give the base model it was fine-tuned from"
            )
        lora = put_adapter(model, adapter)
    if quantize:
        from llm_foundry.models.quant import quantize_model

        quantize_model(model, quantize, group_size)
    value = meta.get("eos_token_id")  # HF's key; our quantized copies of HF models keep it
    hf_eos = [value] if isinstance(value, int) else [e for e in value or [] if isinstance(e, int)]
    tok_file = Path(tokenizer) if tokenizer else ckpt / "tokenizer.json"
    if tokenizer and not tok_file.is_file():
        raise FileNotFoundError(f"--tokenizer {tok_file}: no such file")
    tok = load_any_tokenizer(tok_file, hf_eos[0] if hf_eos else None) if tok_file.exists() else None
    vocab = model.cfg.vocab_size
    if tok is not None and tok.vocab_size > vocab:  # its ids past the embedding would crash
        raise ValueError(
            f"{tok_file} has {tok.vocab_size:,} tokens but the model's vocab_size is {vocab:,} "
            f"(ids >= {vocab:,} have no embedding): use the tokenizer the model was trained with"
        )
    eos = set(hf_eos)
    if tok is not None and tok.eos_id is not None:
        eos.add(tok.eos_id)
    run = given if ckpt != given and (given / CHECKPOINTS).is_dir() else None
    info = CheckpointInfo(kind, ckpt, run, eos, meta, lora, Path(adapter) if adapter else None)
    return Loaded(model.eval(), tok, info)


def put_adapter(model, adapter: str | Path) -> dict:
    """Put the LoRA adapter in directory ``adapter`` on ``model`` and merge it into the weights
    (``models.lora.fold_lora``); returns its settings. ``adapter`` is a PEFT adapter directory
    (adapter_config.json: written by peft or by ``convert --to-peft``) or a LoRA run or checkpoint
    of ours, whose adapters are taken and its frozen base left behind."""
    import torch

    from llm_foundry.checkpoint import load_checkpoint, read_config, read_lora
    from llm_foundry.models.lora import apply_lora_settings, fold_lora, lora_layers, lora_settings

    path = Path(adapter)
    if not path.is_dir():
        raise FileNotFoundError(f"--adapter {path}: no such directory")
    if (path / "adapter_config.json").exists() or (path / "adapter_model.safetensors").exists():
        from llm_foundry.interop.peft import load_adapter

        load_adapter(model, path)
        settings = lora_settings(model)
    else:
        ckpt = checkpoint_dir(path, "--adapter")
        if checkpoint_kind(ckpt)[0] != "llm-foundry" or read_lora(ckpt) is None:
            raise ValueError(
                f"--adapter {path}: neither a PEFT adapter (adapter_config.json) nor a LoRA run "
                "or checkpoint (config.json with 'lora')"
            )
        diff = model.cfg.weight_differences(read_config(ckpt))
        if diff:
            raise ValueError(
                f"--adapter {path} was trained on another model ({'; '.join(diff[:3])}): give "
                "the base it was fine-tuned from"
            )
        tuned = load_checkpoint(ckpt, merge=False)
        settings = {**lora_settings(tuned), "base_dtype": "fp32"}  # the base is the one given
        apply_lora_settings(model, settings)
        ours = lora_layers(model)
        with torch.no_grad():
            for name, layer in lora_layers(tuned).items():
                ours[name].lora_A.copy_(layer.lora_A)
                ours[name].lora_B.copy_(layer.lora_B)
    fold_lora(model)
    return settings
