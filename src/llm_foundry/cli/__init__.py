"""The ``llm-foundry`` command line: one module per command in this package, each with a
``main(argv) -> int``, imported only when its command runs (so ``--help`` stays fast).

Commands parse, print and plot; the library modules they call compute and return. Errors the
user can fix are one line (``llm-foundry CMD: error: ...``) and exit 2, an optional part not
installed among them (``package.MissingExtra``: the line that installs it); a run stopped for a
reason it names (a diverged run, a busy directory) exits 1.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from llm_foundry.messages import MAX_ERROR, capped, one_line, shown

# name -> (module in this package, one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare": ("prepare", "tokenize a corpus into train/val token files"),
    "train": ("train", "train a model (no arguments: the Shakespeare demo)"),
    "finetune": ("finetune", "fine-tune a checkpoint (fully or LoRA) on text or chat/SFT data"),
    "generate": ("generate", "generate text from a checkpoint, training run or HF directory"),
    "eval": ("eval", "loss and perplexity per context length; lm-eval tasks (--tasks)"),
    "serve": ("serve", "an OpenAI-compatible HTTP server with continuous batching"),
    "convert": ("convert", "convert checkpoints to and from HF transformers, and to GGUF"),
    "quantize": ("quantize", "int8/int4 weight-only copy of a checkpoint for CPU decoding"),
    "inspect": (
        "inspect",
        "PNG plots: lr schedule, attention, RoPE, sinusoidal, ALiBi, training dynamics",
    ),
    "params": ("params", "parameter, FLOP and KV-cache accounting for a config"),
    "ablate": ("ablate", "train variants under one budget and compare them in one table"),
    "bench": ("bench", "benchmarks: `bench attention` (manual vs SDPA time and memory)"),
}


class _Console(logging.Handler):
    """The library's log records as plain lines: info to stdout, warnings to stderr (looked up
    at each record, so a redirected or captured stream is honoured). Written through tqdm, which
    lifts a progress bar on that stream off its line first (a note would share the bar's line)."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        tqdm.write(record.getMessage(), file=stream)
        stream.flush()


def show_library_messages() -> None:
    """Route ``llm_foundry``'s loggers to the console (once)."""
    log = logging.getLogger("llm_foundry")
    if not any(isinstance(h, _Console) for h in log.handlers):
        log.addHandler(_Console())
        log.setLevel(logging.INFO)
        log.propagate = False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: llm-foundry [--version] COMMAND [options]\n\ncommands:\n" + "\n".join(
        f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    if argv[0] in ("-V", "--version"):
        from llm_foundry.package import version_line

        print(version_line())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"llm-foundry: unknown command {shown(name)}\n\n{usage}", file=sys.stderr)
        return 2
    show_library_messages()
    from llm_foundry.cli.ranks import per_rank, rank0_only
    from llm_foundry.cli.signals import held_interrupt, stopped
    from llm_foundry.package import MissingExtra

    # under torchrun every rank runs this command line: what follows from it alone (usage and
    # configuration errors, a stop) is said by rank 0; what may differ (I/O) by each rank
    said_once = rank0_only()
    try:
        with held_interrupt():  # Ctrl-C while torch loads: raised once it has loaded
            command = importlib.import_module(f"llm_foundry.cli.{COMMANDS[name][0]}")
        return command.main(rest) or 0
    except KeyboardInterrupt:  # Ctrl-C where a command has no handler of its own
        with said_once:
            return stopped(f"llm-foundry {name}", "SIGINT", "before it finished")
    except MissingExtra as e:  # an optional part not installed: its install line, no traceback
        with said_once:
            print(f"llm-foundry {name}: error: {one_line(e, MAX_ERROR)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `llm-foundry ... | head`: the reader has what it wanted (train and
        # finetune outlive their reader: cli/streams.py)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 0
    except argparse.ArgumentError as e:  # a settings flag unknown or mistyped
        from llm_foundry.cli.options import flag_hint

        with said_once:
            print(f"llm-foundry {name}: error: {capped(str(e))}{flag_hint(str(e))}",
                  file=sys.stderr)  # fmt: skip
        return 2
    except OSError as e:  # a file in the way, ...
        print(per_rank(f"llm-foundry {name}: error: {capped(str(e))}"), file=sys.stderr)
        return 2
    except (KeyError, ValueError) as e:  # a ConfigError among them
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        line = f"llm-foundry {name}: error: {capped(str(msg))}"
        if getattr(e, "rank_alone", False):  # one rank's own (cli/ranks.py): said with its rank
            print(per_rank(line), file=sys.stderr)
            return 2
        with said_once:
            print(line, file=sys.stderr)
        return 2
    except _run_stops() as e:
        with said_once:
            print(f"llm-foundry {name}: {capped(str(e))}", file=sys.stderr)
        return 1


def _run_stops() -> tuple[type[Exception], ...]:
    """Errors that end a run with a message saying what to do (imported once one is raised)."""
    from llm_foundry.lock import DirectoryBusy
    from llm_foundry.train.trainer import TrainingDiverged

    return (TrainingDiverged, DirectoryBusy)


if __name__ == "__main__":
    sys.exit(main())
