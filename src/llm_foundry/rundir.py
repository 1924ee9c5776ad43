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
) -> Loaded:
    """The model, tokenizer and provenance of a run directory, one of our checkpoints or an HF
    transformers directory. ``tokenizer`` overrides the directory's ``tokenizer.json``;
    ``quantize`` (int8 | int4, int4 in groups of ``group_size``) quantizes the loaded model's
    projections in memory (``models/quant.py``)."""
    from llm_foundry.tokenizer import load_any_tokenizer

    given = Path(path)
    ckpt = checkpoint_dir(given)
    kind, meta = checkpoint_kind(ckpt)
    if quantize and meta.get("quantization"):
        raise ValueError(
            f"--quantize {quantize}: {ckpt} is quantized already "
            f"({meta['quantization'].get('scheme')}); load it as it is"
        )
    if kind == "llm-foundry":
        from llm_foundry.checkpoint import load_checkpoint

        model = load_checkpoint(ckpt, device)
    else:
        from llm_foundry.interop.hf import from_hf

        model = from_hf(ckpt).to(device).eval()
    if quantize:
        from llm_foundry.models.quant import quantize_model

        quantize_model(model, quantize, group_size)
    value = meta.get("eos_token_id")  # HF's key; our quantized copies of HF models keep it
    hf_eos = [value] if isinstance(value, int) else [e for e in value or [] if isinstance(e, int)]
    tok_file = Path(tokenizer) if tokenizer else ckpt / "tokenizer.json"
    if tokenizer and not tok_file.is_file():
        raise FileNotFoundError(f"--tokenizer {tok_file}: no such file")
    tok = load_any_tokenizer(tok_file, hf_eos[0] if hf_eos else None) if tok_file.exists() else None
    eos = set(hf_eos)
    if tok is not None and tok.eos_id is not None:
        eos.add(tok.eos_id)
    run = given if ckpt != given and (given / CHECKPOINTS).is_dir() else None
    return Loaded(model.eval(), tok, CheckpointInfo(kind, ckpt, run, eos, meta))
