"""``llm-foundry prepare``: a corpus into train.bin/val.bin, tokenizer.json and meta.json.

Ctrl-C stops it with one line and exit status 130; what it leaves is either complete (meta.json
there, its files checked against it) or recognisably not (no meta.json)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEMO_ROWS = 2000


def main(argv: list[str]) -> int:
    from llm_foundry.cli.options import stopped
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
        help="--sft, --sft-demo (needed): the tokenizer of the model to tune, its tokenizer.json "
        "or a run / checkpoint directory",
    )
    p.add_argument(
        "--tokenizer",
        choices=TOKENIZER_KINDS,
        default=None,
        help="text: the tokenizer to train (default char)",
    )
    p.add_argument("--vocab-size", type=int, default=None, help="--tokenizer bpe: vocabulary size")
    p.add_argument("--val-fraction", type=float, default=0.1, help="last fraction kept for val")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--json", action="store_true", help="print meta.json")
    ns = p.parse_args(argv)
    _check_flags(ns)
    try:
        if ns.sft_demo or ns.sft:
            return _prepare_sft(ns)
        meta = prepare(
            ns.out,
            dataset=ns.dataset,
            text_files=ns.text,
            tokenizer=ns.tokenizer or "char",
            vocab_size=ns.vocab_size,
            val_fraction=ns.val_fraction,
        )
    except KeyboardInterrupt:
        out = Path(ns.out)
        if (out / "meta.json").is_file():
            state = f"{out} is complete (its meta.json matches its files)"
        elif out.is_dir():
            state = f"{out} is incomplete (no meta.json): run prepare again"
        else:
            state = "nothing was written"
        return stopped("llm-foundry prepare", "SIGINT", state)
    if ns.json:
        print(json.dumps(meta, indent=2))
    else:
        print(
            f"wrote {ns.out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
            f"({meta['dtype']}), {meta['tokenizer']} tokenizer with {meta['vocab_size']:,} "
            f"entries; source {meta['source']}"
        )
    return 0


def _check_flags(ns) -> None:
    """Flags out of range, or given where they do nothing: one line each."""
    sft = bool(ns.sft or ns.sft_demo)
    if not 0 < ns.val_fraction < 1:
        raise ValueError(f"--val-fraction {ns.val_fraction}: must be strictly between 0 and 1")
    if ns.rows is not None and not ns.sft_demo:
        raise ValueError("--rows is for --sft-demo (how many demonstration rows to make)")
    if ns.sft_demo and ns.rows is not None and ns.rows < 2:
        raise ValueError(f"--rows {ns.rows}: must be at least 2 (a train and a val row)")
    if sft and (ns.tokenizer is not None or ns.vocab_size is not None):
        flag = "--tokenizer" if ns.tokenizer is not None else "--vocab-size"
        raise ValueError(
            f"{flag} does not apply to --sft/--sft-demo: their tokens are those of the model's "
            "tokenizer (--tokenizer-from)"
        )
    if not sft and ns.tokenizer_from:
        raise ValueError(
            "--tokenizer-from is for --sft/--sft-demo; text prepare trains its tokenizer "
            "(--tokenizer, --vocab-size)"
        )
    if ns.vocab_size is not None and (ns.tokenizer or "char") != "bpe":
        raise ValueError(
            f"--vocab-size {ns.vocab_size} is for --tokenizer bpe; a char tokenizer's vocabulary "
            "is the corpus' characters"
        )
    from llm_foundry.tokenizer import MIN_BPE_VOCAB

    if ns.vocab_size is not None and ns.vocab_size < MIN_BPE_VOCAB:
        raise ValueError(
            f"--vocab-size {ns.vocab_size}: must be at least {MIN_BPE_VOCAB} (every byte and "
            "the special tokens)"
        )


def _prepare_sft(ns) -> int:
    from llm_foundry import lock
    from llm_foundry.data.sft import prepare_sft
    from llm_foundry.rundir import checkpoint_dir

    if not ns.tokenizer_from:
        raise ValueError("--sft needs --tokenizer-from: the tokenizer.json of the model to tune")
    tok = Path(ns.tokenizer_from)
    if tok.is_dir():
        tok = checkpoint_dir(tok, "--tokenizer-from") / "tokenizer.json"
    if not tok.is_file():
        raise FileNotFoundError(f"--tokenizer-from {ns.tokenizer_from}: no tokenizer.json there")
    if ns.sft_demo:
        with lock.hold(ns.out, "data directory", readers=True):
            rows = _demo_rows(ns)
            meta = prepare_sft(ns.out, rows, tok, ns.val_fraction)
    else:
        meta = prepare_sft(ns.out, ns.sft, tok, ns.val_fraction)
    if ns.json:
        print(json.dumps(meta, indent=2))
    else:
        print(
            f"wrote {ns.out}: {meta['train_examples']:,} train + {meta['val_examples']:,} val "
            f"examples ({meta['train_targets']:,} of {meta['train_tokens']:,} train tokens are "
            f"targets); tokenizer {tok}"
        )
    return 0


def _demo_rows(ns) -> str:
    """Write the demonstration rows made from --dataset / --text to OUT/rows.jsonl (the caller
    holds OUT's lock)."""
    from llm_foundry.data import load_shakespeare, read_text_files
    from llm_foundry.data.sft import OUTPUTS
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
    write_atomic(out / "rows.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return str(out / "rows.jsonl")
