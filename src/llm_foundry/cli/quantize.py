"""``llm-foundry quantize``: a checkpoint with int8 or int4 weights for CPU decoding."""

from __future__ import annotations

import argparse
import json


def main(argv: list[str]) -> int:
    from llm_foundry.models.quant import GROUP_SIZES, SCHEMES

    p = argparse.ArgumentParser(
        prog="llm-foundry quantize",
        allow_abbrev=False,  # exact option names: a prefix could mean another option
        description="Write a copy of a model with weight-only int8 (one scale per output channel) "
        "or int4 (groups of --group-size inputs) projections; activations stay floating point. "
        "generate, eval and serve read the result like any checkpoint.",
    )
    p.add_argument(
        "--checkpoint", required=True, help="training run, llm-foundry checkpoint or HF directory"
    )
    p.add_argument("--adapter", default=None, metavar="DIR", help="a LoRA adapter to merge into "
                   "the model first: a PEFT adapter directory, or a LoRA run of ours")  # fmt: skip
    p.add_argument("--to", required=True, choices=list(SCHEMES), help="weight format")
    p.add_argument("--group-size", type=int, default=None, choices=GROUP_SIZES,
                   help="--to int4: inputs per scale and zero (default 64)")  # fmt: skip
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    ns = p.parse_args(argv)
    from llm_foundry.accounting import human
    from llm_foundry.cli.options import quantize_choice
    from llm_foundry.quantize import quantize_checkpoint

    scheme, group = quantize_choice(ns.to, ns.group_size, "--to")
    done = quantize_checkpoint(ns.checkpoint, ns.out, scheme, group, adapter=ns.adapter)
    if ns.json:
        print(json.dumps(done, indent=2))
        return 0
    if done["merged"]:
        print(done["merged"])
    b = done["weight_bytes_per_token"]
    group = f" (groups of {done['group_size']})" if "group_size" in done else ""
    print(
        f"wrote {done['scheme']}{group} checkpoint to {done['to']}: {len(done['layers'])} "
        f"projections quantized, weights read per token {human(b['before'], 'B')} -> "
        f"{human(b['after'], 'B')} ({b['before'] / b['after']:.2f}x less)"
    )
    if done["kept_fp32"]:
        print(f"kept in fp32 (shape the kernel does not take): {', '.join(done['kept_fp32'])}")
    return 0
