"""``llm-foundry params``: parameters per component, FLOPs per token and KV-cache bytes; with
``--memory N``, training memory per device under DDP, FSDP, TP and FSDP+TP."""

from __future__ import annotations

import json
import sys

from llm_foundry.cli.options import (
    SettingsParser,
    add_settings_arguments,
    at_least_one,
    settings_from,
)
from llm_foundry.presets import preset_names


def default_tp(cfg, devices: int) -> int:
    """2 where DEVICES and the heads split 2 ways, else 1 (Falcon-7B's 71 heads split no way)."""
    from llm_foundry.train.memory import check_tp_degree

    try:
        check_tp_degree(cfg, 2)
    except ValueError:
        return 1
    return 2 if devices % 2 == 0 else 1


# what only the --memory table uses, with its default: refused without --memory, not ignored
MEMORY_FLAGS = {
    "tp": None,
    "optimizer": "adamw",
    "dtype": "fp32",
    "batch_size": 1,
    "activation_checkpointing": False,
}


def _take_recipe(ns, train: dict) -> None:
    """Fill the memory table's flags left unset from a --config file's ``train`` section (its
    batch, precision, optimizer, recomputation and block size), so the table is the recipe's.
    ``dtype: auto`` is taken as bf16: what it picks on a GPU with native bf16."""
    for key in ("batch_size", "optimizer", "activation_checkpointing"):
        if getattr(ns, key) is None and key in train:
            setattr(ns, key, train[key])
    if ns.dtype is None and "dtype" in train:
        ns.dtype = "bf16" if train["dtype"] == "auto" else train["dtype"]
    if ns.seq_len is None and "block_size" in train:
        ns.seq_len = train["block_size"]


def check_seq_len(cfg, seq_len: int) -> str | None:
    """A note when ``--seq-len`` runs past ``model.max_seq_len`` on positions without a weight
    per position (the figures are those of the model with its context raised to it); refused
    (one line) for learned positions, which have no row past it."""
    if seq_len <= cfg.max_seq_len:
        return None
    from llm_foundry.models.position import position_traits

    past = f"--seq-len {seq_len} is past model.max_seq_len={cfg.max_seq_len}"
    if position_traits(cfg).trained_rows:
        raise ValueError(
            f"{past} and learned positions have no row beyond it: give 1..{cfg.max_seq_len} "
            "or raise --model.max_seq_len"
        )
    return (
        f"note: {past}: counted as with --model.max_seq_len {seq_len} ({cfg.pos_encoding} "
        "positions have no weight per position; training needs that flag)"
    )


def check_tp(devices: int, tp: int) -> None:
    """Refuse (one line) a ``--tp`` that does not divide ``--memory``, naming the ones that do."""
    from llm_foundry.train.memory import tp_degrees

    if devices % tp:
        valid = ", ".join(map(str, tp_degrees(devices)))
        raise ValueError(
            f"--tp {tp} must divide --memory {devices} (the fsdp+tp mesh is "
            f"(DEVICES/T) x T): give one of {valid}"
        )


def _checkpoint_config(ns) -> tuple[object, str] | None:
    """(ModelConfig, where it came from) of ``--checkpoint DIR``, or of a ``--config`` file that is
    a checkpoint's or an HF model's config.json (taken out of ``ns.config``: the settings files
    are the others); None when neither is given. Read by ``loading.read_model_config``."""
    from pathlib import Path

    from llm_foundry.loading import checkpoint_kind, read_model_config

    given = [(ns.checkpoint, "--checkpoint")] if ns.checkpoint else []
    for file in list(ns.config):
        path = Path(file)
        if path.name != "config.json" or not path.is_file():
            continue
        try:
            checkpoint_kind(path.parent)
        except ValueError:
            continue  # a settings file after all: its own reader names what is wrong
        ns.config.remove(file)
        given.append((str(path.parent), f"--config {file}"))
    if not given:
        return None
    if len(given) > 1 or ns.preset:
        named = [flag for _, flag in given] + ([f"--preset {ns.preset}"] if ns.preset else [])
        raise ValueError(f"{' and '.join(named)}: give one model (a preset, a checkpoint or a "
                         "model's config.json)")  # fmt: skip
    where, flag = given[0]
    return read_model_config(where, flag.split()[0]), where


def main(argv: list[str]) -> int:
    from llm_foundry.accounting import format_lora, format_report, lora_report, param_report
    from llm_foundry.train.memory import format_memory, memory_report

    p = SettingsParser(
        prog="llm-foundry params",
        description="Count parameters per component (built on the meta device: no memory), "
        "FLOPs per token and KV-cache bytes.",
    )
    add_settings_arguments(p, ("model",), f"architecture preset: {', '.join(preset_names())}")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="count a model you have: a run, one of our checkpoints or an HF directory "
                   "(its config.json alone is read; --config DIR/config.json does the same)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--lora-r", type=at_least_one, default=None, metavar="R",
                   help="add the LoRA view: rank R")  # fmt: skip
    p.add_argument("--lora-targets", default=None,
                   help="projections the adapters go on (with --lora-r; default wq,wv)")  # fmt: skip
    p.add_argument(
        "--seq-len",
        type=at_least_one,
        default=None,
        metavar="S",
        help="context of the FLOPs, KV-cache and memory figures (default max_seq_len)",
    )
    p.add_argument(
        "--memory",
        type=at_least_one,
        default=None,
        metavar="DEVICES",
        help="add training memory per device on DEVICES devices: ddp, fsdp, tp (all DEVICES in "
        "one TP group) and fsdp+tp; the flags below apply to it",
    )
    p.add_argument(
        "--tp",
        type=at_least_one,
        default=None,
        metavar="T",
        help="TP degree of the fsdp+tp mesh, (DEVICES/T) x T (default 2 where it fits, else 1)",
    )
    p.add_argument("--optimizer", choices=("adamw", "muon"), default=None, help="default adamw")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help="train.dtype (bf16: autocast; default fp32)")  # fmt: skip
    p.add_argument("--batch-size", type=at_least_one, default=None, metavar="B",
                   help="micro-batch per device (default 1)")  # fmt: skip
    p.add_argument("--activation-checkpointing", action="store_true", default=None,
                   help="recompute each block in backward")  # fmt: skip
    ns = p.parse_args(argv)
    if ns.memory is None:
        given = [k for k in MEMORY_FLAGS if getattr(ns, k) is not None]
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            verb, them = ("needs", "it") if len(given) == 1 else ("need", "them")
            raise ValueError(f"{flags} {verb} --memory DEVICES (only the memory table uses {them})")
    if ns.memory is not None and ns.tp is not None:
        check_tp(ns.memory, ns.tp)
    targets_flag = ns.lora_targets
    from_checkpoint = _checkpoint_config(ns)
    base = from_checkpoint[0] if from_checkpoint else None
    settings = settings_from(ns, ("model",), base, extra_keys=("lora_r", "lora_targets"))
    if ns.memory is not None:  # a --config recipe's training settings, where no flag is given
        _take_recipe(ns, settings.given.get("train", {}))
    for key, default in MEMORY_FLAGS.items():
        if getattr(ns, key) is None:
            setattr(ns, key, default)
    if targets_flag is not None and not ns.lora_r:
        raise ValueError(f"--lora-targets {targets_flag} needs --lora-r R (the LoRA view)")
    cfg = settings.model
    if ns.seq_len is not None and (note := check_seq_len(cfg, ns.seq_len)):
        print(note, file=sys.stderr)
    rep = param_report(cfg, ns.seq_len)
    if ns.lora_r:
        rep["lora"] = lora_report(cfg, ns.lora_r, (ns.lora_targets or "wq,wv").split(","))
    if ns.memory is not None:
        tp = ns.tp if ns.tp is not None else default_tp(cfg, ns.memory)
        rep["memory"] = memory_report(
            cfg,
            ns.memory,
            tp,
            optimizer=ns.optimizer,
            dtype=ns.dtype,
            batch_size=ns.batch_size,
            seq_len=ns.seq_len,
            activation_checkpointing=ns.activation_checkpointing,
        )
    if ns.json:
        print(json.dumps(rep, indent=2))
    else:
        title = f"preset {settings.preset}" if settings.preset else "custom config"
        title = f"model of {from_checkpoint[1]}" if from_checkpoint else title
        print(format_report(rep, title=title))
        if ns.lora_r:
            print("\n" + format_lora(rep["lora"]))
        if ns.memory is not None:
            print("\n" + format_memory(rep["memory"]))
    return 0
