"""``llm-foundry params``: parameters per component, FLOPs per token and KV-cache bytes."""

from __future__ import annotations

import json

from llm_foundry.cli.options import SettingsParser, add_settings_arguments, settings_from
from llm_foundry.presets import preset_names


def main(argv: list[str]) -> int:
    from llm_foundry.accounting import format_lora, format_report, lora_report, param_report

    p = SettingsParser(
        prog="llm-foundry params",
        description="Count parameters per component (built on the meta device: no memory), "
        "FLOPs per token and KV-cache bytes.",
    )
    add_settings_arguments(p, ("model",), f"architecture preset: {', '.join(preset_names())}")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--lora-r", type=int, default=0, metavar="R", help="add the LoRA view: rank R")
    p.add_argument(
        "--lora-targets", default="wq,wv", help="projections the adapters go on (with --lora-r)"
    )
    ns = p.parse_args(argv)
    settings = settings_from(ns, ("model",), extra_keys=("lora_r", "lora_targets"))
    rep = param_report(settings.model)
    if ns.lora_r:
        rep["lora"] = lora_report(settings.model, ns.lora_r, ns.lora_targets.split(","))
    if ns.json:
        print(json.dumps(rep, indent=2))
    else:
        title = f"preset {settings.preset}" if settings.preset else "custom config"
        print(format_report(rep, title=title))
        if ns.lora_r:
            print("\n" + format_lora(rep["lora"]))
    return 0
