"""``llm-foundry eval``: loss and perplexity per context length, of any checkpoint kind; or, with
``--tasks``, tasks of the EleutherAI evaluation harness (the shipped local ones, or any of its
registry when the datasets can be downloaded)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from llm_foundry.evaluate import (
    check_data_tokenizer,
    evaluate_tokens,
    rope_scaling_note,
    with_rope_scaling,
)
from llm_foundry.rundir import trained_block_size


def _prepared(given: str) -> tuple[Path, Path, dict]:
    """--data ``given``: (its path, the prepared directory it is or is in, that one's meta.json)."""
    from llm_foundry.data import DataError, load_meta
    from llm_foundry.data.corpus import file_format

    path = Path(given)
    where = path if path.is_dir() else path.parent
    if not (where / "meta.json").is_file():
        if path.is_file() and file_format(path) == "txt":  # scored as it is, by the model's own
            raise DataError(f"--data {given} is a text file, not a directory `llm-foundry prepare` "
                            f"wrote: give it as --text {given} (encoded with the model's "
                            "tokenizer)")  # fmt: skip
        from llm_foundry.data.rows import rows_advice

        if path.is_file() and (rows := rows_advice(path, "CHECKPOINT")):  # fine-tuning rows
            raise DataError(f"--data {given} {rows}")
        if path.is_file() and file_format(path) is not None:  # documents: tokenized as trained
            raise DataError(f"--data {given} is a file of documents, not a directory `llm-foundry "
                            f"prepare` wrote; make one with the model's tokenizer: `llm-foundry "
                            f"prepare --input {given} --tokenizer-from CHECKPOINT --out DIR`")  # fmt: skip
        from llm_foundry.data.shard_writer import PROGRESS_FILE

        if (where / PROGRESS_FILE).is_file():
            raise DataError(f"--data {given}: no {where / 'meta.json'}: its `llm-foundry prepare` "
                            "was interrupted; run the same prepare command again to finish it")  # fmt: skip
        raise DataError(
            f"--data {given}: no {where / 'meta.json'}: not data written by `llm-foundry "
            "prepare`; make it with the model's tokenizer: `llm-foundry prepare --input FILES "
            "--tokenizer-from CHECKPOINT --out DIR` (or give a text file as --text)"
        )
    return path, where, load_meta(where)


def _bar(what: str):
    """A progress callback drawing a bar of windows scored on stderr (off a terminal too, as
    prepare's and train's: a long eval of a real corpus's val split is not silent in a log)."""
    from tqdm import tqdm

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=f"eval {what}", unit="window", leave=False,
                       file=sys.stderr)  # fmt: skip
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update


def _load_tokens(ns, tok, ckpt: Path, data: tuple | None) -> tuple[np.ndarray, str]:
    if ns.text:
        if tok is None:
            raise FileNotFoundError(
                f"--text needs a tokenizer; {ckpt / 'tokenizer.json'} does not exist"
            )
        if not Path(ns.text).is_file():
            raise FileNotFoundError(f"--text {ns.text}: no such file")
        text = Path(ns.text).read_text(encoding="utf-8")
        return np.array(tok.encode(text), dtype=np.int64), ns.text
    from llm_foundry.data import split_stream
    from llm_foundry.data.batches import open_token_file

    path = data[0]
    if path.is_dir():  # a prepared directory: its validation split, every shard in order
        return np.asarray(split_stream(path, "val")), f"{path} (val)"
    return np.asarray(open_token_file(path)), str(path)


def past_trained_note(context: int, max_seq_len: int, block: int | None, pos: str) -> str | None:
    """The note on a ``context`` past what the model was trained at: its max_seq_len, or the
    windows of ``block`` tokens it was trained on (None: within both)."""
    if context > max_seq_len and pos == "learned":
        return None  # it cannot run there at all: its row says so
    if context > max_seq_len:
        return (f"note: context {context} is past the model's max_seq_len {max_seq_len}: "
                "positions it was never trained at (extrapolation)")  # fmt: skip
    if block is not None and context > block:
        never = "rows of its learned position table" if pos == "learned" else f"{pos} positions"
        return (f"note: context {context} is past the trained context {block} (the model was "
                f"trained on windows of {block} tokens): {never} {block}..{context - 1} were "
                "never trained, and quality may drop")  # fmt: skip
    return None


# prepared data of fine-tuning examples, by meta.json's kind: what it holds
EXAMPLES = {"sft": "fine-tuning examples (prompts and completions)",
            "preference": "preference pairs (a prompt with its chosen and rejected completion)"}  # fmt: skip

# the flags of each way of evaluating, and what each is about: the other's are refused
HARNESS_FLAGS = {"limit": "--limit", "num_fewshot": "--num-fewshot",
                 "include_path": "--include-path", "out": "--out"}  # fmt: skip
PERPLEXITY_FLAGS = {"context": "--context", "stride": "--stride", "max_windows": "--max-windows",
                    "rope_scaling": "--rope-scaling", "rope_factor": "--rope-factor"}  # fmt: skip


def check_flags(ns) -> None:
    """Refuse, before anything loads, flags the chosen evaluation would not use and values no
    run can take, naming the flags."""
    if ns.tasks is None:
        given = [flag for name, flag in HARNESS_FLAGS.items() if getattr(ns, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} apply to --tasks (lm-eval) only; for --data or "
                             "--text, --json prints the table as JSON (--json > FILE)")  # fmt: skip
    else:
        given = [flag for name, flag in PERPLEXITY_FLAGS.items() if getattr(ns, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} apply to --data / --text (perplexity per "
                             "context) only, not to --tasks")  # fmt: skip
    for name, low in (("stride", 1), ("batch_size", 1), ("max_windows", 1)):
        value = getattr(ns, name)
        if value is not None and value < low:
            raise ValueError(f"--{name.replace('_', '-')} {value} must be >= {low}")
    if ns.rope_factor is not None and not ns.rope_factor >= 1:
        raise ValueError(f"--rope-factor {ns.rope_factor} must be >= 1 (the context's extension)")


def format_table(rows: list[dict]) -> str:
    lines = [f"{'context':>8} {'stride':>7} {'loss':>8} {'ppl':>9} {'tokens':>10}", "-" * 46]
    for r in rows:
        stride = r["stride"] or "-"
        if r.get("status") == "cannot run":
            lines.append(f"{r['context']:>8} {stride:>7}   cannot run: {r['reason']}")
        else:
            lines.append(
                f"{r['context']:>8} {stride:>7} {r['loss']:>8.4f} {r['ppl']:>9.3f} "
                f"{r['scored_tokens']:>10,}"
            )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from llm_foundry.loading import load_any

    p = argparse.ArgumentParser(
        prog="llm-foundry eval",
        allow_abbrev=False,  # exact option names: a prefix could mean another option
        description="Loss and perplexity per context length (non-overlapping or sliding "
        "windows) on --data or --text; or lm-eval tasks with --tasks.",
    )
    p.add_argument(
        "--checkpoint", required=True, help="checkpoint, run or HF transformers directory"
    )
    p.add_argument("--adapter", default=None, metavar="DIR", help="a LoRA adapter to merge into "
                   "the model first: a PEFT adapter directory, or a LoRA run of ours")  # fmt: skip
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="a directory written by prepare (its validation split, "
                     "every shard) or one of its token files (e.g. data/x/train_00003.bin)")  # fmt: skip
    src.add_argument("--text", help="a UTF-8 text file, encoded with the checkpoint's tokenizer")
    src.add_argument(
        "--tasks",
        help="comma-separated lm-eval tasks: the local shakespeare (group), "
        "shakespeare_next_line, shakespeare_passages, shakespeare_next_speaker, or any task of "
        "the harness's registry (needs its datasets); needs the [eval] extra (lm-eval)",
    )
    harness = p.add_argument_group("with --tasks")
    harness.add_argument("--limit", type=float, default=None, help="at most N documents a task")
    harness.add_argument("--num-fewshot", type=int, default=None)
    harness.add_argument("--include-path", default=None, help="a directory of more task YAMLs")
    harness.add_argument("--out", default=None, help="write the harness's results JSON here")
    p.add_argument("--context", default=None, help="comma-separated context lengths (default: "
                   "the windows the model was trained on, train.block_size in its checkpoint's "
                   "state.json, else its max_seq_len: past those windows it scores positions it "
                   "never trained at); a perplexity depends on its context, so compare models "
                   "at one --context")  # fmt: skip
    p.add_argument("--stride", type=int, default=None, help="sliding windows with this stride")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-windows", type=int, default=None, help="evaluate at most N windows")
    p.add_argument("--rope-scaling", choices=["linear", "ntk"], default=None,
                   help="evaluate a RoPE model with its positions scaled, same weights, to reach "
                   "past its trained context: linear (position interpolation, Chen et al. 2023) "
                   "or ntk (NTK-aware: a larger base); replaces the model's own scaling (an HF "
                   "model's rope_scaling), a note says so; needs --rope-factor")  # fmt: skip
    p.add_argument("--rope-factor", type=float, default=None, metavar="F",
                   help="the context extension factor of --rope-scaling (2: twice the context)")  # fmt: skip
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    check_flags(ns)
    if ns.tasks is not None:
        return run_tasks(ns)
    try:
        contexts = [int(c) for c in ns.context.split(",")] if ns.context is not None else None
    except ValueError:
        raise ValueError(f"--context takes integers like 256,512; got {ns.context!r}") from None
    bad = [c for c in contexts or () if c < 1]
    if bad:
        raise ValueError(f"--context {ns.context}: {bad[0]} is not a context; each must be >= 1")
    if ns.stride is not None and contexts and ns.stride > min(contexts):
        raise ValueError(f"--stride {ns.stride} is longer than --context {min(contexts)}: a "
                         f"stride must be in [1, the shortest context]")  # fmt: skip
    if ns.rope_factor is not None and not ns.rope_scaling:
        raise ValueError("--rope-factor needs --rope-scaling linear|ntk (it scales nothing alone)")
    if ns.data and not Path(ns.data).exists():  # before the model loads: a mistyped path
        raise FileNotFoundError(f"--data {ns.data}: no such file or directory")
    model, tok, info = load_any(ns.checkpoint, adapter=ns.adapter)
    data = _prepared(ns.data) if ns.data else None
    vocab = model.cfg.vocab_size
    ckpt = info.checkpoint
    # refused here, before any window is scored; a note when nothing can be compared
    checked = (
        check_data_tokenizer(f"--data {ns.data}", *data[1:], ckpt, tok, vocab) if data else None
    )
    notes = [checked] if checked else []
    kind = data[2].get("kind") if data else None
    if kind in EXAMPLES:  # scored as a stream all the same: said, not refused
        notes.append(f"note: --data {ns.data} holds {EXAMPLES[kind]}: eval scores its tokens as "
                     "one stream (prompts included, across examples), not the fine-tune's val "
                     "loss (completion tokens only, in its metrics.jsonl)")  # fmt: skip
    for note in [info.merged_note(), *notes]:
        if note and not ns.json:
            print(note)
    trained = model.cfg.max_seq_len
    block = trained_block_size(ckpt)
    context_default = contexts is None
    if context_default:  # the windows the model was trained on: what its val loss measured
        contexts = [block or trained]
    if ns.rope_scaling:
        if ns.rope_factor is None:
            raise ValueError("--rope-scaling needs --rope-factor F (e.g. 2 for twice the context)")
        if model.cfg.pos_encoding != "rope":
            raise ValueError(f"--rope-scaling {ns.rope_scaling}: {ckpt} has {model.cfg.pos_encoding} "
                             "positions; only a RoPE model's positions can be scaled")  # fmt: skip
        replaced = rope_scaling_note(model.cfg, ns.rope_scaling, ns.rope_factor)
        if replaced:
            notes.append(replaced)
            if not ns.json:
                print(replaced)
        model = with_rope_scaling(model, ns.rope_scaling, ns.rope_factor)
    tokens, source = _load_tokens(ns, tok, ckpt, data)
    top = int(tokens.max()) if len(tokens) else 0
    if top >= model.cfg.vocab_size:
        raise ValueError(
            f"{source} holds token id {top}, past the model's vocab_size {model.cfg.vocab_size}: "
            "it was tokenized with another tokenizer than the one the model was trained with"
        )
    short = [c for c in contexts if len(tokens) < c + 1]
    if short:
        default = "the windows it was trained on" if block else "the model's max_seq_len"
        why = f" (the default: {default})" if context_default else ""
        fits = (
            f"give --context N with N at most {len(tokens) - 1:,}, or " if len(tokens) > 1 else ""
        )
        raise ValueError(
            f"{source}: {len(tokens):,} tokens are fewer than one window of context + 1 = "
            f"{short[0] + 1:,} at context {short[0]:,}{why}: {fits}give a longer text"
        )
    past = [past_trained_note(c, trained, block, model.cfg.pos_encoding) for c in contexts
            if not ns.rope_scaling]  # fmt: skip
    past = [note for note in past if note]
    notes += past
    for note in past if not ns.json else ():
        print(note)
    rows = [
        evaluate_tokens(
            model,
            tokens,
            c,
            ns.stride,
            ns.batch_size,
            ns.max_windows,
            progress=_bar(f"context {c}"),
        )  # fmt: skip
        for c in contexts
    ]
    report = dict(
        checkpoint=str(ckpt),
        adapter=ns.adapter,
        merged=info.merged_note(),
        source=source,
        rope_scaling=ns.rope_scaling,
        rope_factor=ns.rope_factor,
        trained_context=trained,
        trained_block_size=block,
        context_default=context_default,
        notes=notes,
        results=rows,
    )
    if ns.json:
        print(json.dumps(report, indent=2))
    else:
        windows = f", trained on windows of {block}" if block else ""
        print(f"{ckpt} on {source} (max_seq_len {trained}{windows})")
        if context_default:
            why = "the windows it was trained on" if block else "the model's max_seq_len"
            print(f"context {contexts[0]} by default ({why}); --context N,M for others (the "
                  "same for every model compared)")  # fmt: skip
        print(format_table(rows))
    return 0


def run_tasks(ns) -> int:
    """``eval --tasks``: the harness runs the tasks on our model; prints its table."""
    from llm_foundry.harness import evaluate_tasks  # MissingExtra without the [eval] extra

    tasks = [t.strip() for t in ns.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks is empty: name at least one task (e.g. shakespeare)")
    if ns.limit is not None and ns.limit <= 0:
        raise ValueError(f"--limit {ns.limit:g} must be > 0 (a count, or a fraction below 1)")
    results = evaluate_tasks(
        ns.checkpoint,
        tasks,
        batch_size=ns.batch_size,
        limit=int(ns.limit) if ns.limit and ns.limit >= 1 else ns.limit,
        num_fewshot=ns.num_fewshot,
        include_path=ns.include_path,
        adapter=ns.adapter,
    )
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(results, indent=2, default=str))
    if ns.json:
        print(json.dumps({"results": results["results"]}, indent=2, default=str))
    else:
        from lm_eval.utils import make_table

        print(make_table(results))
    return 0
