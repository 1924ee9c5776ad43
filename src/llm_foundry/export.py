"""Exports of any checkpoint kind ``loading.load_any`` reads (a training run, one of our checkpoints,
an HF directory) with what travels with the weights: the tokenizer, its special ids and the
chat template; and a LoRA run's adapters alone. The file formats themselves are written in
``interop/``."""

from __future__ import annotations

import json
from pathlib import Path


def convert_to_gguf(
    src: str | Path, out_path: str | Path, outtype: str = "f32"
) -> tuple[Path, str | None]:
    """``llm-foundry convert --to-gguf SRC --out OUT.gguf``: a run directory (a LoRA run with its
    adapters merged), one of our checkpoints or an HF directory, with its tokenizer and chat
    template (the HF directory's own, else the built-in one our chat commands use), as one GGUF
    file. Returns the file and the line saying what was merged (None: nothing)."""
    from llm_foundry.chat import BUILTIN_TEMPLATE, load_chat_template
    from llm_foundry.interop.gguf import export_gguf, gguf_types
    from llm_foundry.loading import checkpoint_kind, load_any
    from llm_foundry.outputs import check_new_output
    from llm_foundry.rundir import read_checkpoint

    gguf_types(outtype)  # a bad outtype is named before anything loads
    check_new_output(out_path, "--out", kind="file")

    def read(ckpt: Path):
        return *checkpoint_kind(ckpt), load_any(ckpt, full_precision="convert --to-gguf")

    # a run directory means its latest checkpoint, read again if a training run replaces it
    kind, meta, (model, tok, info) = read_checkpoint(src, read, "--to-gguf")
    hf_tokenizer = getattr(tok, "kind", "") == "hf"
    template = load_chat_template(info.checkpoint)[0] if hf_tokenizer else None
    token_ids = {}
    if kind == "hf":  # an HF config.json names the special ids
        for key in ("bos", "eos", "pad"):
            value = meta.get(f"{key}_token_id")
            value = value[0] if isinstance(value, list) and value else value
            if isinstance(value, int):
                token_ids[key] = value
    name = Path(src).resolve().name
    out = export_gguf(
        model, tok, out_path, outtype, template or BUILTIN_TEMPLATE, name, token_ids=token_ids
    )
    return out, info.merged_note()


def convert_to_peft(src: str | Path, out_dir: str | Path, family: str | None = None) -> dict:
    """``llm-foundry convert --to-peft RUN --out DIR``: the LoRA adapters of a fine-tuning run or
    checkpoint alone, in PEFT's format for the HF export of the base it was tuned from. Returns
    what was written: the settings, the base named in adapter_config.json, the base's storage."""
    from llm_foundry.checkpoint import load_checkpoint, read_lora
    from llm_foundry.interop.peft import save_adapter
    from llm_foundry.loading import checkpoint_kind
    from llm_foundry.outputs import check_new_output, new_directory
    from llm_foundry.rundir import CHECKPOINTS, read_checkpoint, read_run_info

    check_new_output(out_dir)

    def read(ckpt: Path):
        lora = read_lora(ckpt) if checkpoint_kind(ckpt)[0] == "llm-foundry" else None
        if lora is None:
            raise ValueError(
                f"--to-peft {src}: {ckpt} has no LoRA adapters (a base model or a full "
                "fine-tune); convert --to-hf writes the whole model"
            )
        return lora, load_checkpoint(ckpt, merge=False), ckpt

    # a run directory means its latest checkpoint, read again if a training run replaces it
    lora, model, ckpt = read_checkpoint(src, read, "--to-peft")
    # the base it was tuned from, as the run recorded it (a step directory's run is two up)
    run = ckpt.parent.parent if ckpt.parent.name == CHECKPOINTS else None
    train = (read_run_info(run).get("train") or {}) if run else {}
    base = str(train.get("init_from") or "")
    with new_directory(out_dir) as tmp:
        save_adapter(model, tmp, family, base=base)
    return {"from": str(src), "to": str(out_dir), "lora": lora, "base": base}


def convert_from_hf(src_dir: str | Path, out_ckpt: str | Path) -> Path:
    """``llm-foundry convert --from-hf DIR --out CKPT``: an HF checkpoint directory to our
    checkpoint format (``llm_foundry.checkpoint``), its tokenizer alongside. Returns CKPT."""
    from llm_foundry.checkpoint import FORMAT, save_checkpoint
    from llm_foundry.interop.hf import copy_tokenizer, from_hf
    from llm_foundry.outputs import check_new_output, new_directory

    config = Path(src_dir) / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("format") == FORMAT:
        raise ValueError(f"{src_dir} is an llm-foundry checkpoint already; --to-hf exports one")
    check_new_output(out_ckpt)
    model = from_hf(src_dir)
    with new_directory(out_ckpt) as tmp:
        copy_tokenizer(Path(src_dir), save_checkpoint(model, tmp))
    return Path(out_ckpt)


def convert_to_hf(ckpt_dir: str | Path, out_dir: str | Path, family: str | None = None) -> Path:
    """``llm-foundry convert --to-hf CKPT --out DIR``: our checkpoint directory to an HF one
    (``llm_foundry.rundir.checkpoint_dir`` finds a run directory's latest checkpoint), its
    tokenizer alongside; a LoRA checkpoint is written with its adapters merged
    (``load_checkpoint`` folds them). Returns DIR."""
    from llm_foundry.checkpoint import load_checkpoint
    from llm_foundry.interop.hf import copy_tokenizer, name_special_tokens, to_hf
    from llm_foundry.interop.hf.files import read_tokenizer, special_token_ids
    from llm_foundry.loading import checkpoint_kind, refuse_quantized
    from llm_foundry.outputs import check_new_output, new_directory

    ckpt_dir = Path(ckpt_dir)
    refuse_quantized(ckpt_dir, checkpoint_kind(ckpt_dir)[1], "convert --to-hf")
    check_new_output(out_dir)
    model = load_checkpoint(ckpt_dir)
    with new_directory(out_dir) as tmp:
        tok = read_tokenizer(ckpt_dir)
        to_hf(model, tmp, family, **special_token_ids(ckpt_dir, tok))  # generate stops at its eos
        copy_tokenizer(ckpt_dir, tmp, tok)
        name_special_tokens(tmp, tok)
    return Path(out_dir)
