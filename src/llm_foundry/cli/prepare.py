"""``llm-foundry prepare``: a corpus into token files, tokenizer.json and meta.json.

Three kinds of input, one per call:

- a text stream (``--text FILE...`` or ``--dataset shakespeare``): the files joined into one
  stream, a char or BPE tokenizer trained on all of it, the first 90% of the tokens in
  ``train.bin`` and the rest in ``val.bin`` (nanoGPT's layout); run again on a complete
  directory it does nothing (the same text and settings) or is refused (others; ``--restart``);
- a document corpus (``--input`` and/or ``--hf-dataset``; any of their flags): many files of text,
  JSONL, parquet or ``datasets``, one document each (a text file) or per row, tokenized in
  ``--workers`` processes into shards with document indexes (``data/shards.py``'s layout),
  whole documents held out for validation; an interrupted run resumes when run again, a complete
  one run again does nothing (the same inputs and settings) or is refused (others; ``--restart``
  prepares it again);
- fine-tuning rows (``--sft``): prompt/completion or chat rows, the loss on the answers; run
  again on a complete directory it does nothing (the same rows and settings) or is refused
  (others; ``--restart``).

A training run's directory is refused as ``--out``.

Ctrl-C stops it with one line and exit status 130; what it leaves is either complete (meta.json
there, its files checked against it) or recognisably not (no meta.json)."""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

DEMO_ROWS = 2000
# flags of the document corpus alone (their presence makes the call one)
DOCUMENT_FLAGS = ("input", "hf_dataset", "split", "text_field", "text_column", "val_source",
                  "workers", "shard_tokens", "tokenizer_sample", "dtype", "on_bad_utf8",
                  "on_bad_row")  # fmt: skip


def count(flag: str, text: str | int) -> int:
    """An integer >= 1, written with an optional K, M or G (thousands, millions, billions):
    100M; else a one-line error naming ``flag``."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", text)
    if not match:
        raise ValueError(f"{flag} {text!r}: not a count (e.g. 5000, 100M, 1.5G)")
    from fractions import Fraction

    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[match.group(2).lower()]
    value = Fraction(match.group(1)) * scale  # exact: no float rounding of large counts
    if value < 1 or value.denominator != 1:
        raise ValueError(f"{flag} {text!r}: must be a whole number >= 1")
    return int(value)


def main(argv: list[str]) -> int:
    from llm_foundry.cli.signals import stopped, terminate_as_interrupt
    from llm_foundry.data import DATASETS
    from llm_foundry.data.corpus import BAD_ROWS, BAD_UTF8
    from llm_foundry.data.documents import (
        DEFAULT_SHARD_TOKENS,
        DEFAULT_TOKENIZER_SAMPLE,
        DTYPES,
    )
    from llm_foundry.data.encode import RUN_CHARS
    from llm_foundry.data.shard_writer import PROGRESS_FILE, AlreadyPrepared
    from llm_foundry.tokenizer import TOKENIZER_KINDS

    p = argparse.ArgumentParser(
        prog="llm-foundry prepare",
        allow_abbrev=False,  # exact option names: a prefix could mean another option
        description="Tokenize a corpus: a text stream (--text, --dataset) into "
        "train.bin/val.bin; a document corpus (--input, --hf-dataset) into shards with document "
        "indexes; fine-tuning rows (--sft). Each writes tokenizer.json and, last, meta.json. "
        f"BPE: a run of more than {RUN_CHARS:,} characters with no space or newline between "
        f"words (base64, DNA, minified code) is trained on and tokenized in pieces of {RUN_CHARS:,} "
        "characters (its time would grow with the square of its length), where a token may "
        "break; the summary counts them.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--dataset", choices=DATASETS, help="a known corpus (fetched and cached)")
    src.add_argument(
        "--text",
        nargs="+",
        action="extend",
        metavar="FILE",
        help="your own UTF-8 text files, as one stream (repeat the flag or list several)",
    )
    src.add_argument(
        "--sft",
        metavar="FILE.jsonl",
        help='fine-tuning rows: {"prompt", "completion"} or {"messages": [{"role", "content"}]}',
    )
    p.add_argument(
        "--sft-demo",
        action="store_true",
        help="with --dataset or --text: make fine-tuning rows from the play's speeches ('continue "
        "this speech', 'who speaks next'), write them to OUT/rows.jsonl and prepare them",
    )
    p.add_argument(
        "--rows", type=int, default=None, help=f"--sft-demo: how many rows (default {DEMO_ROWS})"
    )
    p.add_argument(
        "--tokenizer-from",
        metavar="PATH",
        help="use a model's tokenizer instead of training one: its tokenizer.json, an HF model "
        "directory, or one of our runs / checkpoints (needed by --sft and --sft-demo; with "
        "--input its end-of-text token ends each document)",
    )
    p.add_argument(
        "--tokenizer",
        choices=TOKENIZER_KINDS,
        default=None,
        help="the tokenizer to train (text stream: default char; documents: bpe only, with the "
        "chat markers reserved)",
    )
    p.add_argument(
        "--vocab-size", type=int, default=None, help="BPE: vocabulary size (default 4096)"
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help="held out for validation (default 0.1): a text stream's last tokens; of a document "
        "corpus, whole documents spread evenly through it",
    )
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument(
        "--restart",
        action="store_true",
        help="prepare --out from scratch, discarding what a prepare left there (without it, an "
        "interrupted document prepare resumes, and a complete prepare of any kind is kept: "
        "nothing to do with the same inputs and settings, refused with others)",
    )
    p.add_argument("--json", action="store_true", help="print meta.json")

    d = p.add_argument_group("document corpus (shards)")
    d.add_argument(
        "--input",
        nargs="+",
        action="extend",
        metavar="PATH",
        help="files, globs (quote them) or directories of .txt (one document per file), .jsonl, "
        ".jsonl.gz, .jsonl.zst, .parquet (one per row), or saved `datasets` directories",
    )
    d.add_argument(
        "--hf-dataset",
        nargs="+",
        action="extend",
        metavar="NAME",
        help="Hugging Face hub datasets (NAME or NAME:CONFIG), read through the datasets cache",
    )
    d.add_argument(
        "--split", default=None, help="the split of a dataset or DatasetDict (default train)"
    )
    d.add_argument(
        "--text-field", default=None, help="JSONL: the field holding the text (default text)"
    )
    d.add_argument(
        "--text-column",
        default=None,
        help="parquet and datasets: the column holding the text (default text)",
    )
    d.add_argument(
        "--val-source",
        nargs="+",
        action="extend",
        metavar="PATH",
        help="validation documents from these inputs instead of --val-fraction",
    )
    d.add_argument(
        "--workers", type=int, default=1, help="tokenizing processes (default 1: this process)"
    )
    d.add_argument(
        "--shard-tokens",
        default=DEFAULT_SHARD_TOKENS,
        metavar="N",
        help="a shard closes at the first document end past N tokens (default 100M)",
    )
    d.add_argument(
        "--tokenizer-sample",
        default=DEFAULT_TOKENIZER_SAMPLE,
        metavar="BYTES",
        help="BPE: train on at most this much text, drawn evenly over the training documents "
        f"(default {DEFAULT_TOKENIZER_SAMPLE // 1_000_000}M)",
    )
    d.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="token ids on disk (auto: uint16 while the vocabulary fits, else uint32)",
    )
    d.add_argument(
        "--on-bad-utf8",
        choices=BAD_UTF8,
        default="fail",
        help="a document with bytes that are not UTF-8: stop with its file and row (fail, the "
        "default), or leave it out and count it (skip)",
    )
    d.add_argument(
        "--on-bad-row",
        choices=BAD_ROWS,
        default="fail",
        help="a JSONL line that is not a JSON object with the text field a string or null (a "
        "line cut short, a missing field), or a table value that is not text: stop with its file "
        "and row (fail, the default), or leave it out and count it (skip)",
    )
    # the document flags left unset stay absent, so that what was given is known (a default
    # value typed out counts as given), then take their defaults
    defaults = {k: p.get_default(k) for k in DOCUMENT_FLAGS}
    for action in p._actions:  # the parser's own list: argparse has no public setter for this
        if action.dest in defaults:
            action.default = argparse.SUPPRESS
    ns = p.parse_args(argv)
    ns.given = [k for k in DOCUMENT_FLAGS if hasattr(ns, k)]
    for key, value in defaults.items():
        if not hasattr(ns, key):
            setattr(ns, key, value)
    ns.documents = bool(ns.given)
    _check_flags(ns)
    try:
        with terminate_as_interrupt() as signalled:  # SIGTERM stops it as Ctrl-C does
            if ns.sft_demo or ns.sft:
                return _prepare_sft(ns)
            if ns.documents:
                return _prepare_documents(ns)
            from llm_foundry.data import prepare

            meta = prepare(
                ns.out,
                dataset=ns.dataset,
                text_files=ns.text,
                tokenizer=ns.tokenizer or "char",
                vocab_size=ns.vocab_size,
                val_fraction=0.1 if ns.val_fraction is None else ns.val_fraction,
                restart=ns.restart,
            )
    except AlreadyPrepared as done:
        return _already(done, ns.json)
    except KeyboardInterrupt:
        _lower_other_threads()
        out = Path(ns.out)
        if (out / "meta.json").is_file():
            state = f"{out} is complete (its meta.json matches its files)"
        elif (out / PROGRESS_FILE).is_file():
            state = (
                f"{out} is incomplete (no meta.json): run the same command again to resume "
                "from its last complete shard"
            )
        elif out.is_dir():
            state = f"{out} is incomplete (no meta.json): run prepare again"
        else:
            state = "nothing was written"
        return stopped("llm-foundry prepare", (signalled or ["SIGINT"])[0], state)
    if ns.json:
        print(json.dumps(meta, indent=2))
    else:
        print(
            f"wrote {ns.out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
            f"({meta['dtype']}), {meta['tokenizer']} tokenizer with {meta['vocab_size']:,} "
            f"entries; source {meta['source']}"
        )
        runs = meta["long_runs"]["runs"]
        if runs:
            what = f"the text held {runs:,} run{'s' if runs != 1 else ''}"
            print(_long_runs_line(what, meta["run_chars"], None))
    return 0


def _long_runs_line(what: str, run_chars: int, first: str | None) -> str:
    """The summary's line for runs cut in pieces (``what``: which, counted)."""
    at = f"; first: {first}" if first else ""
    return (f"note: {what} of more than {run_chars:,} characters with no space or newline between "
            f"words (base64, DNA, minified code?{at}): tokenized in pieces of {run_chars:,} "
            "characters, a token may break at each cut")  # fmt: skip


LOWEST_PRIORITY = 19  # nice value


def _lower_other_threads() -> None:
    """Stopped: put this process's other threads at the lowest priority (Linux), so that work
    left running until the exit (a BPE trainer's threads, which nothing stops) does not slow the
    interpreter's exit, which competes with them for the CPUs."""
    import os
    import threading

    try:
        tasks = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in set(tasks) - {threading.get_native_id()}:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, LOWEST_PRIORITY)
        except OSError:  # ended meanwhile
            pass


def _prepare_documents(ns) -> int:
    from llm_foundry.data.documents import prepare_documents
    from llm_foundry.data.encode import RUN_CHARS
    from llm_foundry.data.shard_writer import AlreadyPrepared

    try:
        meta = prepare_documents(
            ns.out,
            ns.input or (),
            hf_datasets=ns.hf_dataset or (),
            val_sources=ns.val_source or (),
            split=ns.split,
            text_field=ns.text_field,
            text_column=ns.text_column,
            vocab_size=ns.vocab_size,
            tokenizer_from=ns.tokenizer_from,
            tokenizer_sample=ns.tokenizer_sample,
            val_fraction=ns.val_fraction,
            shard_tokens=ns.shard_tokens,
            dtype=ns.dtype,
            workers=ns.workers,
            on_bad_utf8=ns.on_bad_utf8,
            on_bad_row=ns.on_bad_row,
            restart=ns.restart,
        )
    except AlreadyPrepared as done:
        return _already(done, ns.json)
    if ns.json:
        print(json.dumps(meta, indent=2))
        return 0
    shards = {s: len(meta["shards"][s]) for s in ("train", "val")}
    empty = sum(s["empty"] for s in meta["sources"])
    bad = sum(s["bad_utf8"] for s in meta["sources"])
    first = next((s["bad_utf8_first"] for s in meta["sources"] if s["bad_utf8_first"]), None)
    skipped = f"; left out {empty:,} empty documents" if empty else ""
    if bad:
        skipped += f"; left out {bad:,} documents that are not UTF-8 (first: {first})"
    rows = sum(s.get("bad_rows", 0) for s in meta["sources"])
    if rows:
        first = next(s["bad_rows_first"] for s in meta["sources"] if s.get("bad_rows_first"))
        skipped += f"; left out {rows:,} bad rows (first: {first})"
    plural = {s: "s" if n != 1 else "" for s, n in shards.items()}
    print(
        f"wrote {ns.out}: {shards['train']:,} train shard{plural['train']} "
        f"({meta['train_tokens']:,} tokens, {meta['train_documents']:,} documents) + "
        f"{shards['val']:,} val shard{plural['val']} "
        f"({meta['val_tokens']:,} tokens, {meta['val_documents']:,} documents), "
        f"{meta['dtype']}; {meta['tokenizer']} tokenizer with {meta['vocab_size']:,} entries, "
        f"documents ended by {meta['eot']} ({meta['eot_id']}); "
        f"{len(meta['sources'])} input(s){skipped}"
    )
    long = sum(s.get("long_runs", 0) for s in meta["sources"])
    if long:
        first = next((s["long_runs_first"] for s in meta["sources"] if s["long_runs_first"]), None)
        what = f"{long:,} document{'s' if long != 1 else ''} held a run"
        print(_long_runs_line(what, RUN_CHARS, first))
    return 0


def _already(done, as_json: bool) -> int:
    """A complete prepare of the same inputs is there: say so (with --json: its meta.json on
    stdout, the line on stderr)."""
    if as_json:
        print(json.dumps(done.meta, indent=2))
    print(done, file=sys.stderr if as_json else sys.stdout)
    return 0


def _check_flags(ns) -> None:
    """Flags out of range, or given where they do nothing: one line each."""
    sft = bool(ns.sft or ns.sft_demo)
    stream = bool(ns.text or ns.dataset)
    docs = ns.documents
    if not (stream or ns.sft or docs):
        raise ValueError(
            "give what to prepare: --text FILE... or --dataset shakespeare (a text stream), "
            "--input PATH... or --hf-dataset NAME (a document corpus), or --sft FILE.jsonl"
        )
    if ns.val_fraction is not None and not 0 < ns.val_fraction < 1:
        raise ValueError(f"--val-fraction {ns.val_fraction}: must be strictly between 0 and 1")
    out = Path(ns.out)
    if (out / "run.json").is_file() or (out / "checkpoints").is_dir():
        raise ValueError(f"--out {ns.out} is a training run's directory (run.json, checkpoints/): "
                         "give prepare a directory of its own")  # fmt: skip
    if ns.rows is not None and not ns.sft_demo:
        raise ValueError("--rows is for --sft-demo (how many demonstration rows to make)")
    if ns.sft_demo and ns.rows is not None and ns.rows < 2:
        raise ValueError(f"--rows {ns.rows}: must be at least 2 (a train and a val row)")
    if docs and (stream or sft):
        flag = next(f"--{k.replace('_', '-')}" for k in ns.given)
        what = "--sft/--sft-demo" if sft else ("--text" if ns.text else "--dataset")
        raise ValueError(
            f"{flag} is for a document corpus (--input / --hf-dataset), not {what}"
            + ("; to prepare text files as documents, give them as --input" if ns.text else "")
        )
    if docs and not (ns.input or ns.hf_dataset):
        flag = next(f"--{k.replace('_', '-')}" for k in ns.given)
        raise ValueError(f"{flag} needs the documents: --input PATH... or --hf-dataset NAME")
    if sft and (ns.tokenizer is not None or ns.vocab_size is not None):
        flag = "--tokenizer" if ns.tokenizer is not None else "--vocab-size"
        raise ValueError(
            f"{flag} does not apply to --sft/--sft-demo: their tokens are those of the model's "
            "tokenizer (--tokenizer-from)"
        )
    if stream and not sft and ns.tokenizer_from:
        raise ValueError(
            "--tokenizer-from with text: give the files as --input (a document corpus, each file "
            "a document); --text trains its tokenizer (--tokenizer, --vocab-size)"
        )
    if docs and ns.tokenizer == "char":
        raise ValueError(
            "--tokenizer char is for a text stream (--text, --dataset): a document corpus needs "
            "an end-of-text token between documents; use bpe or --tokenizer-from"
        )
    if docs and ns.tokenizer_from and (ns.tokenizer or ns.vocab_size is not None):
        flag = "--tokenizer" if ns.tokenizer else "--vocab-size"
        raise ValueError(f"{flag} trains a tokenizer; --tokenizer-from uses the model's: give one")
    if docs and ns.val_source and ns.val_fraction is not None:
        raise ValueError("give --val-fraction or --val-source, not both")
    ns.shard_tokens = count("--shard-tokens", ns.shard_tokens)
    ns.tokenizer_sample = count("--tokenizer-sample", ns.tokenizer_sample)
    if docs and ns.workers < 1:
        raise ValueError(f"--workers {ns.workers}: must be at least 1")
    if ns.vocab_size is not None and not docs and (ns.tokenizer or "char") != "bpe":
        raise ValueError(
            f"--vocab-size {ns.vocab_size} is for --tokenizer bpe; a char tokenizer's vocabulary "
            "is the corpus' characters"
        )
    from llm_foundry.tokenizer import CHAT_TOKENS, MIN_BPE_VOCAB

    least = MIN_BPE_VOCAB + (len(CHAT_TOKENS) if docs else 0)
    if ns.vocab_size is not None and ns.vocab_size < least:
        raise ValueError(
            f"--vocab-size {ns.vocab_size}: must be at least {least} (every byte and "
            "the special tokens)"
        )


def _prepare_sft(ns) -> int:
    from llm_foundry import lock
    from llm_foundry.data.sft import prepare_sft
    from llm_foundry.data.shard_writer import AlreadyPrepared
    from llm_foundry.rundir import checkpoint_dir

    if not ns.tokenizer_from:
        raise ValueError("--sft needs --tokenizer-from: the tokenizer.json of the model to tune")
    tok = Path(ns.tokenizer_from)
    if tok.is_dir():
        tok = checkpoint_dir(tok, "--tokenizer-from") / "tokenizer.json"
    if not tok.is_file():
        raise FileNotFoundError(f"--tokenizer-from {ns.tokenizer_from}: no tokenizer.json there")
    fraction = 0.1 if ns.val_fraction is None else ns.val_fraction
    try:
        if ns.sft_demo:
            with lock.hold(ns.out, "data directory", readers=True):
                rows = _demo_rows(ns, tok, fraction)
                meta = prepare_sft(ns.out, rows, tok, fraction, restart=ns.restart)
        else:
            meta = prepare_sft(ns.out, ns.sft, tok, fraction, restart=ns.restart)
    except AlreadyPrepared as done:
        return _already(done, ns.json)
    if ns.json:
        print(json.dumps(meta, indent=2))
    else:
        print(
            f"wrote {ns.out}: {meta['train_examples']:,} train + {meta['val_examples']:,} val "
            f"examples ({meta['train_targets']:,} of {meta['train_tokens']:,} train tokens are "
            f"targets); tokenizer {tok}"
        )
    return 0


def _demo_rows(ns, tok: Path, fraction: float) -> str:
    """Write the demonstration rows made from --dataset / --text to OUT/rows.jsonl (the caller
    holds OUT's lock), once OUT is known to hold no other prepare (rows.jsonl is one of its
    files): the same rows and settings raise AlreadyPrepared."""
    from llm_foundry.data import load_shakespeare, read_text_files
    from llm_foundry.data.sft import OUTPUTS, check_sft_prepared, sft_settings
    from llm_foundry.data.sft_demo import demo_rows
    from llm_foundry.data.sources import refuse_overwriting_inputs, write_atomic

    if not (ns.dataset or ns.text):
        raise ValueError("--sft-demo needs the play to make rows from: --dataset or --text")
    out = Path(ns.out)
    inputs = [("text file", Path(f)) for f in ns.text or ()]
    refuse_overwriting_inputs(inputs, out, ["rows.jsonl", *OUTPUTS])
    text, _ = load_shakespeare() if ns.dataset else read_text_files(ns.text)
    rows = demo_rows(text, DEMO_ROWS if ns.rows is None else ns.rows)
    if not rows:
        raise ValueError("no speeches found (paragraphs starting with a 'NAME:' or 'NAME.' line)")
    content = "".join(json.dumps(r) + "\n" for r in rows)
    if not ns.restart:
        digest = hashlib.sha256(content.encode("utf-8")).hexdigest()
        check_sft_prepared(out, digest, sft_settings(tok, fraction))
    write_atomic(out / "rows.jsonl", content)
    return str(out / "rows.jsonl")
