"""Where one training step's time goes: torch.profiler over a few steps, grouped by kind.

One step is what bench_train.py times (forward, backward, clip, fused AdamW, one host sync).
Self CPU time of every profiled op is put in one bucket: matrix multiplies (with their FLOP/s),
attention kernels, inductor's fused kernels (compiled) or ATen elementwise ops (eager), the
optimizer and clipping, and the rest (Python, autograd engine, dispatch). The profiler adds a
little overhead of its own, so the buckets add up to a bit more than an unprofiled step.

    python benchmarks/profile_step.py [--preset gpt2-shakespeare-char] [--batch 12] [--block 64]
        [--compile] [--threads N] [--steps 10] [--top 8]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).parent))
from bench_train import Contender, our_model  # noqa: E402

from llm_foundry.presets import get_preset  # noqa: E402

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
OPTIMIZER = ("adam", "optimizer", "linalg_vector_norm", "clip", "zero_grad", "_foreach")
# ops that only wrap others (compiled graphs, autograd nodes) keep their own time in "other"
BUCKETS = ("matmul", "attention", "fused kernels", "elementwise (ATen)", "optimizer", "other")


def bucket(name: str) -> str:
    low = name.lower()
    if name in MATMUL:
        return "matmul"
    if "scaled_dot_product" in low or "softmax" in low and "log_softmax" not in low:
        return "attention"
    if low.startswith("graph_") or "cpp_fused" in low:
        return "fused kernels"
    if any(k in low for k in OPTIMIZER):
        return "optimizer"
    if name.startswith("aten::") and not name.startswith(("aten::empty", "aten::as_strided")):
        return "elementwise (ATen)"
    return "other"


def profile_step(
    preset: str, batch: int, block: int, compile: bool, steps: int, top: int = 8
) -> dict:
    if compile:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # name each fused kernel in the profile
    cfg = get_preset(preset)
    model = our_model(cfg)
    c = Contender("ours", model, compile=compile)
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, cfg.vocab_size, (2, batch, block), generator=g) for _ in range(steps)
    ]
    for x, y in batches[:3]:  # warm-up (and compilation)
        c.step(x, y)
    with profile(with_flops=True) as prof:
        for x, y in batches:
            c.step(x, y)
    ms = defaultdict(float)
    flops = 0
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    for e in events:
        b = bucket(e.key)
        ms[b] += e.self_cpu_time_total / 1e3 / steps
        if b == "matmul":
            flops += e.flops / steps
    total = sum(ms.values())
    return dict(
        preset=preset,
        batch=f"{batch}x{block}",
        compiled=compile,
        threads=torch.get_num_threads(),
        ms_per_step=round(total, 1),
        buckets={b: round(ms[b], 1) for b in BUCKETS},
        matmul_flop_per_step=round(flops),
        matmul_gflop_per_step=round(flops / 1e9, 2),
        matmul_gflop_per_s=round(flops / (ms["matmul"] / 1e3) / 1e9, 1) if ms["matmul"] else None,
        model_gflop_per_step=round(model.flops_per_token(block) * batch * block / 1e9, 2),
        top_ops=[
            dict(
                name=e.key,
                ms_per_step=round(e.self_cpu_time_total / 1e3 / steps, 2),
                calls_per_step=e.count // steps,
            )
            for e in events[:top]
        ],
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt2-shakespeare-char")
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--steps", type=int, default=10, help="profiled steps")
    ap.add_argument("--top", type=int, default=8, help="list this many ops by their own time")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    r = profile_step(args.preset, args.batch, args.block, args.compile, args.steps, args.top)
    mode = "compiled" if r["compiled"] else "eager"
    print(f"{r['preset']} {mode}, batch {r['batch']}, {r['threads']} threads: ", end="")
    print(f"{r['ms_per_step']} ms/step (profiled)")
    for b, v in r["buckets"].items():
        print(f"  {b:20s} {v:7.1f} ms  {100 * v / r['ms_per_step']:5.1f}%")
    print(
        f"  matmul: {r['matmul_gflop_per_step']} GFLOP/step at {r['matmul_gflop_per_s']} GFLOP/s; "
        f"whole model {r['model_gflop_per_step']} GFLOP/step"
    )
    print(f"top {len(r['top_ops'])} ops by their own time (ms/step, calls/step):")
    for op in r["top_ops"]:
        print(f"  {op['ms_per_step']:7.2f} ms  {op['calls_per_step']:4d}x  {op['name'][:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
