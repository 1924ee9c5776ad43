"""``llm-foundry prepare``: a corpus into train.bin/val.bin, tokenizer.json and meta.json."""

from __future__ import annotations

import argparse
import json


def main(argv: list[str]) -> int:
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
    p.add_argument("--rows", type=int, default=2000, help="--sft-demo: how many rows")
    p.add_argument(
        "--tokenizer-from",
        metavar="PATH",
        help="use this tokenizer.json (or the one of a run / checkpoint directory) instead of "
        "training one; needed with --sft (the model's own tokenizer)",
    )
    p.add_argument("--tokenizer", choices=TOKENIZER_KINDS, default="char")
    p.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size")
    p.add_argument("--val-fraction", type=float, default=0.1, help="last fraction kept for val")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--json", action="store_true", help="print meta.json")
    ns = p.parse_args(argv)
    if ns.sft_demo:
        ns.sft = _demo_rows(ns)
    if ns.sft:
        return _prepare_sft(ns)
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


def _prepare_sft(ns) -> int:
    from pathlib import Path

    from llm_foundry.data.sft import prepare_sft
    from llm_foundry.rundir import checkpoint_dir

    if not ns.tokenizer_from:
        raise ValueError("--sft needs --tokenizer-from: the tokenizer.json of the model to tune")
    tok = Path(ns.tokenizer_from)
    if tok.is_dir():
        tok = checkpoint_dir(tok, "--tokenizer-from") / "tokenizer.json"
    if not tok.is_file():
        raise FileNotFoundError(f"--tokenizer-from {ns.tokenizer_from}: no tokenizer.json there")
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
    """Write the demonstration rows made from --dataset / --text to OUT/rows.jsonl."""
    from pathlib import Path

    from llm_foundry.data import load_shakespeare, read_text_files
    from llm_foundry.data.sft_demo import demo_rows

    if not (ns.dataset or ns.text):
        raise ValueError("--sft-demo needs the play to make rows from: --dataset or --text")
    text, _ = load_shakespeare() if ns.dataset else read_text_files(ns.text)
    rows = demo_rows(text, ns.rows)
    if not rows:
        raise ValueError("no speeches found (paragraphs starting with a 'NAME:' or 'NAME.' line)")
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(out / "rows.jsonl")
