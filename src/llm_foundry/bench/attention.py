"""Attention kernels side by side: ``manual_attention`` vs PyTorch SDPA, time and peak memory.

``models.attention.manual_attention`` spells attention out and materialises the (B, H, T, T) score
matrix; ``models.attention.sdpa_attention`` calls ``F.scaled_dot_product_attention`` (fused kernels:
flash on GPU and CPU, memory-efficient on GPU). For every attention kind (MHA, GQA, MQA: the number
of KV heads) and sequence length T, each implementation runs causal self-attention on random
q (B, H, T, hd), k and v (B, K, T, hd), and one row records:

  fwd_ms             forward under ``torch.no_grad()``, median of ``repeats`` timed calls
  fwd_bwd_ms         forward + ``torch.autograd.grad`` of the output w.r.t. q, k and v
  peak_*_bytes       extra memory the op needs above what is allocated before it (the inputs)
  max_abs_diff_*     largest |difference| of the output and of the q/k/v gradients from manual's

On CUDA, SDPA is also timed restricted to each backend (``sdpa:flash``, ``sdpa:efficient``,
``sdpa:math``, via ``torch.nn.attention.sdpa_kernel``); a backend that refuses the inputs is
recorded as "n/a". Peak memory (``MEMORY_METHOD`` says exactly what) is the caching allocator's
peak on CUDA; on CPU, which has no allocator statistics, it is the peak resident set size of a
fresh worker process per row. Sizes that would not fit are skipped (estimated need over the
budget) or recorded as out of memory, never crash the run; larger T of that row are skipped.
Ctrl-C or SIGTERM ends the run early with the rows measured so far (the report says it is
partial).

    python benchmarks/bench_attention.py --out runs/attention   # table, JSON and plot in runs/attention
"""

from __future__ import annotations

import gc
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from llm_foundry.bench.memory import (
    _is_oom,
    median_ms,
    memory_budget,
    peak_bytes,
    run_isolated,
)
from llm_foundry.models.attention import manual_attention, sdpa_attention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
IMPLS = ["manual", "sdpa"] + [f"sdpa:{b}" for b in BACKENDS]
MATERIALISES_SCORES = {"manual", "sdpa:math"}  # impls that hold (B, H, T, T) tensors
SCORE_COPIES = 4  # fp32 (B, H, T, T) buffers alive at manual's fwd+bwd peak: 3.2-3.8 on CPU
MEMORY_METHOD = {
    "cuda": "torch.cuda.max_memory_allocated() during the op minus torch.cuda.memory_allocated() "
    "just before it (after torch.cuda.reset_peak_memory_stats()): the bytes PyTorch's caching "
    "allocator handed out beyond the inputs (outputs, tensors saved for backward, gradients, "
    "kernel workspaces), in the benchmark's process after the warm-up calls.",
    "cpu": "peak resident set size during the op (Linux VmHWM, reset through "
    "/proc/self/clear_refs just before it) minus the resident set size just before it, in a "
    "fresh worker process per row, after the warm-up calls and gc.collect() + malloc_trim(0). "
    "The worker fixes glibc's mmap threshold at 64 KiB (mallopt), so every buffer of 64 KiB or "
    "more is its own mapping, unmapped when freed: the increase follows the live buffers beyond "
    "the inputs (outputs, tensors saved for backward, gradients, kernel scratch), rounded up to "
    "4 KiB pages, plus whatever malloc's heap grows by for smaller allocations.",
}
TIME_METHOD = (
    "wall time of one call (torch.cuda.synchronize before and after on GPU), median of the timed "
    "calls after the untimed warm-up calls, in the benchmark's own process with the default "
    "allocator; causal mask, no dropout."
)


def attention_kind(n_heads: int, n_kv_heads: int) -> str:
    """MHA (one KV head per query head), MQA (one KV head for all) or GQA (groups in between)."""
    if n_kv_heads == n_heads:
        return "MHA"
    return "MQA" if n_kv_heads == 1 else "GQA"


def valid_kv_heads(n_heads: int) -> list[int]:
    """KV-head counts that divide ``n_heads``: query head h reads KV head h // (H / K)."""
    return [k for k in range(1, n_heads + 1) if n_heads % k == 0]


def default_kv_heads(n_heads: int) -> list[int]:
    """MHA, a middle GQA grouping and MQA: 12, 4, 1 for 12 heads."""
    middle = valid_kv_heads(n_heads)[1:-1]
    return sorted({n_heads, 1, *middle[len(middle) // 2 : len(middle) // 2 + 1]}, reverse=True)


def attention_fn(impl: str):
    """(q, k, v) -> out for one implementation; ``sdpa:BACKEND`` holds SDPA to that backend."""
    if impl == "manual":
        return lambda q, k, v: manual_attention(q, k, v, None)[0]  # weights dropped on return
    if impl == "sdpa":
        return lambda q, k, v: sdpa_attention(q, k, v, None)[0]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, BACKENDS[impl.split(":")[1]])

    def restricted(q, k, v):
        with sdpa_kernel(backend):
            return sdpa_attention(q, k, v, None)[0]

    return restricted


# ----------------------------------------------------------------------------------------------
# One measurement: inputs, the two ops, peak memory, median time


def make_inputs(spec: dict):
    """q (B, H, T, hd), k and v (B, K, T, hd) requiring grad, and an output gradient (B, H, T, hd)."""
    gen = torch.Generator().manual_seed(spec["seed"])
    B, H, K, T, hd = (spec[n] for n in ("batch", "heads", "kv_heads", "seq_len", "head_dim"))
    shapes = [(B, H, T, hd), (B, K, T, hd), (B, K, T, hd), (B, H, T, hd)]
    dtype, device = DTYPES[spec["dtype"]], spec["device"]
    q, k, v, grad = (torch.randn(s, generator=gen).to(device, dtype) for s in shapes)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad


def forward(fn, q, k, v) -> torch.Tensor:
    with torch.no_grad():
        return fn(q, k, v)


def forward_backward(fn, q, k, v, grad):
    """The output (detached) and the gradients of <output, grad> w.r.t. q, k and v."""
    out = fn(q, k, v)
    return out.detach(), torch.autograd.grad(out, (q, k, v), grad)


def _unsupported_reason(err: BaseException, caught: list) -> str | None:
    """Why a restricted SDPA backend refused the inputs, from its warnings; None if it did not."""
    if not any(m in str(err) for m in ("No available kernel", "No viable backend")):
        return None
    reasons = [str(w.message).split("\n")[0].split(" (Triggered internally")[0] for w in caught]
    return "; ".join(reasons[:3]) or str(err).split("\n")[0]


def measure(spec: dict, what: str) -> dict:
    """Peak memory (``what="memory"``) or median time (``"time"``) of forward and
    forward+backward for one impl and size, after warm-up calls; or why it could not run."""
    torch.set_num_threads(spec["threads"])
    fn, device = attention_fn(spec["impl"]), spec["device"]
    q, k, v, grad = make_inputs(spec)
    ops = {
        "fwd": lambda: forward(fn, q, k, v),
        "fwd_bwd": lambda: forward_backward(fn, q, k, v, grad),
    }
    with warnings.catch_warnings(record=True) as caught:  # a refusing backend says why
        warnings.simplefilter("always")
        try:
            for _ in range(spec["warmup"]):
                for op in ops.values():
                    op()
            if what == "memory":
                return {f"peak_{n}_bytes": peak_bytes(op, device) for n, op in ops.items()}
            times = {n: median_ms(op, device, spec["repeats"]) for n, op in ops.items()}
            return {f"{n}_ms": float(f"{ms:.4g}") for n, ms in times.items()}
        except RuntimeError as err:  # torch.OutOfMemoryError is a RuntimeError
            if _is_oom(err):
                return {"status": "out of memory"}
            reason = _unsupported_reason(err, caught)
            if reason is None:
                raise
            return {"status": f"n/a: {reason}"}


# ----------------------------------------------------------------------------------------------
# Running measurements: CPU memory in a fresh process, the rest in place; skipping what cannot fit


def memory_isolated(spec: dict) -> dict:
    """``measure(spec, "memory")`` in a fresh worker process (see ``memory.run_isolated``)."""
    return run_isolated(measure, spec, "memory", preload="llm_foundry.bench.attention")


def measure_row(spec: dict) -> dict:
    """Peak memory, then (if it ran) time; on CUDA the caching allocator is emptied after."""
    cuda = spec["device"] == "cuda"
    result = measure(spec, "memory") if cuda else memory_isolated(spec)
    if "status" not in result:
        result |= measure(spec, "time")
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()  # leave the next row an unfragmented pool
    return result


def estimate_bytes(spec: dict) -> int:
    """A rough upper estimate of an op's extra memory, only to skip sizes that cannot fit."""
    B, H, T, hd = (spec[n] for n in ("batch", "heads", "seq_len", "head_dim"))
    io = 8 * B * H * T * hd * DTYPES[spec["dtype"]].itemsize  # outputs, gradients, K/V repeats
    if spec["impl"] in MATERIALISES_SCORES:
        return io + SCORE_COPIES * B * H * T * T * 4
    return io


def agreement(spec: dict, impls: list[str]) -> dict[str, dict]:
    """Max |difference| of each impl's output and q/k/v gradients from manual_attention's."""
    q, k, v, grad = make_inputs(spec)
    ref_out, ref_grads = forward_backward(attention_fn("manual"), q, k, v, grad)
    diffs = {}
    for impl in impls:
        out, grads = forward_backward(attention_fn(impl), q, k, v, grad)
        diffs[impl] = {
            "max_abs_diff_out": _max_diff(out, ref_out),
            "max_abs_diff_grad": max(
                _max_diff(a, b) for a, b in zip(grads, ref_grads, strict=True)
            ),
        }
    return diffs


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(f"{(a.float() - b.float()).abs().max().item():.3g}")


# ----------------------------------------------------------------------------------------------
# The benchmark: every (KV heads, T, impl), ratios to manual, report


def empty_row(kind: str, n_kv: int, T: int, impl: str, status: str) -> dict:
    keys = ("fwd_ms", "fwd_bwd_ms", "peak_fwd_bytes", "peak_fwd_bwd_bytes")
    keys += ("max_abs_diff_out", "max_abs_diff_grad", "manual_over_this")
    row = dict(attention=kind, kv_heads=n_kv, seq_len=T, impl=impl, status=status)
    return row | dict.fromkeys(keys)


def skip_reason(spec: dict, budget: int, failed_at: dict) -> str | None:
    """Why not to run this row: out of memory at a smaller T, or too big an estimated need."""
    if (spec["impl"], spec["kv_heads"]) in failed_at:
        return f"skipped: out of memory at T={failed_at[spec['impl'], spec['kv_heads']]}"
    need = estimate_bytes(spec)
    if need > budget:
        return f"skipped: would need ~{need / 2**30:.1f} GiB (budget {budget / 2**30:.1f} GiB)"
    return None


def run_rows(args, bar, rows: list[dict]) -> None:
    """Measure every impl at every (KV heads, T) into ``rows`` (each row appended once measured,
    so an interrupt leaves the finished ones); after an out-of-memory, larger T is skipped."""
    budget = int(args.max_mem_gib * 2**30) if args.max_mem_gib else memory_budget(args.device)
    base = dict(batch=args.batch, heads=args.heads, head_dim=args.head_dim, dtype=args.dtype)
    base |= dict(device=args.device, repeats=args.repeats, warmup=args.warmup, seed=0)
    base["threads"] = torch.get_num_threads()
    failed_at = {}
    for n_kv in args.kv_heads:
        kind = attention_kind(args.heads, n_kv)
        for T in args.seq_lens:
            here = []
            for impl in args.impls:
                bar.set_postfix_str(f"{kind} T={T} {impl}")
                spec = dict(base, kv_heads=n_kv, seq_len=T, impl=impl)
                reason = skip_reason(spec, budget, failed_at)
                row = empty_row(kind, n_kv, T, impl, reason or "ok")
                row |= {} if reason else measure_row(spec)
                if row["status"].startswith("out of memory"):
                    failed_at[impl, n_kv] = T
                here.append(row)
                rows.append(row)
                bar.update()
            add_agreement(here, dict(base, kv_heads=n_kv, seq_len=T))


def add_agreement(rows: list[dict], spec: dict) -> None:
    """Fill max_abs_diff_* of the measured non-manual rows when manual was measured too."""
    ok = [r["impl"] for r in rows if r["status"] == "ok"]
    others = [impl for impl in ok if impl != "manual"]
    if "manual" not in ok or not others:
        return
    diffs = agreement(spec, others)
    for row in rows:
        row |= diffs.get(row["impl"], {})
    if spec["device"] == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def add_ratios(rows: list[dict]) -> None:
    """manual_over_this: manual's time and memory over this row's, at the same kind and T."""
    manual = {(r["kv_heads"], r["seq_len"]): r for r in rows if r["impl"] == "manual"}
    for row in rows:
        ref = manual.get((row["kv_heads"], row["seq_len"]))
        if row["status"] != "ok" or ref is None or ref["status"] != "ok":
            continue
        row["manual_over_this"] = {
            key: _ratio(ref[key], row[key])
            for key in ("fwd_ms", "fwd_bwd_ms", "peak_fwd_bytes", "peak_fwd_bwd_bytes")
        }


def _ratio(a, b) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return round(a / b, 2)


def machine(device: str) -> dict:
    info = dict(
        platform=platform.platform(),
        cpu=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        python=platform.python_version(),
        torch=torch.__version__,
    )
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def bench(
    args, argv: list[str], prog: str = "bench_attention.py", signals: list[str] | None = None
) -> dict:
    """The report: settings, machine, methods and one row per (KV heads, T, impl). An interrupt
    ends it early: ``stopped_by`` then names the signal (the first of ``signals``, where the
    caller records one it turned into a KeyboardInterrupt, such as SIGTERM; else SIGINT) and
    ``rows`` holds the rows measured before it (``rows_planned``: how many the whole run has)."""
    total = len(args.kv_heads) * len(args.seq_lens) * len(args.impls)
    rows, stopped_by = [], None
    with tqdm(total=total, desc="attention", unit="run", file=sys.stderr) as bar:
        try:
            run_rows(args, bar, rows)
        except KeyboardInterrupt:
            stopped_by = (signals or ["SIGINT"])[0]
    add_ratios(rows)
    settings = {k: getattr(args, k) for k in ("batch", "heads", "head_dim", "kv_heads")}
    settings |= {k: getattr(args, k) for k in ("seq_lens", "impls", "device", "dtype")}
    settings |= {k: getattr(args, k) for k in ("repeats", "warmup", "max_mem_gib")}
    return dict(
        date=time.strftime("%Y-%m-%d"),
        # as it was run: the command line's subcommand, or the script in a clone
        command=" ".join(
            [prog if prog.startswith("llm-foundry") else f"python benchmarks/{prog}", *argv]
        ),  # fmt: skip
        machine=machine(args.device),
        settings=settings,
        time_method=TIME_METHOD,
        memory_method=MEMORY_METHOD[args.device],
        stopped_by=stopped_by,
        rows_planned=total,
        rows=rows,
    )


def partial_note(report: dict) -> str:
    """'' for a whole run; else what an interrupted one holds: "partial: stopped by SIGINT after
    3 of 12 rows"."""
    if not report.get("stopped_by"):
        return ""
    done, planned = len(report["rows"]), report["rows_planned"]
    return f"partial: stopped by {report['stopped_by']} after {done} of {planned} rows"


# ----------------------------------------------------------------------------------------------
# Output: markdown table, plot


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def markdown(report: dict) -> str:
    s = report["settings"]
    note = partial_note(report)
    head = (
        f"# Attention: manual vs SDPA, {s['device']} {s['dtype']}"
        f"{f' ({note})' if note else ''}\n\n"
        f"{report['date']}, `{report['command']}`; {report['machine']['cpu']}, "
        f"{report['machine']['threads']} threads, torch {report['machine']['torch']}"
        f"{', ' + report['machine']['gpu'] if 'gpu' in report['machine'] else ''}. "
        f"Batch {s['batch']}, {s['heads']} query heads, head_dim {s['head_dim']}, causal.\n\n"
        f"Time: {report['time_method']} fwd: forward under torch.no_grad(); fwd+bwd: forward and "
        f"the gradients of q, k and v. Repeats: {s['repeats']}, warm-up calls: {s['warmup']}.\n\n"
        f"Peak memory (MiB): {report['memory_method']}\n\n"
        "manual / this: manual_attention's time or peak memory over this row's (> 1: this row "
        "is faster or smaller). Max abs diff: of the output and of the q/k/v gradients, vs "
        "manual_attention on the same inputs.\n\n"
    )
    cols = ["attention", "KV heads", "T", "impl", "fwd ms", "fwd+bwd ms", "peak fwd MiB"]
    cols += ["peak fwd+bwd MiB", "manual/this fwd", "manual/this fwd+bwd"]
    cols += ["manual/this peak fwd", "manual/this peak fwd+bwd", "max abs diff out, grad", "status"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in report["rows"]:
        ratio = r["manual_over_this"] or {}
        cells = [r["attention"], r["kv_heads"], r["seq_len"], f"`{r['impl']}`"]
        cells += [_num(r["fwd_ms"], ".3f"), _num(r["fwd_bwd_ms"], ".3f")]
        cells += [_mib(r["peak_fwd_bytes"]), _mib(r["peak_fwd_bwd_bytes"])]
        cells += [_num(ratio.get(k), ".2f") for k in ("fwd_ms", "fwd_bwd_ms")]
        cells += [_num(ratio.get(k), ".2f") for k in ("peak_fwd_bytes", "peak_fwd_bwd_bytes")]
        diffs = (r["max_abs_diff_out"], r["max_abs_diff_grad"])
        cells += ["-" if None in diffs else f"{diffs[0]:.1e}, {diffs[1]:.1e}", r["status"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return head + "\n".join(lines) + "\n"


def _points(rows: list[dict], key: str) -> tuple[list, list]:
    """(T values, key values) of the measured rows; bytes in MiB; log axes drop zeros."""
    pts = [(r["seq_len"], r[key]) for r in rows if r["status"] == "ok" and (r[key] or 0) > 0]
    scale = 2**-20 if key.startswith("peak") else 1
    return [t for t, _ in pts], [y * scale for _, y in pts]


def plot(report: dict, path: Path) -> Path:
    """Log-log time and peak memory against T, one line per impl x attention kind
    (solid: forward+backward, dashed: forward)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 5), dpi=100)
    markers = dict(MHA="o", GQA="s", MQA="^")
    colors = {impl: f"C{i}" for i, impl in enumerate(IMPLS)}
    panels = {ax_t: ("fwd_bwd_ms", "fwd_ms"), ax_m: ("peak_fwd_bwd_bytes", "peak_fwd_bytes")}
    series = sorted({(r["impl"], r["kv_heads"], r["attention"]) for r in report["rows"]})
    for impl, n_kv, kind in series:
        rows = [r for r in report["rows"] if (r["impl"], r["kv_heads"]) == (impl, n_kv)]
        style = dict(color=colors[impl], marker=markers[kind], ms=5)
        label = f"{impl} {kind} (K={n_kv})"
        for ax, (solid, dashed) in panels.items():
            for key, ls, name in ((solid, "-", label), (dashed, "--", None)):
                xs, ys = _points(rows, key)
                if xs:
                    ax.plot(xs, ys, ls=ls, label=name, **style)
    s = report["settings"]
    for ax, ylabel in ((ax_t, "time per call (ms)"), (ax_m, "peak extra memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(s["seq_lens"], [str(t) for t in s["seq_lens"]])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # only the measured T
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
    ax_t.set_title("time: solid fwd+bwd, dashed fwd")
    ax_m.set_title("peak memory: solid fwd+bwd, dashed fwd")
    if ax_m.get_legend_handles_labels()[0]:  # nothing to label when every row was skipped
        ax_m.legend(fontsize=7, loc="upper left")
    note = partial_note(report)
    fig.suptitle(
        f"attention, {s['device']} {s['dtype']}, batch {s['batch']}, {s['heads']} heads x "
        f"{s['head_dim']}, causal{f' ({note})' if note else ''}"
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# the files --out DIR receives
OUT_FILES = dict(
    markdown="attention_bench.md", json="attention_bench.json", plot="attention_bench.png"
)


def write_outputs(report: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {what: out / name for what, name in OUT_FILES.items()}
    paths["markdown"].write_text(markdown(report))
    paths["json"].write_text(json.dumps(report, indent=2) + "\n")
    plot(report, paths["plot"])
    return paths


# ----------------------------------------------------------------------------------------------
# Command line
