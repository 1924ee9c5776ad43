"""Exports of any checkpoint kind ``rundir.load`` reads (a training run, one of our checkpoints,
an HF directory) with what travels with the weights: the tokenizer, its special ids and the
chat template. The file formats themselves are written in ``interop/``."""

from __future__ import annotations

from pathlib import Path


def convert_to_gguf(src: str | Path, out_path: str | Path, outtype: str = "f32") -> Path:
    """``llm-foundry convert --to-gguf SRC --out OUT.gguf``: a run directory, one of our
    checkpoints or an HF directory, with its tokenizer and chat template (the HF directory's
    own, else the built-in one our chat commands use), as one GGUF file."""
    from llm_foundry.chat import BUILTIN_TEMPLATE, load_chat_template
    from llm_foundry.interop.gguf import GGUFError, export_gguf, gguf_types
    from llm_foundry.rundir import checkpoint_dir, checkpoint_kind, load

    gguf_types(outtype)  # a bad outtype is named before anything loads
    if Path(out_path).is_dir():
        raise GGUFError(f"--out {out_path} is a directory; give the .gguf file to write")
    ckpt = checkpoint_dir(src, "--to-gguf")
    kind, meta = checkpoint_kind(ckpt)
    if "quantization" in meta:
        q = meta["quantization"]
        scheme = q.get("scheme") if isinstance(q, dict) else q
        raise GGUFError(
            f"{ckpt} holds a quantized model (config.json quantization scheme {scheme!r}); "
            "export from the full-precision checkpoint"
        )
    model, tok, info = load(ckpt)
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
    return export_gguf(
        model, tok, out_path, outtype, template or BUILTIN_TEMPLATE, name, token_ids=token_ids
    )
