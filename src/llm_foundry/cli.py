"""The ``llm-foundry`` command line: one sub-command per job, each a small function.

Model settings come from ``--preset NAME``, then ``--config FILE`` (YAML/JSON with a ``model:``
section), then dotted overrides such as ``--model.n_kv_heads 2``; later sources win.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from jsonargparse import ActionConfigFile, ArgumentParser

from llm_foundry.config import ConfigError, ModelConfig
from llm_foundry.presets import get_preset, preset_names


def _preset_prefix(argv: list[str], default: str | None) -> str | None:
    """Read ``--preset`` before the full parse: it sets the defaults the other flags override."""
    pre = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    pre.add_argument("--preset", default=default)
    try:
        known, _ = pre.parse_known_args(argv)
    except argparse.ArgumentError:  # e.g. --preset without a value: the full parse says so
        return default
    return known.preset


def model_parser(
    prog: str, description: str, default_preset: str | None, base: ModelConfig
) -> ArgumentParser:
    """A parser with ``--preset``, ``--config`` and every ``--model.FIELD`` override."""
    p = ArgumentParser(prog=f"llm-foundry {prog}", description=description, exit_on_error=False)
    p.add_argument(
        "--preset",
        default=default_preset,
        help=f"architecture preset: {', '.join(preset_names())}",
    )
    p.add_argument("--config", action=ActionConfigFile, help="YAML/JSON file with a model: section")
    p.add_argument(
        "--model", type=ModelConfig, default=base, help="model settings (dotted overrides)"
    )
    return p


def parse_model_args(
    prog: str,
    description: str,
    argv: list[str],
    default_preset: str | None,
    extra=None,
    base: ModelConfig | None = None,
    train_section: bool = False,
):
    """Parse ``argv`` into (namespace, ModelConfig) with preset < config file < overrides;
    ``base`` (a resumed run's saved model) replaces the default preset unless --preset is given.
    Unless ``train_section`` (``extra`` adds --train), a --config file's train: section is read
    and left unused, so one file serves every command."""
    name = _preset_prefix(argv, None if base else default_preset)
    base = get_preset(name) if name else base or ModelConfig()
    p = model_parser(prog, description, default_preset, base)
    if extra:
        extra(p)
    if not train_section:
        p.add_argument("--train", type=dict, default=None, help="a --config file's train: (unused)")
    ns = p.parse_args(_join_negative_values(argv))
    model = ns.model
    if not isinstance(model, ModelConfig) and not hasattr(model, "items"):
        raise ConfigError([f"the model section must be a mapping of fields, got {model!r}"])
    fields = dict(model) if not isinstance(model, ModelConfig) else model.to_dict()
    # the changes to the base, applied by ModelConfig.replace (which keeps an MHA base MHA);
    # n_kv_heads counts as a change whenever it is named, even at the base's value
    changes = {k: v for k, v in fields.items() if v != getattr(base, k)}
    if "n_kv_heads" in _given_text(argv):
        changes["n_kv_heads"] = fields["n_kv_heads"]
    return ns, base.replace(**changes)


def _given_text(argv: list[str]) -> str:
    """The command line and the text of every --config file in it (to see what was set)."""
    files = [b for a, b in zip(argv, argv[1:], strict=False) if a == "--config"]
    files += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    texts = [Path(f).read_text() for f in files if Path(f).is_file()]
    return " ".join(argv + texts)


# ----------------------------------------------------------------------------------------------
def cmd_params(argv: list[str]) -> int:
    from llm_foundry.accounting import format_report, param_report

    def extra(p):
        p.add_argument("--json", action="store_true", help="print the report as JSON")

    ns, cfg = parse_model_args(
        "params",
        "Count parameters per component (built on the meta device: no memory), FLOPs per token "
        "and KV-cache bytes.",
        argv,
        None,
        extra,
    )
    rep = param_report(cfg)
    if ns.json:
        print(json.dumps(rep, indent=2))
    else:
        title = f"preset {ns.preset}" if ns.preset else "custom config"
        print(format_report(rep, title=title))
    return 0


def cmd_prepare(argv: list[str]) -> int:
    from llm_foundry.data import DATASETS, prepare
    from llm_foundry.tokenizer import TOKENIZER_KINDS

    p = argparse.ArgumentParser(
        prog="llm-foundry prepare",
        description="Tokenize a corpus into train.bin/val.bin (uint16 or uint32 memmaps), "
        "tokenizer.json and meta.json.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", choices=DATASETS, help="a known corpus (fetched and cached)")
    src.add_argument("--text", nargs="+", metavar="FILE", help="your own UTF-8 text files")
    p.add_argument("--tokenizer", choices=TOKENIZER_KINDS, default="char")
    p.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size")
    p.add_argument("--val-fraction", type=float, default=0.1, help="last fraction kept for val")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--json", action="store_true", help="print meta.json")
    ns = p.parse_args(argv)
    meta = prepare(
        ns.out,
        dataset=ns.dataset,
        text_files=ns.text,
        tokenizer=ns.tokenizer,
        vocab_size=ns.vocab_size,
        val_fraction=ns.val_fraction,
    )
    if ns.json:
        print(json.dumps(meta, indent=2))
    else:
        print(
            f"wrote {ns.out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
            f"({meta['dtype']}), {meta['tokenizer']} tokenizer with {meta['vocab_size']:,} "
            f"entries; source {meta['source']}"
        )
    return 0


DEFAULT_DATA = "data/shakespeare_char"
DEFAULT_PRESET = "llama-shakespeare-char"


def _run_dir_args(argv: list[str]) -> tuple[str | None, bool]:
    """``--out`` and ``--resume`` as the full parse will see them: from the command line, else
    from a ``--config`` file's top level (read now: they decide what the parse starts from)."""
    from llm_foundry.config import load_yaml

    pre = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    pre.add_argument("--resume", action="store_true", default=None)
    pre.add_argument("--out")
    pre.add_argument("--config", action="append", default=[])
    try:
        known, _ = pre.parse_known_args(argv)
    except argparse.ArgumentError:  # e.g. --out without a value: the full parse says so
        return None, False
    out, resume = known.out, known.resume
    for file in known.config:
        if not Path(file).is_file():
            continue  # the full parse names the missing file
        conf = load_yaml(Path(file).read_text())
        if isinstance(conf, dict):
            out = out if out is not None else conf.get("out")
            resume = resume if resume is not None else conf.get("resume")
    return (None if out is None else str(out)), bool(resume)


def _saved_run(out: str | None, resume: bool) -> tuple[ModelConfig, object, str] | None:
    """With ``--resume --out RUN_DIR``: the model config, training config and data directory
    that RUN_DIR's latest checkpoint was trained with (None when there is no checkpoint)."""
    from llm_foundry.train.config import TrainConfig
    from llm_foundry.train.state import latest_checkpoint, read_state

    ckpt = latest_checkpoint(Path(out) / "checkpoints") if resume and out else None
    if ckpt is None:
        return None
    state = read_state(ckpt)
    run_info = Path(out) / "run.json"
    data = json.loads(run_info.read_text())["data"]["dir"] if run_info.exists() else DEFAULT_DATA
    model = ModelConfig.from_dict(state["model_config"])
    return model, TrainConfig.from_dict(state["train_config"]), data


def _join_negative_values(argv: list[str]) -> list[str]:
    """``--train.lr -1e-3`` as ``--train.lr=-1e-3``: argparse takes a token starting with '-' for
    a flag unless it looks like a plain integer or decimal, so '-1e-3' would lose its flag."""
    out: list[str] = []
    for arg in argv:
        prev = out[-1] if out else ""
        if prev.startswith("--") and "=" not in prev and _is_negative_number(arg):
            out[-1] = f"{prev}={arg}"
        else:
            out.append(arg)
    return out


def _is_negative_number(text: str) -> bool:
    if not text.startswith("-") or text.startswith("--"):
        return False
    try:
        float(text)
    except ValueError:
        return False
    return True


def cmd_train(argv: list[str]) -> int:
    import time

    from llm_foundry import lock
    from llm_foundry.train.config import TrainConfig
    from llm_foundry.train.state import latest_checkpoint

    given_out, given_resume = _run_dir_args(argv)
    if given_out is not None and Path(given_out).exists() and not Path(given_out).is_dir():
        raise ValueError(
            f"--out {given_out} exists and is not a directory (a file or a device); give a run "
            "directory"
        )
    # a resumed run starts from its own saved settings; flags given now override them
    saved = _saved_run(given_out, given_resume)
    model_base, train_base, data_base = saved or (None, TrainConfig(), DEFAULT_DATA)

    def extra(p):
        p.add_argument("--train", type=TrainConfig, default=train_base, help="training settings")
        p.add_argument("--data", default=data_base, help="directory written by `prepare`")
        p.add_argument("--out", default=None, help="run directory (default runs/NAME-TIME)")
        p.add_argument(
            "--resume",
            action="store_true",
            help="continue RUN_DIR from its latest checkpoint, with the model, training settings "
            "and data it was started with (flags given now override training settings)",
        )

    ns, cfg = parse_model_args(
        "train",
        "Train a model. With no arguments: prepare tiny Shakespeare (character level) if needed, "
        f"train the {DEFAULT_PRESET} preset and print a sample.",
        argv,
        DEFAULT_PRESET,
        extra,
        base=model_base,
        train_section=True,
    )
    train_cfg = _dataclass_from(TrainConfig, ns.train)
    if ns.resume and ns.out is None:
        raise ValueError("--resume needs --out RUN_DIR (the run to continue)")
    if ns.out is not None and not ns.out.strip():
        raise ValueError("--out is empty: give a run directory")
    out = Path(ns.out or f"runs/{ns.preset or 'custom'}-{time.strftime('%Y%m%d-%H%M%S')}")
    if ns.resume and saved is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {out / 'checkpoints'} to continue")
    # rank 0 owns the run directory (the ranks of one torchrun write it together)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    with lock.hold(out, "run directory") if rank0 else contextlib.nullcontext():
        if not ns.resume and latest_checkpoint(out / "checkpoints") is not None:
            raise ValueError(
                f"--out {out} already holds a run with checkpoints: continue it with --resume, "
                "or pass another --out"
            )
        data = Path(ns.data)
        if ns.data == DEFAULT_DATA and not (data / "meta.json").exists():
            _prepare_default(data)
        from llm_foundry.train.run import train_and_report

        try:
            train_and_report(cfg, train_cfg, data, out, resume=ns.resume)
        finally:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    return 0


def _prepare_default(data: Path, wait_s: float = 600.0) -> None:
    """Prepare the default corpus; under torchrun rank 0 prepares and the others wait for it."""
    import time

    if int(os.environ.get("RANK", "0")) > 0:
        deadline = time.monotonic() + wait_s
        while not (data / "meta.json").exists():
            if time.monotonic() > deadline:
                raise FileNotFoundError(f"rank 0 did not finish preparing {data} in {wait_s:.0f} s")
            time.sleep(1.0)
        return
    from llm_foundry.data import prepare

    print(f"preparing the default corpus (tiny Shakespeare, characters) in {data}")
    prepare(data, dataset="shakespeare", tokenizer="char")


def cmd_convert(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="llm-foundry convert",
        description="Convert between HF transformers checkpoint directories (Llama, Mistral, "
        "Qwen3, GPT-2 families) and llm-foundry checkpoints.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="DIR", help="HF directory (config.json + safetensors)")
    src.add_argument("--to-hf", metavar="CKPT", help="llm-foundry checkpoint directory")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument(
        "--family",
        choices=["llama", "mistral", "qwen3", "gpt2"],
        default=None,
        help="HF architecture for --to-hf (default: inferred from the config)",
    )
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    ns = p.parse_args(argv)
    from llm_foundry.interop.hf import convert_from_hf, convert_to_hf

    if ns.from_hf:
        out = convert_from_hf(ns.from_hf, ns.out)
        what = {"from": ns.from_hf, "to": str(out), "format": "llm-foundry"}
    else:
        out = convert_to_hf(ns.to_hf, ns.out, ns.family)
        what = {"from": ns.to_hf, "to": str(out), "format": "hf"}
    what["files"] = sorted(f.name for f in Path(out).iterdir())
    print(json.dumps(what, indent=2) if ns.json else f"wrote {what['format']} checkpoint to {out}")
    return 0


def _dataclass_from(cls, value):
    """jsonargparse hands back a Namespace for dataclass arguments: build (and validate) it."""
    if isinstance(value, cls):
        return value
    return cls.from_dict(dict(value))


def _generate(argv: list[str]) -> int:
    from llm_foundry import generate_cli

    return generate_cli.main(argv)


def _inspect(argv: list[str]) -> int:
    from llm_foundry import inspection

    return inspection.main(argv)


def _eval(argv: list[str]) -> int:
    from llm_foundry import evaluate

    return evaluate.main(argv)


def _ablate(argv: list[str]) -> int:
    from llm_foundry import ablation

    return ablation.main(argv)


def _bench(argv: list[str]) -> int:
    usage = (
        "usage: llm-foundry bench attention [options]  (options: llm-foundry bench attention -h)"
    )
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if not argv or argv[0] != "attention":
        print(usage, file=sys.stderr)
        return 2
    from llm_foundry import attention_bench

    return attention_bench.main(argv[1:], prog="llm-foundry bench attention")


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "prepare": (cmd_prepare, "tokenize a corpus into train/val token files"),
    "train": (cmd_train, "train a model (no arguments: the Shakespeare demo)"),
    "generate": (_generate, "generate text from a checkpoint, training run or HF directory"),
    "eval": (_eval, "loss and perplexity per context length"),
    "convert": (cmd_convert, "convert checkpoints to and from HF transformers"),
    "inspect": (
        _inspect,
        "PNG plots: lr schedule, attention, RoPE, sinusoidal, ALiBi, training dynamics",
    ),
    "params": (cmd_params, "parameter, FLOP and KV-cache accounting for a config"),
    "ablate": (_ablate, "train variants under one budget and compare them in one table"),
    "bench": (_bench, "benchmarks: `bench attention` (manual vs SDPA time and memory)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: llm-foundry COMMAND [options]\n\ncommands:\n" + "\n".join(
        f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"llm-foundry: unknown command {name!r}\n\n{usage}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[name][0](rest) or 0
    except argparse.ArgumentError as e:  # jsonargparse: unknown flag, or a value of a wrong type
        print(f"llm-foundry {name}: error: {e}{_flag_hint(str(e))}", file=sys.stderr)
        return 2
    except (ConfigError, KeyError, ValueError, OSError) as e:  # OSError: a file in the way, ...
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"llm-foundry {name}: error: {msg}", file=sys.stderr)
        return 2
    except _run_stops() as e:
        print(f"llm-foundry {name}: {e}", file=sys.stderr)
        return 1


def _run_stops() -> tuple[type[Exception], ...]:
    """Errors that end a run with a message saying what to do (imported once one is raised)."""
    from llm_foundry.lock import DirectoryBusy
    from llm_foundry.train.trainer import TrainingDiverged

    return (TrainingDiverged, DirectoryBusy)


def _flag_hint(message: str) -> str:
    """' (did you mean --model.n_layers?)' for a mistyped --model.FIELD / --train.FIELD."""
    import dataclasses
    import difflib
    import re

    from llm_foundry.train.config import TrainConfig

    m = re.search(r"--(model|train)\.(\w+)", message)
    if not m:
        return ""
    cls = ModelConfig if m.group(1) == "model" else TrainConfig
    close = difflib.get_close_matches(m.group(2), [f.name for f in dataclasses.fields(cls)], n=1)
    return f" (did you mean --{m.group(1)}.{close[0]}?)" if close and close[0] != m.group(2) else ""


if __name__ == "__main__":
    sys.exit(main())
