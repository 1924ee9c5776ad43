"""``llm-foundry bench attention``: manual attention vs SDPA, time and peak memory (the
measurement is ``llm_foundry.bench.attention``; ``benchmarks/bench_attention.py`` runs it too)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from llm_foundry.bench.attention import (
    DTYPES,
    IMPLS,
    OUT_FILES,
    bench,
    default_kv_heads,
    markdown,
    valid_kv_heads,
    write_outputs,
)
from llm_foundry.cli.options import SettingsParser, at_least_one
from llm_foundry.cli.signals import stopped, terminate_as_interrupt
from llm_foundry.messages import shown

BENCHMARKS = ["attention"]  # `llm-foundry bench NAME`
# an --out ending so is a file name given for the directory: refused, not made a directory
FILE_SUFFIXES = (".md", ".json", ".png")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str], prog: str = "bench_attention.py") -> argparse.Namespace:
    """The options, checked; a usage error raises ``argparse.ArgumentError`` (one line)."""
    ap = SettingsParser(
        prog=prog,
        description="Manual attention vs SDPA: time and peak memory for each sequence length "
        "and KV-head count (MHA, GQA, MQA).",
    )
    ap.add_argument(
        "--seq-lens",
        type=_int_list,
        default=[256, 512, 1024, 2048, 4096],
        help="sequence lengths T, comma-separated (default: 256,512,1024,2048,4096; minutes on "
        "a CPU, fp16 slower there)",
    )
    ap.add_argument("--batch", type=at_least_one, default=1)
    ap.add_argument("--heads", type=at_least_one, default=12, help="query heads H")
    ap.add_argument("--head-dim", type=at_least_one, default=64)
    ap.add_argument(
        "--kv-heads",
        type=_int_list,
        default=None,
        help="KV head counts, each dividing --heads (default: MHA, GQA, MQA, e.g. 12,4,1)",
    )
    ap.add_argument(
        "--impls",
        type=_str_list,
        default=None,
        help=f"subset of {','.join(IMPLS)} (default: manual,sdpa on CPU; all on CUDA)",
    )
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument(
        "--dtype", choices=list(DTYPES), default=None, help="default: fp32 on CPU, bf16 on CUDA"
    )
    ap.add_argument(
        "--repeats",
        type=at_least_one,
        default=None,
        help="timed calls per op, median (default: 5 on CPU, 20 on CUDA)",
    )
    ap.add_argument(
        "--warmup",
        type=at_least_one,
        default=None,
        help="untimed calls per op first, >= 1 (default: 1 on CPU, 3 on CUDA)",
    )
    ap.add_argument(
        "--max-mem-gib",
        type=float,
        default=None,
        help="skip rows estimated above this (default: 80%% of the memory free at the start)",
    )
    ap.add_argument("--json", action="store_true", help="print the JSON report on stdout")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"a directory (made if missing) to write {', '.join(OUT_FILES.values())} in",
    )
    args = ap.parse_args(argv)
    check_args(ap, args)
    return args


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill defaults that depend on other options and refuse values that cannot run."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available (use --device cpu or auto)")
    cuda = args.device == "cuda"
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.repeats = (20 if cuda else 5) if args.repeats is None else args.repeats
    args.warmup = (3 if cuda else 1) if args.warmup is None else args.warmup
    valid = valid_kv_heads(args.heads)
    args.kv_heads = args.kv_heads or default_kv_heads(args.heads)
    bad = [k for k in args.kv_heads if k not in valid]
    if bad:
        ap.error(
            f"--kv-heads {','.join(map(str, bad))}: each must divide --heads {args.heads}; "
            f"valid values: {', '.join(map(str, valid))}"
        )
    if args.max_mem_gib is not None and args.max_mem_gib <= 0:
        ap.error(f"--max-mem-gib must be > 0, got {args.max_mem_gib}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        ap.error(f"--out {args.out} is a file; give a directory for the table, JSON and plot")
    if args.out is not None and not args.out.is_dir() and args.out.suffix in FILE_SUFFIXES:
        ap.error(
            f"--out {args.out} names a file; --out is a directory, which gets "
            f"{', '.join(OUT_FILES.values())}: give a directory (e.g. {args.out.with_suffix('')})"
        )
    args.impls = args.impls or (IMPLS if args.device == "cuda" else ["manual", "sdpa"])
    bad = [i for i in args.impls if i not in IMPLS]
    if bad:
        ap.error(f"--impls {','.join(bad)}: unknown; valid values: {', '.join(IMPLS)}")


def attention_main(argv: list[str] | None = None, prog: str = "bench_attention.py") -> int:
    """The attention benchmark: ``benchmarks/bench_attention.py`` and ``bench attention``."""
    argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    try:
        args = parse_args(argv, prog)
    except argparse.ArgumentError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    with terminate_as_interrupt() as signals:  # SIGTERM keeps the rows measured, as Ctrl-C
        report = bench(args, argv, prog, signals)
    paths = write_outputs(report, args.out) if args.out and report["rows"] else {}
    if report["stopped_by"]:  # one line; the rows measured are kept in --out, marked partial
        done = f"{len(report['rows'])} of {report['rows_planned']} rows measured"
        kept = f"written to {args.out} (marked partial)" if paths else "nothing written"
        return stopped(prog, report["stopped_by"], f"{done}; {kept}")
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(markdown(report))
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def main(argv: list[str]) -> int:
    prog = "llm-foundry bench"
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: {prog} NAME [options]  (NAME: {', '.join(BENCHMARKS)}; options: "
              f"{prog} attention -h)")  # fmt: skip
        return 0
    if not argv or argv[0] not in BENCHMARKS:
        given = f"unknown benchmark {shown(argv[0])}" if argv else "no benchmark given"
        print(f"{prog}: error: {given}; valid: {', '.join(BENCHMARKS)} "
              f"(options: {prog} attention -h)", file=sys.stderr)  # fmt: skip
        return 2
    return attention_main(argv[1:], prog=f"{prog} {argv[0]}")
