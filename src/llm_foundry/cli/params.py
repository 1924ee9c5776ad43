"""``llm-foundry params``: parameters per component, FLOPs per token and KV-cache bytes; with
``--memory N``, training memory per device under DDP, FSDP, TP and FSDP+TP."""

from __future__ import annotations

import json

from llm_foundry.cli.options import SettingsParser, add_settings_arguments, settings_from
from llm_foundry.presets import preset_names


def default_tp(cfg, devices: int) -> int:
    """2 where DEVICES and the heads split 2 ways, else 1 (Falcon-7B's 71 heads split no way)."""
    from llm_foundry.train.memory import check_tp_degree

    try:
        check_tp_degree(cfg, 2)
    except ValueError:
        return 1
    return 2 if devices % 2 == 0 else 1


def main(argv: list[str]) -> int:
    from llm_foundry.accounting import format_lora, format_report, lora_report, param_report
    from llm_foundry.train.memory import format_memory, memory_report

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
    p.add_argument(
        "--memory",
        type=int,
        default=None,
        metavar="DEVICES",
        help="add training memory per device on DEVICES devices: ddp, fsdp, tp (all DEVICES in "
        "one TP group) and fsdp+tp",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="T",
        help="TP degree of the fsdp+tp mesh, (DEVICES/T) x T (default 2 where it fits, else 1)",
    )
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    p.add_argument(
        "--dtype", choices=("fp32", "bf16"), default="fp32", help="train.dtype (bf16: autocast)"
    )
    p.add_argument("--batch-size", type=int, default=1, metavar="B", help="micro-batch per device")
    p.add_argument("--seq-len", type=int, default=None, metavar="S", help="default max_seq_len")
    p.add_argument(
        "--activation-checkpointing", action="store_true", help="recompute each block in backward"
    )
    ns = p.parse_args(argv)
    settings = settings_from(ns, ("model",), extra_keys=("lora_r", "lora_targets"))
    rep = param_report(settings.model)
    if ns.lora_r:
        rep["lora"] = lora_report(settings.model, ns.lora_r, ns.lora_targets.split(","))
    if ns.memory is not None:
        tp = ns.tp if ns.tp is not None else default_tp(settings.model, ns.memory)
        rep["memory"] = memory_report(
            settings.model,
            ns.memory,
            tp,
            optimizer=ns.optimizer,
            dtype=ns.dtype,
            batch_size=ns.batch_size,
            seq_len=ns.seq_len,
            activation_checkpointing=ns.activation_checkpointing,
        )
    elif ns.tp is not None:
        raise ValueError("--tp needs --memory DEVICES")
    if ns.json:
        print(json.dumps(rep, indent=2))
    else:
        title = f"preset {settings.preset}" if settings.preset else "custom config"
        print(format_report(rep, title=title))
        if ns.lora_r:
            print("\n" + format_lora(rep["lora"]))
        if ns.memory is not None:
            print("\n" + format_memory(rep["memory"]))
    return 0
