"""Quantized copies of checkpoints: any model ``loading.load_any`` reads (a training run, a LoRA run
with its adapters merged, one of our checkpoints, an HF directory) written as our checkpoint format with int8 or int4 projections
(``models/quant.py``), its tokenizer and chat template alongside."""

from __future__ import annotations

import json
from pathlib import Path

from llm_foundry.checkpoint import CONFIG_FILE, WEIGHTS_FILE, save_checkpoint
from llm_foundry.models.quant import quantize_model, weight_bytes
from llm_foundry.tokenizer_files import copy_tokenizer_files


def quantize_checkpoint(
    src: str | Path, out: str | Path, scheme: str, group_size: int = 64, adapter=None
) -> dict:
    """Write ``src`` (with ``adapter``, a PEFT adapter or LoRA run, merged in first) quantized
    to ``scheme`` (int8 | int4 in groups of ``group_size``) into the directory ``out``; a
    group size that fits no projection is refused. Returns what was done: the settings
    recorded in config.json, the bytes a decoded token reads for weights before and after, and
    the weight file's bytes."""
    from llm_foundry.loading import load_any
    from llm_foundry.outputs import check_new_output, new_directory

    check_new_output(out)  # before the model loads
    model, _, info = load_any(src, full_precision="quantize", adapter=adapter)
    before = weight_bytes(model)
    settings = quantize_model(model, scheme, group_size, name=str(src), flag="--to")
    with new_directory(out) as tmp:
        save_checkpoint(model, tmp)
        copy_tokenizer_files(info.checkpoint, tmp)  # with its chat template and special tokens
        if info.eos_ids:  # an HF model's end-of-sequence ids live in its config.json: keep them
            meta = json.loads((tmp / CONFIG_FILE).read_text())
            meta["eos_token_id"] = sorted(info.eos_ids)
            (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
    return {
        "from": str(src),
        "to": str(out),
        **settings,
        "merged": info.merged_note(),  # LoRA adapters, folded in before quantizing
        "weight_bytes_per_token": {"before": before, "after": weight_bytes(model)},
        "file_bytes": (Path(out) / WEIGHTS_FILE).stat().st_size,
    }
