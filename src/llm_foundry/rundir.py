"""Training run directories: their layout and every reader of it, and the one loader for every
kind of checkpoint.

    RUN_DIR/
      run.json          what the run was started with (configs, data, code and machine)
      metrics.jsonl     one record a line (train/metrics.py appends them; ``read_records``)
      checkpoints/      step_N/ directories and latest.json (train/state.py writes them)
        latest.json     {"step": N, "path": "step_00000N"}: the newest complete checkpoint
        step_00000N/    config.json + model.safetensors, optimizer.safetensors, state.json, ...

The training side writes this layout with the names defined here; everything that reads a run
(resume, generate, inspect, ablations) reads it through this module.

``load(path)`` accepts a run directory (its latest checkpoint), one of our checkpoint
directories, or an HF transformers directory, and returns ``(model, tokenizer, info)``: every
command that reads a model (generate, eval, inspect, convert) goes through it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from llm_foundry.messages import shown

log = logging.getLogger(__name__)

RUN_INFO = "run.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
LATEST = "latest.json"  # in CHECKPOINTS: names the newest complete step directory
STATE = "state.json"  # in a step directory: step, configs, optimizer, RNG and sampler states


def step_name(step: int) -> str:
    """The directory name of the checkpoint saved at ``step`` (sorts in step order)."""
    return f"step_{step:06d}"


def step_dirs(ckpt_root: Path) -> list[Path]:
    """Every step directory under ``ckpt_root``, oldest first."""
    return sorted(Path(ckpt_root).glob("step_*"))


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The step directory ``ckpt_root/latest.json`` names (None without a pointer, or when it
    names a directory that is gone)."""
    pointer = Path(ckpt_root) / LATEST
    if not pointer.exists():
        return None
    try:
        name = json.loads(pointer.read_text())["path"]
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise TypeError(f"path {name!r} is not a step directory name")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ValueError(
            f"{pointer} is not a valid latest-checkpoint pointer ({e!r}); expected "
            '{"step": N, "path": "step_000N"}'
        ) from None
    path = Path(ckpt_root) / name
    return path if path.exists() else None


def read_state(path: Path) -> dict:
    """``path/state.json`` (a training checkpoint's state), with errors naming the file."""
    file = Path(path) / STATE
    try:
        state = json.loads(file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{file} is missing: {path} is not a training checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ValueError(f"{file} holds no training state (expected an object with a 'step')")
    return state


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


def read_records(path: str | Path) -> list[dict]:
    """Every record of a ``metrics.jsonl``, in order. The file is flushed after every record and
    fsynced with every checkpoint, so a crash tears at most its last line: that one is dropped
    with a note. A damaged line anywhere else is an error naming file and line. A record whose
    ``step`` is missing or not a step (a string, a float, NaN, a negative number: an edit by
    hand, another tool) is left out with a warning naming file and line, so it cannot stop a
    run from resuming (a resume rewrites the file without it)."""
    path = Path(path)
    # lines end at '\n' only: a JSON string may hold U+2028 and other characters that
    # str.splitlines() would take for line ends
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    if lines and not lines[-1].strip():
        lines.pop()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError(f"a {type(rec).__name__}, not an object")
        except ValueError as e:
            if i == len(lines) - 1:  # torn by a crash mid-write
                log.warning(f"note: {path}: dropped a torn last record (line {i + 1})")
                break
            raise ValueError(
                f"{path}, line {i + 1}: not a JSON record ({e}); the file is damaged"
            ) from None
        step = rec.get("step")
        if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
            what = "no step" if "step" not in rec else f"step={shown(step)}"
            log.warning(
                f"warning: {path}, line {i + 1}: left out a record with {what} (a step is an "
                "integer >= 0)"
            )
            continue
        records.append(rec)
    return records


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
        return latest_checkpoint(self.checkpoints)

    def info(self) -> dict:
        return read_run_info(self.path)

    def metrics(self) -> list[dict]:
        return read_records(self.path / METRICS)


def checkpoint_dir(path: str | Path, flag: str = "--checkpoint") -> Path:
    """The checkpoint directory ``path`` names: itself (ours or an HF one: it has a
    config.json), or for a training run directory (or its ``checkpoints/`` folder) the step
    directory that ``latest.json`` points at."""
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
