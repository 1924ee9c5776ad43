"""Which kernel reads quantized weights fastest for one decoded token: the choice behind
``models/quant.py``, measured side by side on the projections of the 124.7M LLaMA config
(12 layers of wq/wk/wv/wo/w1/w2/w3 and a 32000-row head: 124.5M weights, too large for cache).

For each candidate, the time of one row through every projection (median of rounds), the
weight bytes read and the bandwidth that makes; the fp32 ``F.linear`` row is the reference.
Candidates: fp32 (BLAS gemv, and our compiled multiply-and-sum); int8 widened to fp32 per call
("dequantize then matmul"), ``torch._weight_int8pack_mm`` with fp32 and with bf16 activations,
our fused compiled int8 matvec; int4 ``_weight_int4pack_mm_for_cpu`` with fp32 and bf16
activations, a compiled int4 multiply-and-sum; and torchao's int8/int4 weight-only configs when
torchao is importable (it is not a dependency: `pip install torchao --no-deps`).

    python benchmarks/bench_quant_kernels.py [--json] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from llm_foundry.bench import cpu_model
from llm_foundry.models.linear import matvec
from llm_foundry.models.quant import Int4Linear, Int8Linear

D, H, KV, V, LAYERS = 768, 2048, 256, 32000, 12
SHAPES = [(D, D), (KV, D), (KV, D), (D, D), (H, D), (D, H), (H, D)] * LAYERS + [(V, D)]


def timed(fn, rounds: int) -> float:
    fn()
    fn()  # warm-up (and compilation)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.no_grad()
def candidates() -> dict:
    torch.manual_seed(0)
    lins = [torch.nn.Linear(i, o, bias=False) for o, i in SHAPES]
    q8 = [Int8Linear.from_linear(lin) for lin in lins]
    q4 = [Int4Linear.from_linear(lin, 64) for lin in lins]
    for q in q4:
        q.kernel_weights()
    x = {i: torch.randn(1, i) for i in (D, H)}
    xb = {i: v.bfloat16() for i, v in x.items()}
    fp_bytes = sum(o * i * 4 for o, i in SHAPES)
    i8_bytes = sum(q.weight_bytes() for q in q8)
    i4_bytes = sum(q.weight_bytes() for q in q4)
    mv = torch.compile(matvec, dynamic=False)

    @torch.compile(dynamic=False)
    def fused8(x, q, s):
        return matvec(x, q) * s

    @torch.compile(dynamic=False)
    def fused4(x, packed, scale, zero):  # q - 8 times scale plus zero, summed per group
        out, groups = scale.shape
        xg = x.reshape(1, 1, groups, -1)
        half = xg.shape[-1] // 2
        lo = (xg[..., 0::2] * (packed.reshape(out, groups, half) & 15)).sum(-1)
        hi = (xg[..., 1::2] * (packed.reshape(out, groups, half) >> 4)).sum(-1)
        return ((lo + hi - 8 * xg.sum(-1)) * scale.float() + xg.sum(-1) * zero.float()).sum(-1)

    def each(fn, mods):
        return lambda: [fn(m) for m in mods]

    rows = {
        "fp32 F.linear (BLAS gemv)": (each(lambda m: F.linear(x[m.in_features], m.weight), lins), fp_bytes),
        "fp32 compiled multiply-and-sum": (each(lambda m: mv(x[m.in_features], m.weight), lins), fp_bytes),
        "int8 widened to fp32, then F.linear": (
            each(lambda q: F.linear(x[q.in_features], q.dequantized()), q8), i8_bytes),
        "int8 _weight_int8pack_mm, fp32 activations": (
            each(lambda q: torch._weight_int8pack_mm(x[q.in_features], q.kernel_weights()[0], q.scales), q8), i8_bytes),
        "int8 _weight_int8pack_mm, bf16 activations": (each(lambda q: q(x[q.in_features]), q8), i8_bytes),
        "int8 compiled fused matvec (ours, fp32 activations)": (
            each(lambda q: fused8(x[q.in_features], q.qweight, q.scales), q8), i8_bytes),
        "int4 _weight_int4pack_mm_for_cpu, fp32 activations": (
            each(lambda q: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x[q.in_features], q.kernel_weights()[0], q.group, q.kernel_weights()[1].float()), q4), i4_bytes),
        "int4 _weight_int4pack_mm_for_cpu, bf16 activations (ours)": (
            each(lambda q: q(x[q.in_features]), q4), i4_bytes),
        "int4 compiled multiply-and-sum": (
            each(lambda q: fused4(x[q.in_features], q.qweight, q.scales, q.zeros), q4), i4_bytes),
    }  # fmt: skip
    try:
        import logging
        import warnings

        warnings.filterwarnings("ignore")
        logging.disable(logging.WARNING)
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

        for name, config in (("int8", Int8WeightOnlyConfig()), ("int4", Int4WeightOnlyConfig(group_size=64))):  # fmt: skip
            try:
                mods = [torch.nn.Linear(i, o, bias=False).bfloat16() for o, i in SHAPES]
                for m in mods:
                    quantize_(m, config)
                compiled = [torch.compile(m) for m in mods]
                rows[f"torchao {name} weight-only, bf16, compiled"] = (
                    each(lambda m: m(xb[m.in_features]), compiled),
                    i8_bytes if name == "int8" else i4_bytes,
                )
            except Exception as e:  # noqa: BLE001 - reported, not hidden
                rows[f"torchao {name} weight-only"] = (None, f"unavailable: {str(e)[:120]}")
    except ImportError:
        rows["torchao"] = (None, "not installed")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = []
    reference = None
    for name, (fn, nbytes) in candidates().items():
        if fn is None:
            results.append(dict(name=name, note=nbytes))
            continue
        s = timed(fn, args.rounds)
        reference = reference or s
        results.append(
            dict(
                name=name,
                ms_per_token=round(s * 1e3, 2),
                weight_mib=round(nbytes / 2**20, 1),
                gb_s=round(nbytes / s / 1e9, 1),
                speed_vs_fp32_gemv=round(reference / s, 2),
            )
        )
    report = dict(
        date=time.strftime("%Y-%m-%d"),
        command="python benchmarks/bench_quant_kernels.py " + " ".join(sys.argv[1:]),
        machine=dict(cpu=cpu_model(), threads=torch.get_num_threads(), torch=torch.__version__),
        results=results,
    )
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    m = report["machine"]
    print(f"{report['date']}  {m['cpu']}, {m['threads']} threads, torch {m['torch']}")
    print(f"one token through the 124.7M config's projections ({len(SHAPES)} matrices):")
    for r in results:
        if "note" in r:
            print(f"  {r['name']:<58} {r['note']}")
        else:
            print(
                f"  {r['name']:<58}{r['ms_per_token']:>8} ms {r['weight_mib']:>7} MiB "
                f"{r['gb_s']:>6} GB/s {r['speed_vs_fp32_gemv']:>6}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
