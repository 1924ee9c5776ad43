"""The one loader of every kind of checkpoint: ``load_any(path)`` takes a training run (its
latest checkpoint), one of our checkpoint directories or an HF transformers directory, with LoRA
adapters merged (a run's own, or an ``adapter`` put on it), and returns ``(model, tokenizer,
info)``. Every command that reads a model (generate, eval, serve, inspect, convert, quantize,
a fine-tune's init_from) goes through it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from llm_foundry.rundir import CHECKPOINTS, missing_file, read_checkpoint, replaced


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


def read_model_config(path: str | Path, flag: str = "--checkpoint"):
    """The ``ModelConfig`` of a run (its latest checkpoint), one of our checkpoints or an HF
    transformers directory, from its config.json alone (no weights read): ours through
    ``checkpoint.read_config``, an HF one through ``interop.hf.config_from_hf``."""
    return model_config_at(path, flag)[1]


def model_config_at(path: str | Path, flag: str = "--checkpoint"):
    """(the checkpoint directory ``path`` names, ``read_model_config``'s config of it)."""
    refuse_adapter_dir(path, flag)

    def read(ckpt: Path):
        if checkpoint_kind(ckpt)[0] == "llm-foundry":
            from llm_foundry.checkpoint import read_config

            return ckpt, read_config(ckpt)
        from llm_foundry.interop.hf import config_from_hf, transformers

        return ckpt, config_from_hf(transformers.AutoConfig.from_pretrained(str(ckpt)))

    return read_checkpoint(path, read, flag)


def refuse_adapter_dir(path: str | Path, flag: str = "--checkpoint") -> None:
    """Refuse, in one line naming its base and ``--adapter``, a PEFT adapter directory (an
    adapter_config.json and no config.json) given as ``flag`` where a model is expected."""
    path = Path(path)
    adapter = path / "adapter_config.json"
    if (path / "config.json").exists() or not adapter.is_file():
        return
    try:
        base = json.loads(adapter.read_text()).get("base_model_name_or_path")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        base = None  # the adapter's own loader names what is wrong with the file
    base = base or "BASE"
    raise ValueError(
        f"{flag} {path} is a PEFT adapter (adapter_config.json), not a model: its base is {base}; "
        f"generate, eval and quantize take both as --checkpoint {base} --adapter {path}"
    )


def refuse_quantized(ckpt: Path, meta: dict, use: str) -> None:
    """The one refusal of a ``quantize`` output (config.json ``meta``) for a ``use`` that needs
    the full-precision weights: exports, quantizing again, adapters, training."""
    q = meta.get("quantization")
    if q:
        scheme = q.get("scheme") if isinstance(q, dict) else q
        raise ValueError(
            f"{use}: {ckpt} is quantized already ({scheme} weights, written by `llm-foundry "
            "quantize`); give the full-precision checkpoint it was made from"
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
        """One line saying that LoRA adapters were merged into the model, a LoRA run's own first
        where an adapter went over them (None: there were none)."""
        from llm_foundry.models.lora import describe_merge

        if not self.lora:
            return None
        note = describe_merge(self.lora, str(self.adapter) if self.adapter else None)
        over = self.lora.get("over")
        return f"{describe_merge(over, str(self.checkpoint))}; then {note}" if over else note


class Loaded(NamedTuple):
    model: Any  # a Transformer in eval mode
    tokenizer: Any  # ours, an HF tokenizers file, or None when the directory has none
    info: CheckpointInfo


def load_any(
    path: str | Path,
    device: str = "cpu",
    tokenizer: str | Path | None = None,
    quantize: str | None = None,
    group_size: int = 64,
    adapter: str | Path | None = None,
    full_precision: str | None = None,
) -> Loaded:
    """The model, tokenizer and provenance of a run directory, one of our checkpoints or an HF
    transformers directory. LoRA adapters come merged into their base weights (a plain model):
    a LoRA run's own, or those of ``adapter`` (a PEFT adapter directory, or a LoRA run or
    checkpoint of ours) put on this model. ``tokenizer`` overrides the directory's
    ``tokenizer.json``; ``quantize`` (int8 | int4, int4 in groups of ``group_size``) quantizes
    the loaded model's projections in memory (``models/quant.py``). ``full_precision`` names a
    use that needs full-precision weights (an export, a fine-tune's start): a quantized
    checkpoint is refused for it, as it is for ``quantize`` and ``adapter``."""
    given = Path(path)
    refuse_adapter_dir(given)
    return read_checkpoint(
        given,
        lambda ckpt: _load(given, ckpt, device, tokenizer, quantize, group_size, adapter,
                           full_precision),
    )  # fmt: skip


def _load(given: Path, ckpt: Path, device, tokenizer, quantize, group_size, adapter,
          full_precision) -> Loaded:  # fmt: skip
    """``load_any`` of checkpoint directory ``ckpt``, which ``given`` names."""
    from llm_foundry.tokenizer_files import model_ids, open_tokenizer

    kind, meta = checkpoint_kind(ckpt)
    use = full_precision or (f"--quantize {quantize}" if quantize else None)
    use = use or (f"--adapter {adapter}" if adapter is not None else None)
    if use:
        refuse_quantized(ckpt, meta, use)
    lora = None
    if kind == "llm-foundry":
        from llm_foundry.checkpoint import load_checkpoint, read_lora

        lora = read_lora(ckpt)
        model = load_checkpoint(ckpt, device)
    else:
        from llm_foundry.interop.hf import from_hf

        model = from_hf(ckpt).to(device).eval()
    if adapter is not None:  # over a LoRA run: over its adapters, merged (SFT, then DPO on it)
        merged, lora = lora, put_adapter(model, adapter)
        if merged:
            lora["over"] = merged
    if quantize:
        from llm_foundry.models.quant import quantize_model

        quantize_model(model, quantize, group_size, name=str(given))
    # the model's own end ids: generation_config.json's, config.json's (an HF model's, or the
    # copy our quantized HF models keep)
    model_eos = model_ids(ckpt, "eos")
    tok_file = Path(tokenizer) if tokenizer else ckpt / "tokenizer.json"
    if tokenizer and not tok_file.is_file():
        raise FileNotFoundError(f"--tokenizer {tok_file}: no such file")
    # the special ids the files beside it name (tokenizer_config.json, generation_config.json)
    tok, carried = open_tokenizer(tok_file) if tok_file.exists() else (None, None)
    if tok is None and replaced(ckpt):  # not "no tokenizer": its run deleted the directory
        raise missing_file(tok_file)
    vocab = model.cfg.vocab_size
    if tok is not None and tok.vocab_size > vocab:  # its ids past the embedding would crash
        raise ValueError(
            f"{tok_file} has {tok.vocab_size:,} tokens but the model's vocab_size is {vocab:,} "
            f"(ids >= {vocab:,} have no embedding): use the tokenizer the model was trained with"
        )
    if getattr(tok, "kind", "") == "hf" and tok.eos_id is None and model_eos:
        # a bare tokenizer.json (--tokenizer FILE) ends where its model does
        tok.eos_id = model_eos[0]
    eos = set(model_eos) | set(carried.eos_ids if carried else ())
    run = given if ckpt != given and (given / CHECKPOINTS).is_dir() else None
    info = CheckpointInfo(kind, ckpt, run, eos, meta, lora, Path(adapter) if adapter else None)
    return Loaded(model.eval(), tok, info)


def put_adapter(model, adapter: str | Path) -> dict:
    """Put the LoRA adapter in directory ``adapter`` on ``model`` and merge it into the weights
    (``models.lora.fold_lora``); returns its settings. ``adapter`` is a PEFT adapter directory
    (adapter_config.json: written by peft or by ``convert --to-peft``) or a LoRA run or checkpoint
    of ours, whose adapters are taken and its frozen base left behind."""
    import torch

    from llm_foundry.messages import first_few
    from llm_foundry.models.lora import (
        apply_lora_settings,
        base_differences,
        fold_lora,
        lora_layers,
        lora_settings,
    )

    path = Path(adapter)
    if not path.is_dir():
        raise FileNotFoundError(f"--adapter {path}: no such directory")
    if (path / "adapter_config.json").exists() or (path / "adapter_model.safetensors").exists():
        from llm_foundry.interop.peft import load_adapter

        load_adapter(model, path)
        settings = lora_settings(model)
    else:
        tuned = read_checkpoint(path, lambda ckpt: _lora_model(model, path, ckpt), "--adapter")
        trained = lora_settings(tuned)
        settings = {**trained, "base_dtype": "fp32"}  # the base is the one given
        # the run holds the base it was fitted over: a base retrained since is said
        differ, compared = base_differences(model, tuned)
        apply_lora_settings(model, settings)
        if trained.get("base_dtype", "fp32") != "fp32":  # fitted to the rounded weights: say so
            settings["trained_over"] = trained["base_dtype"]
        if differ:
            settings["other_base"] = (
                f"{len(differ)} of {compared} tensors differ: {first_few(differ)}"
            )
        ours = lora_layers(model)
        with torch.no_grad():
            for name, layer in lora_layers(tuned).items():
                ours[name].lora_A.copy_(layer.lora_A)
                ours[name].lora_B.copy_(layer.lora_B)
    fold_lora(model)
    return settings


def _lora_model(model, path: Path, ckpt: Path):
    """The LoRA model of our checkpoint ``ckpt`` (which ``--adapter path`` names), adapters not
    merged, after checking that it was tuned from ``model``'s architecture."""
    from llm_foundry.checkpoint import load_checkpoint, read_config, read_lora

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
    return load_checkpoint(ckpt, merge=False)
