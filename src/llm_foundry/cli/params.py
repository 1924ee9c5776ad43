"""``llm-foundry params``: parameters per component, FLOPs per token and KV-cache bytes."""

from __future__ import annotations

import json

from llm_foundry.cli.options import SettingsParser, add_settings_arguments, settings_from
from llm_foundry.presets import preset_names


def main(argv: list[str]) -> int:
    from llm_foundry.accounting import format_report, param_report

    p = SettingsParser(
        prog="llm-foundry params",
        description="Count parameters per component (built on the meta device: no memory), "
        "FLOPs per token and KV-cache bytes.",
    )
    add_settings_arguments(p, ("model",), f"architecture preset: {', '.join(preset_names())}")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    ns = p.parse_args(argv)
    settings = settings_from(ns, ("model",))
    rep = param_report(settings.model)
    if ns.json:
        print(json.dumps(rep, indent=2))
    else:
        title = f"preset {settings.preset}" if settings.preset else "custom config"
        print(format_report(rep, title=title))
    return 0
