"""``llm-foundry train``: one training run, then its loss plot, a sample and a summary.

With no arguments it is the demo: prepare tiny Shakespeare at character level if needed and
train the ``llama-shakespeare-char`` preset. ``--resume --out RUN_DIR`` continues a run from its
latest checkpoint with the model, settings and data it was started with.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from llm_foundry.cli.options import (
    SettingsParser,
    add_settings_arguments,
    join_negative_values,
    settings_from,
)
from llm_foundry.cli.ranks import rank0_only, rank_alone
from llm_foundry.cli.signals import stopped
from llm_foundry.cli.streams import outliving_reader
from llm_foundry.presets import preset_names
from llm_foundry.settings import read_config_file

DEFAULT_DATA = "data/shakespeare_char"
DEFAULT_PRESET = "llama-shakespeare-char"
SECTIONS = ("model", "train")
FINETUNE_TEXT_BLOCK = 1024  # a fine-tune's default window on text, whatever the model's context
SUMMARY = "summary.json"  # in the run directory: how the run ended
SKIPPED_WARN = 0.1  # a share of skipped (non-finite) updates past which the end warns


def parser(finetune: bool = False) -> SettingsParser:
    if finetune:
        p = SettingsParser(
            prog="llm-foundry finetune",
            description="Fine-tune a model: start from a checkpoint (ours, a training run or an "
            "HF directory) on data from `prepare` (plain text, or --sft JSONL rows whose prompts "
            "are masked out of the loss). --train.lora_r R trains low-rank adapters only.",
        )
        p.add_argument("--checkpoint", metavar="DIR", help="the model to start from")
        # read by finetune's own pre-parser (it never reaches this one): listed for --help
        p.add_argument("--task", choices=("lm", "dpo"), default="lm", help="lm trains on text "
                       "or SFT rows; dpo on preference rows {prompt, chosen, rejected} (--data "
                       "ROWS.jsonl or shakespeare_prefer_next_line), settings --train.dpo_*")  # fmt: skip
    else:
        p = SettingsParser(
            prog="llm-foundry train",
            description="Train a model. With no arguments: prepare tiny Shakespeare (character "
            f"level) if needed, train the {DEFAULT_PRESET} preset and print a sample.",
        )
    add_settings_arguments(
        p,
        SECTIONS,
        f"architecture preset: {', '.join(preset_names())} (default {DEFAULT_PRESET}; a "
        "resumed run keeps its own)",
    )
    p.add_argument(
        "--data",
        default=None,
        help=f"directory written by `prepare` ({DEFAULT_DATA}; sharded or not), or a mixture "
        "DIR=WEIGHT,DIR=WEIGHT (one tokenizer; each row's directory drawn by weight)",
    )
    p.add_argument("--out", default=None, help="run directory (default runs/NAME-TIME)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue RUN_DIR from its latest checkpoint, with the model, training settings "
        "and data it was started with (flags given now override training settings)",
    )
    return p


def _config_value(ns, key: str):
    """``key`` from the command line, else from the last --config file that sets it (read now:
    out and resume decide what the settings start from)."""
    value = getattr(ns, key)
    if value not in (None, False):
        return value
    for file in reversed(ns.config):
        conf = read_config_file(file)
        if key in conf:
            return conf[key]
    return value


def main(argv: list[str], finetune: bool = False) -> int:
    prog = f"llm-foundry {'finetune' if finetune else 'train'}"
    ran: dict = {}  # the Trainer, once built: whether a signal has stopped it already
    # a reader that goes away (`| head`) neither ends the run nor costs it a checkpoint: why
    # going on silently rather than stopping is in cli/streams.py
    with outliving_reader(prog), second_interrupt_held(lambda: _stopping(ran)):
        try:
            return _main(argv, finetune, prog, ran)
        except KeyboardInterrupt as e:  # Ctrl-C outside the training loop (which saves and says so)
            with rank0_only():  # every rank of a torchrun job got it
                return stopped(prog, "SIGINT", str(e) or "interrupted outside the training "
                               "steps; nothing was saved then (checkpoints written before it "
                               "stay)")  # fmt: skip


def _stopping(ran: dict) -> bool:
    """Whether the run's trainer was asked to stop by a signal (it saves, then the command ends)."""
    trainer = ran.get("trainer")
    return trainer is not None and trainer.stop_signal is not None


@contextlib.contextmanager
def second_interrupt_held(stopping):
    """Within it, Ctrl-C raises KeyboardInterrupt as usual unless ``stopping()`` says a signal
    has asked the run to stop already: a second Ctrl-C then repeats that request and is let go,
    so the checkpoint, summary.json and the command's last line (how to resume) are written
    whole. Only in the main thread, where SIGINT raises KeyboardInterrupt (not ignored or
    handled otherwise)."""
    main_thread = threading.current_thread() is threading.main_thread()
    if not main_thread or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return

    def on_sigint(signum, frame):
        if not stopping():
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _main(argv: list[str], finetune: bool, prog: str, ran: dict) -> int:
    from llm_foundry import lock
    from llm_foundry.train.state import FileNotWritten, resume_point

    ns = parser(finetune).parse_args(join_negative_values(argv))
    if finetune:  # the start may come from a --config file, as out and data may
        ns.checkpoint = _config_value(ns, "checkpoint")
        ns.resume = bool(_config_value(ns, "resume"))
    if finetune and not ns.resume and not ns.checkpoint:
        raise ValueError(
            "finetune needs --checkpoint DIR (a run, our checkpoint or an HF directory)"
        )
    from llm_foundry.loading import model_config_at

    start = model_config_at(ns.checkpoint) if finetune and not ns.resume else None
    given_out, resume = _config_value(ns, "out"), bool(_config_value(ns, "resume"))
    if given_out is not None and Path(given_out).exists() and not Path(given_out).is_dir():
        raise ValueError(
            f"--out {given_out} exists and is not a directory (a file or a device); give a run "
            "directory"
        )
    refuse_data_out(given_out)
    # a resumed run starts from its own saved settings; flags given now override them
    saved = resume_point(given_out) if resume and given_out else None
    _, model_base, train_base, data_base = saved or (None, None, None, None)
    if finetune and saved and ns.checkpoint:  # a resumed run goes on from its own checkpoint
        resumed_base(ns.checkpoint, train_base.init_from, given_out)
    if start:  # fine-tuning: the checkpoint's architecture, its weights to start from
        model_base = start[1]
    settings = settings_from(
        ns,
        SECTIONS,
        base_model=model_base,
        base_train=train_base,
        default_preset=None if saved or start else DEFAULT_PRESET,
        extra_keys=("out", "resume", "data", "checkpoint"),
    )
    cfg, train_cfg = settings.model, settings.train
    if saved and settings.preset:  # a preset's architecture over the run's: named as such
        refuse_preset_on_resume(settings.preset, bool(ns.preset), model_base, cfg, given_out)
    refuse_unused_dpo(settings.given["train"], train_cfg.task, finetune)
    if train_cfg.tensorboard:  # a missing extra is said before the run directory is made
        from llm_foundry.train.metrics import require_tensorboard

        require_tensorboard()
    if start:  # a run, not the step it resolved to now: its weights are read with a retry
        init = ns.checkpoint  # should training replace that step (load_any)
        train_cfg = type(train_cfg).from_dict({**train_cfg.to_dict(), "init_from": init})
    if train_cfg.init_from and Path(train_cfg.init_from).exists():
        # recorded absolute: a resume from another directory (a DPO run reads its reference
        # from it again) and an exported adapter's base name find it, never a hub id
        init = str(Path(train_cfg.init_from).resolve())
        train_cfg = type(train_cfg).from_dict({**train_cfg.to_dict(), "init_from": init})
    if start:
        if ns.data is None:
            raise ValueError("finetune needs --data: a directory `prepare` wrote with the "
                             "checkpoint's tokenizer (prepare --input FILES or --sft ROWS, "
                             "--tokenizer-from CHECKPOINT)")  # fmt: skip
    data_dir = ns.data or data_base or DEFAULT_DATA
    if Path(data_dir).is_file():  # rows not prepared yet: the command that prepares them
        rows_hint(Path(data_dir), ns.checkpoint if finetune else None)
    if start and "block_size" not in settings.given["train"]:
        train_cfg = _finetune_block_size(cfg, train_cfg, data_dir)
    if ns.resume and ns.out is None:
        raise ValueError("--resume needs --out RUN_DIR (the run to continue)")
    if ns.out is not None and not str(ns.out).strip():
        raise ValueError("--out is empty: give a run directory")
    name = settings.preset or "custom"
    out = Path(ns.out or default_out(name))
    # rank 0 owns the run directory (the ranks of one torchrun write it together)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if ns.resume and saved is None:
        if rank0 and out.is_dir():  # a run training now, before its first save: in use
            with contextlib.suppress(OSError), lock.hold(out, "run directory"):
                pass  # DirectoryBusy (not an OSError) names the process holding it
        raise ValueError(nothing_to_resume(out))  # the same on every rank: said once
    if ns.resume and ns.data is None and data_base:
        moved_data(data_base, out)
    try:
        with run_directory(out) if rank0 else contextlib.nullcontext():
            return _train_in(out, ns, cfg, train_cfg, data_dir, prog, ran)
    except FileNotWritten as e:  # a full disk outside a checkpoint: where the run stands
        print(f"{prog}: {not_written(e, out)}", file=sys.stderr, flush=True)
        return 1


def _train_in(out: Path, ns, cfg, train_cfg, data_dir: str, prog: str, ran: dict) -> int:
    """Train in the run directory ``out``, which this process holds (rank 0), and say how the
    run ended."""
    import torch.distributed as dist

    from llm_foundry.rundir import RunDir
    from llm_foundry.train.state import CheckpointNotWritten

    if not ns.resume and RunDir(out).latest() is not None:
        raise ValueError(
            f"--out {out} already holds a run with checkpoints: continue it with --resume, "
            "or pass another --out"
        )
    if data_dir == DEFAULT_DATA and not (Path(data_dir) / "meta.json").exists():
        prepare_default(Path(data_dir))
    try:
        result = train_and_report(cfg, train_cfg, data_dir, out, resume=ns.resume, ran=ran)
        if dist.is_initialized():  # ranks tear down together, not while rank 0 still writes
            dist.barrier()
    except (ValueError, KeyError) as e:  # said once by rank 0, unless raised by one rank alone
        e.rank_alone = rank_alone(e)
        raise
    except CheckpointNotWritten as e:  # a full disk: one line saying how to go on
        then = f"--resume --out {out}" if e.last else "run the command again"
        todo = "free space" if e.no_space else "fix that"
        with rank0_only():  # every rank raises it, rank 0 with the reason (train/dcp.py)
            print(f"{prog}: {e}; {todo}, then {then}", file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if result.interrupted:  # saved, but not finished: `train && next-step` must not go on
        with rank0_only():  # every rank stopped at the same step: said once
            return stopped(prog, result.stopped_by, f"{result.step} of {train_cfg.max_steps} "
                           f"steps done; saved {result.checkpoint}; continue with --resume --out "
                           f"{out}")  # fmt: skip
    return 0


@contextlib.contextmanager
def run_directory(out: Path):
    """``out`` held by this process (``lock.hold``); a lock file that cannot be written (a full
    disk) is ``FileNotWritten``."""
    from llm_foundry import lock
    from llm_foundry.train.state import FileNotWritten

    try:
        lock.acquire(out, "run directory")
    except OSError as e:
        if e.errno is None:  # a message of its own (not a directory)
            raise
        raise FileNotWritten(out / lock.LOCK_FILE, e) from e
    try:
        yield out
    finally:
        lock.release(out)


def not_written(e, out: Path) -> str:
    """The line for ``FileNotWritten`` ``e`` in run directory ``out``: the file, why, where the
    run stands (the step it reached, its last checkpoint) and how to go on."""
    todo = "free space" if e.no_space else "fix that"
    if e.last is None:
        stands = ("before the first step" if not e.step
                  else f"at step {e.step}, with no checkpoint saved yet")  # fmt: skip
        return f"{e}, {stands}; {todo}, then run the command again"
    return (f"{e}, at step {e.step}; the last checkpoint is {e.last} (steps after it train again); "
            f"{todo}, then --resume --out {out}")  # fmt: skip


def refuse_preset_on_resume(preset: str, flag: bool, saved, cfg, out: str) -> None:
    """Refuse, in one line, a preset given on resume (``flag``: --preset, else a --config
    file's preset:) whose architecture is not the saved run's ``saved`` (the model ``cfg``
    it gives): a run resumes with its own."""
    from llm_foundry.train.state import model_changes

    # the vocabulary is the data's whatever the preset says (model_config_for_data)
    refused = model_changes(saved.to_dict(), cfg.replace(vocab_size=saved.vocab_size))[0]
    if not refused:
        return
    given = f"--preset {preset}" if flag else f"the --config file's preset: {preset}"
    shown = [f"{k} {was!r} -> {now!r}" for k, (was, now) in refused.items()]
    more = f", and {len(shown) - 3} more" if len(shown) > 3 else ""
    raise ValueError(
        f"--resume --out {out} goes on with the run's own model; {given} would change "
        f"{len(shown)} of its architecture fields ({', '.join(shown[:3])}{more}): drop "
        f"{'--preset' if flag else 'preset: from the --config file'}"
    )


def refuse_data_out(out: str | None) -> None:
    """Refuse, in one line, an --out that is a directory ``prepare`` wrote (it holds meta.json):
    the run's checkpoints, metrics and plots would be written among the data it reads."""
    if out is not None and (Path(out) / "meta.json").is_file():
        raise ValueError(f"--out {out} is a data directory `llm-foundry prepare` wrote (it holds "
                         "meta.json): give the run a directory of its own, e.g. runs/NAME")  # fmt: skip


def resumed_base(checkpoint: str, init_from: str | None, out: str) -> None:
    """--checkpoint given with --resume: a run resumes from its own latest checkpoint, on the
    base it started from (``init_from``, its train.init_from); the same base is said in a note,
    another refused in one line."""
    from llm_foundry.rundir import checkpoint_dir

    def where(path: str) -> Path:
        try:
            return checkpoint_dir(path).resolve()
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return Path(path).resolve()

    if init_from is not None and where(checkpoint) == where(init_from):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"note: --checkpoint {checkpoint} is the base {out} started from; --resume "
                  f"goes on from {out}'s latest checkpoint")  # fmt: skip
        return
    started = f"started from {init_from}" if init_from else "was trained from scratch"
    raise ValueError(
        f"--resume --out {out} goes on from that run's own latest checkpoint (it {started}); "
        f"--checkpoint {checkpoint} is another model: drop --checkpoint, or fine-tune "
        f"{checkpoint} in a new run with another --out"
    )


def refuse_unused_dpo(given: dict, task: str, finetune: bool) -> None:
    """Refuse, in one line, train.dpo_* settings given to a run whose task is not dpo: they
    would be ignored."""
    unused = sorted(k for k in given if k.startswith("dpo_"))
    if unused and task != "dpo":
        how = "--task dpo" if finetune else "--train.task dpo (or finetune --task dpo)"
        raise ValueError(
            f"train.{unused[0]} applies to preference tuning only, and this run's train.task is "
            f"{task!r}: add {how} to train on preference pairs, or drop "
            + ", ".join(f"--train.{k}" for k in unused)
        )


def rows_hint(path: Path, checkpoint: str | None) -> None:
    """Refuse --data naming a JSONL file of fine-tuning or preference rows, in one line with the
    command that takes them (``checkpoint``: the model a fine-tune starts from); any other file
    is left to the data loader's own message."""
    from llm_foundry.data.rows import rows_advice
    from llm_foundry.data.sources import DataError

    if advice := rows_advice(path, checkpoint or "MODEL"):
        raise DataError(f"--data {path} {advice}")


def nothing_to_resume(out: Path) -> str:
    """Why --resume cannot continue ``out`` (no checkpoint), and what to run instead: the
    command run.json recorded as starting the run, launched as it was (torchrun and its number
    of processes), when it recorded one."""
    from llm_foundry.rundir import CHECKPOINTS, read_run_info

    said = f"--resume: no checkpoint in {out / CHECKPOINTS} to continue"
    if not out.is_dir():
        return f"{said}: {out} is not a run directory"
    try:
        info = read_run_info(out)
    except ValueError:  # a damaged run.json: the advice without the command
        info = {}
    said += ": the run never saved one, so run its command again without --resume"
    command = shown_command(first_command(info))
    return f"{said}: {command}" if command else said


def moved_data(data: str, out: Path) -> None:
    """Refuse, in one line, resuming ``out`` on the data its run.json names (``data``: a
    directory or a mixture) when a directory of it is gone, saying that ``--data`` gives where
    the prepared data is now."""
    from llm_foundry.data.loader import parse_sources
    from llm_foundry.data.sources import DataError
    from llm_foundry.rundir import RUN_INFO

    sources = parse_sources(data)
    gone = [s.dir for s in sources if not s.dir.exists()]
    if not gone:
        return
    where = "NEWDIR" if len(sources) == 1 else "DIR=WEIGHT,... (each directory where it is now)"
    raise DataError(
        f"data directory {gone[0]} (the run's, in {out / RUN_INFO}) does not exist: if the "
        f"prepared data moved, give where it is now: --resume --out {out} --data {where}; else "
        "prepare it there again with `llm-foundry prepare`"
    )


def first_command(info: dict) -> dict:
    """The record of the command that started a run, from its run.json ``info``: argv and, where
    recorded, launch (a run.json written before commands were kept: its argv alone)."""
    commands = info.get("commands")
    first = commands[0] if isinstance(commands, list) and commands else None
    if isinstance(first, dict) and first.get("argv") == info.get("argv"):
        return first
    return dict(argv=info.get("argv"))


def shown_command(record: dict) -> str | None:
    """A recorded command of ``llm-foundry train`` or ``finetune`` (run.json's ``argv`` and
    ``launch``) as a shell command line, under torchrun as it was launched (None for anything
    else: an ablation, a script)."""
    from llm_foundry.train.launch import launched_command

    argv = record.get("argv")
    ok = isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    if not ok or len(argv) < 2 or argv[1] not in ("train", "finetune"):
        return None
    return launched_command(argv, record.get("launch"))


def _finetune_block_size(cfg, train_cfg, data: str):
    """A fine-tune not given train.block_size takes its data's longest sequence (examples or
    preference pairs), else the base model's context, at most ``FINETUNE_TEXT_BLOCK`` tokens for
    text; never past the model's context. Said in a note (rank 0)."""
    from llm_foundry.data.sft import longest_sequence

    if not (Path(data) / "meta.json").is_file():  # a mixture, or missing: train says so
        return train_cfg
    longest = longest_sequence(data)
    if longest is not None:  # an example of L tokens is L - 1 (input, target) positions
        block = min(longest - 1, cfg.max_seq_len)
        why = f"the longest training sequence holds {longest} tokens"
        if longest - 1 > cfg.max_seq_len:
            why += f"; the model's context is {cfg.max_seq_len}"
    else:
        block = min(cfg.max_seq_len, FINETUNE_TEXT_BLOCK)
        why = f"text: the model's context of {cfg.max_seq_len}, at most {FINETUNE_TEXT_BLOCK}"
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"note: train.block_size {block} ({why}); --train.block_size sets another")
    return type(train_cfg).from_dict({**train_cfg.to_dict(), "block_size": block})


def default_out(name: str) -> str:
    """runs/NAME-TIME, for a run started without --out; refused under torchrun, where ranks
    started a second apart would each name another directory."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("under torchrun give --out RUN_DIR: every rank must name the same run "
                         "directory, and a default one is named by the time each rank starts")  # fmt: skip
    return f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def rank0_prepares(data: Path, prepare, ready=None, wait_s: float = 600.0) -> None:
    """``prepare()`` on rank 0 (or in a plain process); under torchrun the other ranks wait until
    ``ready()`` says rank 0's directory is there (default: ``data``/meta.json exists, written
    last)."""
    if int(os.environ.get("RANK", "0")) == 0:
        prepare()
        return
    ready = ready or (lambda: (data / "meta.json").exists())
    deadline = time.monotonic() + wait_s
    while not ready():
        if time.monotonic() > deadline:
            raise FileNotFoundError(f"rank 0 did not finish preparing {data} in {wait_s:.0f} s")
        time.sleep(0.5)


def prepare_default(data: Path) -> None:
    """Prepare the default corpus; under torchrun rank 0 prepares and the others wait for it."""
    from llm_foundry.data import prepare

    def run():
        print(f"preparing the default corpus (Shakespeare, characters) in {data}")
        meta = prepare(data, dataset="shakespeare", tokenizer="char")
        print(f"  from {meta['source']}: {meta['n_chars']:,} characters, {meta['vocab_size']} "
              "symbols")  # fmt: skip

    rank0_prepares(data, run)


def train_and_report(model_cfg, train_cfg, data: str | Path, out: Path, resume: bool = False,
                     ran: dict | None = None):  # fmt: skip
    """Train on ``data`` (a directory or a mixture spec), then (rank 0) plot the losses, print a
    sample and write summary.json. ``ran["trainer"]``: the Trainer, once built."""
    from llm_foundry.accounting import human
    from llm_foundry.tokenizer import load_any_tokenizer
    from llm_foundry.train.trainer import Trainer

    trainer = Trainer(model_cfg, train_cfg, data, out, resume=resume)
    if ran is not None:
        ran["trainer"] = trainer
    # the sample at the end needs the tokenizer (ours, or the HF one of a model the data was
    # prepared with): a missing one fails now, not after training
    try:
        file = trainer.data_dir / "tokenizer.json"
        tok = load_any_tokenizer(file) if train_cfg.sample_tokens else None
    except BaseException:
        trainer.release()
        raise
    w = trainer.world
    n = trainer.model.num_params()
    if w.main:
        per_step = train_cfg.batch_size * train_cfg.grad_accum * w.dp_size
        if train_cfg.lora_r:  # the base is frozen: say how much trains, and what memory it takes
            from llm_foundry.models.lora import frozen_base_bytes

            k = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
            held, fp32 = frozen_base_bytes(trainer.model)
            low = train_cfg.lora_base_dtype != "fp32"  # held in less than fp32: say how much less
            print(
                f"LoRA r={train_cfg.lora_r} on {train_cfg.lora_targets}: {k:,} trainable "
                f"parameters ({k / n:.2%} of {n:,}); AdamW state {human(8 * k, 'B')} instead "
                f"of {human(8 * n, 'B')}; frozen weights of the adapted projections "
                f"{human(held, 'B')} {train_cfg.lora_base_dtype}"
                + (f" (fp32: {human(fp32, 'B')})" if low else "")
            )
        print(
            f"model: {n:,} parameters ({trainer.model.num_params(non_embedding=True):,} "
            f"non-embedding) | device {trainer.device} | run dir {out}\n"
            f"global batch: {train_cfg.batch_size} per {'group' if w.tp > 1 else 'rank'} x "
            f"{train_cfg.grad_accum} accumulation x {w.dp_size} "
            f"{'data-parallel group(s)' if w.tp > 1 else 'rank(s)'} = "
            + (
                f"{per_step} pairs = {2 * per_step} sequences = "  # dpo: a chosen + a rejected row
                f"{2 * per_step * train_cfg.block_size:,} tokens/step"
                if train_cfg.task == "dpo"
                else f"{per_step} sequences = {per_step * train_cfg.block_size:,} tokens/step"
            )
            + (f" | parallel {train_cfg.parallel}" if w.distributed else "")
            + (f" ({w.tp}-way tensor parallel in each group)" if w.tp > 1 else "")
        )
    if resume and trainer.step >= train_cfg.max_steps and w.main:
        print(f"nothing to train: {out} reached max_steps={train_cfg.max_steps} already "
              f"(give --train.max_steps N > {trainer.step} to train it further)")  # fmt: skip
    first = trainer.step
    result = trainer.run()
    if not w.main:  # rank 0 alone plots, samples and summarises
        return result
    try:
        _report(trainer, result, tok, out, first, f"{out.name}: {n / 1e6:.2f}M params")
    except KeyboardInterrupt:  # the steps are done and saved: only what follows them was cut
        raise KeyboardInterrupt(
            f"after the training steps ({result.step} of {train_cfg.max_steps} done; saved "
            f"{result.checkpoint}): the loss plot, sample or {SUMMARY} may be missing"
        ) from None
    return result


def _report(trainer, result, tok, out: Path, first: int, title: str) -> None:
    """After the run: the loss plot, a sample (a finished run's), summary.json and the last
    line (rank 0)."""
    from llm_foundry.generate import sample_text
    from llm_foundry.plots import plot_losses
    from llm_foundry.rundir import METRICS

    tc = trainer.tc
    best = f"{result.best_val_loss:.4f}" if result.best_val_loss is not None else "n/a"
    if result.step == first and (out / SUMMARY).exists():  # nothing trained: the run as it was
        print(f"done: step {result.step}, best val loss {best}; {out / SUMMARY} kept")
        return
    with writing(out / "loss.png", result):
        plot_losses(out / METRICS, out / "loss.png", title=title)
    if tc.sample_tokens and not result.interrupted and not trainer.sharded:
        text = sample_text(trainer.model, tok, tc.sample_tokens, tc.seed, tc.block_size)
        with writing(out / "sample.txt", result):
            (out / "sample.txt").write_text(text)
        print("\n--- sample (temperature 0.8, top-k 50) ---" + text + "\n---")
    with writing(out / SUMMARY, result):
        (out / SUMMARY).write_text(json.dumps(summary(result, out), indent=2))
    ended = "stopped" if result.interrupted else "done"  # the caller says how to go on
    skipped = ""
    if result.skipped_steps:  # train.on_nonfinite=skip left updates out
        from llm_foundry.train.notes import skipped_text

        skipped = f"; {skipped_text(result.skipped_steps, result.step)}"
    print(f"{ended}: step {result.step}, best val loss {best}{skipped}; curves in "
          f"{out / 'loss.png'}")  # fmt: skip
    if result.skipped_steps > SKIPPED_WARN * result.step:
        share = result.skipped_steps / result.step
        print(f"warning: {share:.0%} of the updates were skipped (non-finite loss or gradient "
              f"norm): the weights trained on {result.step - result.skipped_steps} steps; lower "
              f"train.lr or raise train.warmup_steps", file=sys.stderr)  # fmt: skip


@contextlib.contextmanager
def writing(path: Path, result):
    """A write of ``path`` after training (``result``: where the run stands); one that fails (a
    full disk) is ``FileNotWritten``, said as metrics.jsonl's would be."""
    from llm_foundry.train.state import FileNotWritten

    try:
        yield
    except OSError as e:
        raise FileNotWritten(path, e, result.step, result.checkpoint) from e


def summary(result, out: Path) -> dict:
    """summary.json of run directory ``out`` after ``result`` (a ``RunResult``): the last train
    loss the run logged (``metrics.jsonl``'s, when this attempt trained no step) and the
    checkpoint as an absolute path (symbolic links resolved), however --out was spelled;
    ``stopped_early``: why ``Trainer.should_stop`` ended the run before max_steps (None: no
    such stop)."""
    from llm_foundry.rundir import METRICS, RunDir

    loss = result.last_train_loss
    if loss is None and (out / METRICS).exists():
        logged = [
            r["loss"] for r in RunDir(out).metrics() if "loss" in r and r["step"] <= result.step
        ]
        loss = logged[-1] if logged else None
    return dict(
        step=result.step,
        last_train_loss=loss,
        best_val_loss=result.best_val_loss,
        skipped_steps=result.skipped_steps,
        interrupted=result.interrupted,
        stopped_early=result.stopped_early,
        checkpoint=str(Path(result.checkpoint).resolve()) if result.checkpoint else None,
    )
