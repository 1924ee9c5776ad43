"""``llm-foundry convert``: HF transformers checkpoint directories to and from ours, and any
checkpoint to one GGUF file that llama.cpp runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str]) -> int:
    from llm_foundry.interop.hf import FAMILIES, convert_from_hf, convert_to_hf

    p = argparse.ArgumentParser(
        prog="llm-foundry convert",
        description="Convert between HF transformers checkpoint directories (Llama, Mistral, "
        "Qwen3, GPT-2, Mixtral, Qwen3-MoE families) and llm-foundry checkpoints, or write a "
        "checkpoint of those families as one GGUF file for llama.cpp (--to-gguf).",
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
    p.add_argument("--out", required=True, help="directory to write (--to-gguf: the .gguf file)")
    p.add_argument(
        "--family",
        choices=list(FAMILIES),
        default=None,
        help="HF architecture for --to-hf (default: inferred from the config)",
    )
    p.add_argument(
        "--outtype",
        default=None,
        metavar="TYPE",
        help="--to-gguf: type of the 2-D weights: f32 (default), f16, bf16, q8_0, q4_0 "
        "(norms and biases stay f32)",
    )
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    ns = p.parse_args(argv)
    if ns.outtype is not None and not ns.to_gguf:
        raise ValueError(f"--outtype {ns.outtype} applies to --to-gguf only")
    ns.outtype = ns.outtype or "f32"
    from llm_foundry.rundir import checkpoint_dir, checkpoint_kind

    if ns.to_gguf:
        try:
            import gguf  # noqa: F401
        except ImportError:
            from llm_foundry.package import install_line

            raise SystemExit(
                f"convert --to-gguf needs the gguf package: {install_line('gguf')}"
            ) from None
        from llm_foundry.export import convert_to_gguf

        out = convert_to_gguf(ns.to_gguf, ns.out, ns.outtype)
        what = {"from": ns.to_gguf, "to": str(out), "format": "gguf", "outtype": ns.outtype}
        what["bytes"] = out.stat().st_size
        text = f"wrote gguf {ns.outtype} file to {out} ({what['bytes'] / 2**20:.1f} MiB)"
        print(json.dumps(what, indent=2) if ns.json else text)
        return 0
    if ns.from_hf:
        out = convert_from_hf(ns.from_hf, ns.out)
        what = {"from": ns.from_hf, "to": str(out), "format": "llm-foundry"}
    else:
        ckpt = checkpoint_dir(ns.to_hf, "--to-hf")  # a run directory means its latest checkpoint
        if checkpoint_kind(ckpt)[0] == "hf":
            raise ValueError(f"--to-hf {ckpt} is an HF transformers directory already")
        out = convert_to_hf(ckpt, ns.out, ns.family)
        what = {"from": ns.to_hf, "to": str(out), "format": "hf"}
    what["files"] = sorted(f.name for f in Path(out).iterdir())
    print(json.dumps(what, indent=2) if ns.json else f"wrote {what['format']} checkpoint to {out}")
    return 0
