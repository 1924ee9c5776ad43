"""Exports of any checkpoint kind ``loading.load_any`` reads (a training run, one of our checkpoints,
an HF directory) with what travels with the weights: the tokenizer, its special ids and the
chat template; and a LoRA run's adapters alone. The file formats themselves are written in
``interop/``."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def convert_to_gguf(
    src: str | Path, out_path: str | Path, outtype: str = "f32"
) -> tuple[Path, str | None]:
    """``llm-foundry convert --to-gguf SRC --out OUT.gguf``: a run directory (a LoRA run with its
    adapters merged), one of our checkpoints or an HF directory, with its tokenizer, special ids
    and chat template as the files beside its tokenizer.json give them (``tokenizer_files``; the
    built-in template our chat commands use for our tokenizers, and, with a note, for an HF
    tokenizer that has none), as one GGUF file; a template's end of turn that is a special token
    other than eos is named as llama.cpp's eot, one that is text is said in a note. Returns the
    file and the line saying what was merged (None: nothing)."""
    from llm_foundry.interop.gguf import export_gguf, gguf_types
    from llm_foundry.loading import load_any, refuse_adapter_dir
    from llm_foundry.outputs import check_new_output
    from llm_foundry.rundir import read_checkpoint
    from llm_foundry.tokenizer_files import chat_format, read_tokenizer_meta

    gguf_types(outtype)  # a bad outtype is named before anything loads
    check_new_output(out_path, "--out", kind="file")

    def read(ckpt: Path):
        model, tok, info = load_any(ckpt, full_precision="convert --to-gguf")
        if tok is None:
            return model, tok, info, None, {}
        chat = chat_format(ckpt, tok)
        return model, tok, info, chat, read_tokenizer_meta(ckpt, tok).ids

    refuse_adapter_dir(src, "--to-gguf")
    # a run directory means its latest checkpoint, read again if a training run replaces it
    model, tok, info, chat, token_ids = read_checkpoint(src, read, "--to-gguf")
    notes = [chat.note] if chat is not None and chat.note else []
    if chat is not None and chat.end_id is not None and chat.end_id != token_ids.get("eos"):
        token_ids = {**token_ids, "eot": chat.end_id}  # llama.cpp ends a reply at it too
    elif chat is not None and chat.end_id is None:
        notes.append(
            f"note: the chat template ends a turn with {chat.end!r}, text and not a token: "
            "llama.cpp's chat (llama-cpp-python's create_chat_completion, llama-server) does not "
            f"stop at the end of a turn unless given stop=[{chat.end!r}]"
        )
    name = Path(src).resolve().name
    template = chat.template if chat is not None else None
    out = export_gguf(model, tok, out_path, outtype, template, name, token_ids=token_ids,
                      tokenizer_file=info.checkpoint / "tokenizer.json")  # fmt: skip
    for note in notes:  # after the file is written: of a refused export they would only distract
        log.warning(note)
    return out, info.merged_note()


def convert_to_peft(src: str | Path, out_dir: str | Path, family: str | None = None,
                    base: str | None = None) -> dict:  # fmt: skip
    """``llm-foundry convert --to-peft RUN --out DIR``: the LoRA adapters of a fine-tuning run or
    checkpoint alone, in PEFT's format for the HF export of the base it was tuned from. The base
    adapter_config.json names (what ``AutoPeftModelForCausalLM`` loads) is ``base``, an HF
    directory of the run's architecture, else the run's train.init_from as recorded; a directory
    is named by its absolute path (``base_reference``). Returns
    what was written: the settings, the base named, whether transformers can load it
    (``base_is_hf``)."""
    from llm_foundry.checkpoint import load_checkpoint, read_lora
    from llm_foundry.interop.peft import base_reference, save_adapter
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
    if base is not None:
        _check_peft_base(base, model.cfg)
    else:  # the base it was tuned from, as the run recorded it (a step directory's run is two up)
        run = ckpt.parent.parent if ckpt.parent.name == CHECKPOINTS else None
        train = (read_run_info(run).get("train") or {}) if run else {}
        base = str(train.get("init_from") or "")
    base = base_reference(base)  # a directory as its absolute path, as the adapter records it
    with new_directory(out_dir) as tmp:
        save_adapter(model, tmp, family, base=base)
    return {"from": str(src), "to": str(out_dir), "lora": lora, "base": base,
            "base_is_hf": _is_hf_dir(base)}  # fmt: skip


def _is_hf_dir(path: str) -> bool:
    """Whether ``path`` is an HF transformers directory (config.json with a model_type)."""
    from llm_foundry.loading import checkpoint_kind

    try:
        return bool(path) and checkpoint_kind(Path(path))[0] == "hf"
    except (OSError, ValueError):
        return False


def _check_peft_base(base: str, cfg) -> None:
    """Refuse, in one line, a --peft-base that is not an HF directory of ``cfg``'s weights."""
    if not _is_hf_dir(base):
        raise ValueError(f"--peft-base {base}: not an HF transformers directory (config.json with "
                         "a model_type); give the base's `convert --to-hf` export")  # fmt: skip
    from llm_foundry.interop.hf import config_from_hf, transformers

    diff = cfg.weight_differences(config_from_hf(transformers.AutoConfig.from_pretrained(base)))
    if diff:
        raise ValueError(f"--peft-base {base} is another model than the adapters were trained on "
                         f"({'; '.join(diff[:3])})")  # fmt: skip


def convert_from_hf(src_dir: str | Path, out_ckpt: str | Path) -> Path:
    """``llm-foundry convert --from-hf DIR --out CKPT``: an HF checkpoint directory to our
    checkpoint format (``llm_foundry.checkpoint``), its tokenizer alongside with the files that
    carry its chat template and special tokens (``tokenizer_files``), read first so that one
    nothing can use is refused here; the model's special ids (its generation_config.json, else
    those of its config.json) kept with or without a tokenizer. Notes say what is left behind (a
    tokenizer other than tokenizer.json) and what grows (bf16/fp16 weights held as fp32).
    Returns CKPT."""
    from llm_foundry.checkpoint import save_checkpoint
    from llm_foundry.interop.hf import copy_tokenizer, from_hf
    from llm_foundry.interop.hf.files import stored_bytes
    from llm_foundry.loading import checkpoint_kind, refuse_adapter_dir
    from llm_foundry.outputs import check_new_output, new_directory
    from llm_foundry.tokenizer_files import GENERATION_CONFIG, copy_tokenizer_files, keep_config_ids

    src = Path(src_dir)
    refuse_adapter_dir(src, "--from-hf")
    if (src / "config.json").is_file() and checkpoint_kind(src)[0] == "llm-foundry":
        raise ValueError(f"{src} is an llm-foundry checkpoint already; --to-hf exports one")
    check_new_output(out_ckpt)
    _check_hf_tokenizer(src)
    model = from_hf(src)
    with new_directory(out_ckpt) as tmp:
        copy_tokenizer(src, save_checkpoint(model, tmp))
        copy_tokenizer_files(src, tmp, (GENERATION_CONFIG,))  # the model's own, tokenizer or not
        keep_config_ids(src, tmp)
        written = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
    left = [n for n in LEFT_BEHIND if (src / n).is_file()]
    if left and not (src / "tokenizer.json").is_file():
        log.warning(f"note: {src} has no tokenizer.json; {', '.join(left)} left behind "
                    f"(llm-foundry reads a tokenizer.json only): {out_ckpt} has no tokenizer. "
                    f"transformers writes one: AutoTokenizer.from_pretrained('{src}')"
                    f".save_pretrained('{src}'), then convert again")  # fmt: skip
    stored = stored_bytes(src)
    narrow = [d.lower() for d in stored if d in ("BF16", "F16")]
    if narrow:
        from llm_foundry.accounting import human

        before = sum(stored.values())
        log.warning(f"note: {src}'s {'/'.join(narrow)} weights are held as "
                    f"fp32 in {out_ckpt} ({human(before, 'B')} -> {human(written, 'B')}), as "
                    "llm-foundry checkpoints hold them; generate and eval read the HF directory "
                    "as fp32 too")  # fmt: skip
    return Path(out_ckpt)


# tokenizer files of HF models that only transformers reads (we read tokenizer.json)
LEFT_BEHIND = ("tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt")


def _check_hf_tokenizer(src: Path) -> None:
    """Refuse, in one line naming the file, an HF directory's tokenizer.json that Hugging Face
    tokenizers cannot read, or tokenizer files beside it that generate and --to-hf would refuse
    (a chat template that is not text, ...): before the weights are read."""
    from tokenizers import Tokenizer

    from llm_foundry.tokenizer_files import open_tokenizer

    file = src / "tokenizer.json"
    if not file.is_file():
        return
    try:
        Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own Exception, whatever is wrong
        raise ValueError(f"{file}: Hugging Face tokenizers cannot read it ({e}); give the "
                         "model's tokenizer.json as transformers saves it, or remove it") from None  # fmt: skip
    open_tokenizer(file)  # the files beside it: one-line errors naming the file


def convert_to_hf(ckpt_dir: str | Path, out_dir: str | Path, family: str | None = None) -> Path:
    """``llm-foundry convert --to-hf CKPT --out DIR``: our checkpoint directory to an HF one
    (``llm_foundry.rundir.checkpoint_dir`` finds a run directory's latest checkpoint), its
    tokenizer alongside with its metadata files (``tokenizer_files``): config.json's
    bos/eos/pad ids are those the files name, so transformers' generate stops where ours does;
    a LoRA checkpoint is written with its adapters merged (``load_checkpoint`` folds them).
    What the checkpoint does not carry (an HF tokenizer's eos, its chat template) is said in a
    note; a tokenizer.json that no reader reads is refused (``tokenizer_files.open_tokenizer``).
    Returns DIR."""
    from llm_foundry.checkpoint import load_checkpoint
    from llm_foundry.interop.hf import copy_tokenizer, name_special_tokens, to_hf
    from llm_foundry.loading import checkpoint_kind, refuse_quantized
    from llm_foundry.outputs import check_new_output, new_directory
    from llm_foundry.tokenizer_files import GENERATION_CONFIG, copy_tokenizer_files, open_tokenizer

    ckpt_dir = Path(ckpt_dir)
    refuse_quantized(ckpt_dir, checkpoint_kind(ckpt_dir)[1], "convert --to-hf")
    check_new_output(out_dir)
    model = load_checkpoint(ckpt_dir)
    with new_directory(out_dir) as tmp:
        file = ckpt_dir / "tokenizer.json"  # read once: an unreadable one is refused
        tok, carried = open_tokenizer(file) if file.is_file() else (None, None)
        ids = carried.ids if carried is not None else {}
        # without a tokenizer, the model's own ids (its generation_config.json) still travel
        to_hf(model, tmp, family, **(carried.hf_config_ids() if carried else _model_ids(ckpt_dir)))
        copy_tokenizer(ckpt_dir, tmp, tok)
        if tok is None:
            copy_tokenizer_files(ckpt_dir, tmp, (GENERATION_CONFIG,))
        name_special_tokens(tmp, tok, ids)
    if getattr(tok, "kind", "") == "hf":  # an HF tokenizer: what its files do not say is lost
        lost = [] if "eos" in ids else ["eos token (transformers' generate runs to max_new_tokens)"]
        if carried.template is None:
            lost.append("chat template (AutoTokenizer's chat_template is None)")
        if lost:
            log.warning(f"note: {ckpt_dir} names no {' and no '.join(lost)}: no such file or "
                        "field beside its tokenizer.json (tokenizer_config.json, "
                        "chat_template.jinja, generation_config.json)")  # fmt: skip
    return Path(out_dir)


def _model_ids(ckpt: Path) -> dict:
    """The special ids ``ckpt``'s configs name (``tokenizer_files.model_ids``) as HF config
    fields: ``eos_token_id`` a list where there are several."""
    from llm_foundry.tokenizer_files import ROLES, model_ids

    found = {f"{role}_token_id": model_ids(ckpt, role) for role in ROLES}
    return {key: ids[0] if len(ids) == 1 else ids for key, ids in found.items() if ids}
