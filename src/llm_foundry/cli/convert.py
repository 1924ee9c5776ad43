"""``llm-foundry convert``: HF transformers checkpoint directories to and from ours, any
checkpoint to one GGUF file that llama.cpp runs, and sharded (DCP) training checkpoints to and
from our safetensors ones."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str]) -> int:
    from llm_foundry.package import MissingExtra, absent, missing_extra

    try:  # --help and the dcp conversions work without the [hf] extra; HF work says what to install
        from llm_foundry.interop.hf import FAMILIES
    except MissingExtra:
        FAMILIES = None

    families = (
        ", ".join(f.title for f in FAMILIES.values())
        if FAMILIES is not None
        else "the families of the [hf] extra"
    )
    p = argparse.ArgumentParser(
        prog="llm-foundry convert",
        allow_abbrev=False,  # exact option names: a prefix could mean another option
        description=f"Convert between HF transformers checkpoint directories ({families}) and "
        "llm-foundry checkpoints, or write a checkpoint of the LLaMA, Mistral, Qwen3, GPT-2, "
        "Mixtral or Qwen3-MoE layouts as one GGUF file for llama.cpp (--to-gguf). A LoRA run "
        "is written with its adapters merged into the base; --to-peft writes its adapters alone. "
        "--from-dcp / --to-dcp turn a sharded checkpoint (train.checkpoint_format dcp) into "
        "safetensors files and back, optimizer and training state included.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="DIR", help="HF directory (config.json + safetensors)")
    src.add_argument(
        "--to-hf", metavar="DIR", help="llm-foundry checkpoint or run directory (its latest)"
    )
    src.add_argument(
        "--to-gguf",
        metavar="SRC",
        help="run directory, llm-foundry checkpoint or HF directory to write as one GGUF file",
    )
    src.add_argument(
        "--to-peft",
        metavar="RUN",
        help="LoRA run or checkpoint whose adapters to write alone, in PEFT's format",
    )
    src.add_argument(
        "--from-dcp",
        metavar="SRC",
        help="sharded (DCP) checkpoint, or a run whose latest checkpoint is one, to write as "
        "safetensors (a training checkpoint: optimizer and state too, resumable by any run)",
    )
    src.add_argument(
        "--to-dcp",
        metavar="SRC",
        help="llm-foundry checkpoint or run directory (its latest) to write as a sharded (DCP) "
        "checkpoint",
    )
    p.add_argument(
        "--out",
        required=True,
        help="new directory to write (--to-gguf: the new .gguf file); never over one that exists",
    )
    p.add_argument(
        "--family",
        choices=list(FAMILIES) if FAMILIES is not None else None,
        default=None,
        help="HF architecture for --to-hf and --to-peft (default: inferred from the config)"
        + ("" if FAMILIES is not None else "; the families need the [hf] extra"),
    )
    p.add_argument(
        "--outtype",
        default=None,
        metavar="TYPE",
        help="--to-gguf: type of the 2-D weights: f32 (default), f16, bf16, q8_0, q4_0 "
        "(norms and biases stay f32)",
    )
    p.add_argument(
        "--peft-base",
        metavar="HF_DIR",
        default=None,
        help="--to-peft: the HF directory adapter_config.json names as the base (what "
        "AutoPeftModelForCausalLM loads; default: the run's train.init_from)",
    )
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    ns = p.parse_args(argv)
    if ns.peft_base is not None and not ns.to_peft:
        raise ValueError(f"--peft-base {ns.peft_base} applies to --to-peft only")
    if ns.family is not None and not (ns.to_hf or ns.to_peft):
        raise ValueError(f"--family {ns.family} applies to --to-hf and --to-peft only (the other "
                         "conversions keep the architecture the source's config names)")  # fmt: skip
    if ns.outtype is not None and not ns.to_gguf:
        raise ValueError(f"--outtype {ns.outtype} applies to --to-gguf only")
    ns.outtype = ns.outtype or "f32"
    from llm_foundry.loading import checkpoint_kind
    from llm_foundry.rundir import checkpoint_dir

    if ns.from_dcp or ns.to_dcp:
        from llm_foundry.outputs import new_directory
        from llm_foundry.train.dcp import convertible, dcp_to_full, full_to_dcp

        given, to_dcp = ns.to_dcp or ns.from_dcp, bool(ns.to_dcp)
        ckpt = checkpoint_dir(given, "--to-dcp" if to_dcp else "--from-dcp")
        convertible(ckpt, to_dcp)
        with new_directory(ns.out) as tmp:
            (full_to_dcp if to_dcp else dcp_to_full)(ckpt, tmp)
        kind = "dcp" if to_dcp else "llm-foundry"
        what = {"from": given, "to": ns.out, "format": kind, "merged": None}
        what["files"] = sorted(f.name for f in Path(ns.out).iterdir())
        _say(what, f"wrote {'sharded (dcp)' if to_dcp else 'llm-foundry'} checkpoint to {ns.out}",
             ns.json)  # fmt: skip
        return 0
    if ns.to_gguf:
        try:
            import gguf  # noqa: F401
        except ImportError as e:
            if not absent(e, "gguf"):
                raise  # installed but broken: its own error
            raise missing_extra("convert --to-gguf needs the gguf package", "gguf") from None
        from llm_foundry.accounting import human
        from llm_foundry.export import convert_to_gguf

        out, merged = convert_to_gguf(ns.to_gguf, ns.out, ns.outtype)
        what = {"from": ns.to_gguf, "to": str(out), "format": "gguf", "outtype": ns.outtype}
        what["bytes"], what["merged"] = out.stat().st_size, merged
        text = f"wrote gguf {ns.outtype} file to {out} ({human(what['bytes'], 'B')})"
        _say(what, text, ns.json)
        return 0
    from llm_foundry.export import convert_from_hf, convert_to_hf, convert_to_peft

    if ns.to_peft:
        done = convert_to_peft(ns.to_peft, ns.out, ns.family, ns.peft_base)
        lora, kept = done["lora"], done["lora"].get("base_dtype", "fp32")
        base = f" for the base {done['base']}" if done["base"] else ""
        trained = f" (trained over the {kept}-rounded base)" if kept != "fp32" else ""
        text = (f"wrote the PEFT adapter (r={lora['r']}, {', '.join(lora['targets'])}) to "
                f"{done['to']}{base}{trained}")  # fmt: skip
        if not done["base_is_hf"]:  # AutoPeftModelForCausalLM would fail to load that base
            named = done["base"] or "no base"
            text += (f"\nnote: adapter_config.json's base_model_name_or_path is {named}, which "
                     "transformers cannot load: AutoPeftModelForCausalLM needs the base's HF "
                     f"export (convert --to-hf BASE --out HF_DIR), named by --peft-base HF_DIR; "
                     f"or load it yourself: PeftModel.from_pretrained(model, '{done['to']}')")  # fmt: skip
        what = {**done, "format": "peft", "merged": None}
    elif ns.from_hf:
        out = convert_from_hf(ns.from_hf, ns.out)
        what = {"from": ns.from_hf, "to": str(out), "format": "llm-foundry", "merged": None}
        text = f"wrote llm-foundry checkpoint to {out}"
    else:
        from llm_foundry.rundir import read_checkpoint

        def to_hf(ckpt: Path) -> tuple[dict, Path]:
            kind, meta = checkpoint_kind(ckpt)
            if kind == "hf":
                raise ValueError(f"--to-hf {ckpt} is an HF transformers directory already")
            return meta, convert_to_hf(ckpt, ns.out, ns.family)

        # a run directory means its latest checkpoint, read again if a training run replaces it
        meta, out = read_checkpoint(ns.to_hf, to_hf, "--to-hf")
        from llm_foundry.models.lora import describe_merge

        merged = describe_merge(meta["lora"]) if meta.get("lora") else None
        what = {"from": ns.to_hf, "to": str(out), "format": "hf", "merged": merged}
        text = f"wrote hf checkpoint to {out}"
    what["files"] = sorted(f.name for f in Path(what["to"]).iterdir())
    _say(what, text, ns.json)
    return 0


def _say(what: dict, text: str, as_json: bool) -> None:
    """What was written: JSON, or the line (after the one saying what was merged, if any)."""
    if as_json:
        print(json.dumps(what, indent=2))
        return
    if what.get("merged"):
        print(what["merged"])
    print(text)
