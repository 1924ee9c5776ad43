"""``llm-foundry finetune``: a training run that starts from a checkpoint's weights (optionally
training LoRA adapters only), on plain text or supervised fine-tuning data, or (``--task dpo``)
on preference pairs.

``--task dpo --data ROWS`` takes preference rows (a JSONL file, or a shipped task such as
``shakespeare_prefer_next_line``), tokenizes them with the checkpoint's tokenizer into
``OUT/data`` and trains with ``train.task=dpo`` (train/dpo.py); a directory already prepared
is used as it is. The settings are resolved and checked first, as ``train`` will (a bad
``--train.dpo_beta`` is refused before any row is read). At the end the rewards are plotted in
``OUT/rewards.png``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from llm_foundry.cli.train import default_out, rank0_prepares, refuse_data_out
from llm_foundry.cli.train import main as train_main

TASKS = ("lm", "dpo")
DATA_DIR = "data"  # where in the run directory --task dpo prepares its rows


def _pre_parser() -> argparse.ArgumentParser:
    """The flags this command reads before the training command parses all of them."""
    p = argparse.ArgumentParser(prog="llm-foundry finetune", add_help=False, allow_abbrev=False,
                                usage="%(prog)s [--task {lm,dpo}] ... (--help lists every flag)")  # fmt: skip
    p.add_argument("--task", choices=TASKS, default=None)
    for flag in ("--data", "--out", "--checkpoint"):
        p.add_argument(flag, default=None)
    p.add_argument("--resume", action="store_true")
    return p


def preference_rows(data: str) -> Path | None:
    """The JSONL rows ``--data`` names (a shipped preference task's file, or a file), or None
    for a directory (prepared already)."""
    from llm_foundry.tasks import PREFERENCE_TASKS, TASKS_DIR

    if data in PREFERENCE_TASKS:
        return TASKS_DIR / PREFERENCE_TASKS[data]
    if Path(data).is_dir():
        return None
    if not Path(data).is_file():
        raise FileNotFoundError(
            f"--data {data}: no such file or directory; give preference rows (JSONL), a "
            f"prepared directory, or a shipped task: {', '.join(PREFERENCE_TASKS)}"
        )
    return Path(data)


def _train_args(ns, rest: list[str]) -> list[str]:
    """The training command's arguments: the flags this command read, given back."""
    given = [(f"--{k}", getattr(ns, k)) for k in ("data", "out", "checkpoint")]
    args = [*rest, *[x for flag, v in given if v is not None for x in (flag, v)]]
    return args + ["--resume"] * ns.resume + (["--train.task", ns.task] if ns.task else [])


def _check_settings(args: list[str]) -> None:
    """Resolve the settings ``args`` give as the training command will (its flags, --config
    files, the checkpoint's architecture): a bad one is a ConfigError here, before any row is
    read or file written."""
    from llm_foundry.cli.options import join_negative_values, settings_from
    from llm_foundry.cli.train import SECTIONS, parser
    from llm_foundry.loading import read_model_config

    tns = parser(finetune=True).parse_args(join_negative_values(args))
    if tns.checkpoint is None:
        raise ValueError(
            "finetune needs --checkpoint DIR (a run, our checkpoint or an HF directory)"
        )
    base = read_model_config(tns.checkpoint)
    extra = ("out", "resume", "data", "checkpoint")
    settings_from(tns, SECTIONS, base_model=base, extra_keys=extra)


def _prepare(ns) -> None:
    """--data's rows tokenized with the checkpoint's tokenizer into OUT/data; --data points
    there from now on."""
    from llm_foundry.data.preference import prepare_preference
    from llm_foundry.rundir import RunDir, read_checkpoint

    rows = preference_rows(ns.data)
    if rows is None:
        return
    out = Path(ns.out)
    if RunDir(out).latest() is not None:  # its data is the run's: never prepared over
        raise ValueError(f"--out {out} already holds a run with checkpoints: continue it with "
                         "--resume, or pass another --out")  # fmt: skip

    def tokenize(ckpt: Path) -> tuple[dict, Path]:
        tok = ckpt / "tokenizer.json"
        if not tok.is_file():
            raise FileNotFoundError(f"--checkpoint {ns.checkpoint}: no tokenizer.json in {ckpt}")
        return prepare_preference(out / DATA_DIR, rows, tok), tok

    def prepare():
        # a run's latest checkpoint, resolved and read again if its training replaces it
        meta, tok = read_checkpoint(ns.checkpoint, tokenize)
        print(f"prepared {rows}: {meta['train_pairs']:,} train + {meta['val_pairs']:,} val pairs "
              f"in {out / DATA_DIR} (tokenizer {tok})")  # fmt: skip

    # under torchrun rank 0 prepares; the others wait for a meta.json of these very rows
    digest = hashlib.sha256(rows.read_bytes()).hexdigest()
    rank0_prepares(out / DATA_DIR, prepare, lambda: _prepared_from(out / DATA_DIR, digest))
    ns.data = str(out / DATA_DIR)


def _prepared_from(data: Path, digest: str) -> bool:
    """Whether ``data`` holds rows whose file has the sha256 ``digest`` (meta.json, written last)."""
    try:
        return json.loads((data / "meta.json").read_text()).get("sha256") == digest
    except (OSError, ValueError):  # not there yet, or being replaced
        return False


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:  # the training command's help lists --task too
        return train_main(argv, finetune=True)
    ns, rest = _pre_parser().parse_known_args(argv)
    if ns.task == "dpo" and ns.resume and ns.data is not None and not Path(ns.data).is_dir():
        run = ns.out or "RUN"  # rows (a file, the shipped task) are prepared when a run starts
        raise ValueError(f"--resume: a DPO run goes on with the pairs it prepared ({run}/data), "
                         f"not --data {ns.data}: drop --data, or give --data {run}/data")  # fmt: skip
    if ns.task == "dpo" and not ns.resume:
        ns.out = ns.out or default_out("dpo")
        if ns.data is not None:
            _check_settings(_train_args(ns, rest))
            refuse_data_out(ns.out)  # before its rows are prepared inside it
            _prepare(ns)
    rc = train_main(_train_args(ns, rest), finetune=True)
    out = ns.out and Path(ns.out)
    if out and (out / "metrics.jsonl").is_file() and _is_dpo(out):
        from llm_foundry.plots import plot_preference

        png = plot_preference(out / "metrics.jsonl", out / "rewards.png", title=f"{out.name}: DPO")
        stream = sys.stderr if rc else sys.stdout
        said = held_out_rewards(out / "metrics.jsonl")
        if said:
            print(said, file=stream)
        print(f"rewards and margins in {png}", file=stream)
    return rc


def held_out_rewards(metrics: Path) -> str | None:
    """The last evaluation's rewards of a DPO run, in one line (None before any)."""
    from llm_foundry.plots import read_metrics

    evals = [r for r in read_metrics(metrics)[1] if "val_rewards/margins" in r]
    if not evals:
        return None
    r = evals[-1]
    return (f"held-out pairs at step {r['step']}: reward margin {r['val_rewards/margins']:.3f} "
            f"(chosen {r['val_rewards/chosen']:.3f}, rejected {r['val_rewards/rejected']:.3f}), "
            f"the chosen completion ahead in {r['val_rewards/accuracies']:.0%} of the held-out "
            "pairs drawn for it (train.eval_batches batches, drawn with replacement)")  # fmt: skip


def _is_dpo(out: Path) -> bool:
    """Whether the run in ``out`` trained with train.task=dpo (its run.json says)."""
    import json

    from llm_foundry.rundir import RUN_INFO

    try:
        return json.loads((out / RUN_INFO).read_text())["train"].get("task") == "dpo"
    except (OSError, ValueError, KeyError):
        return False
