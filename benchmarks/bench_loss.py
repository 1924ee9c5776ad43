"""The output head and its loss, forward + backward: the plain head (logits = x W^T, then
F.cross_entropy(logits.float())) against the fused one (``models.loss.linear_cross_entropy``,
what ``train.fused_loss`` trains with: chunks of rows, no (N, V) logits), time and peak memory.

Each contender: x (N, D) fp32 requiring grad (the final norm's output), W (V, D) fp32 (the head
or the tied embedding), targets (N,) int64 with 1% ignored; one step is the loss's forward and
backward (x.grad and W.grad filled), under bf16 autocast (``--dtype bf16``) or in fp32. Eager,
and with ``--compile`` also torch.compile'd (the whole step's forward; the trainer compiles the
model, the head inside). Time: the median of ``--repeats`` steps after ``--warmup``. Peak memory:
what the step adds at its peak over what is resident before it (inputs, the previous step's
gradients) -- CUDA: the allocator's peak (``max_memory_allocated``) over ``memory_allocated``;
CPU: each contender in its own process, the peak resident size (VmHWM, reset through
/proc/self/clear_refs after the warm-up) over the resident size before the timed steps. Each
contender's loss and gradients are checked against the plain eager head's (max relative
difference, in the JSON). ``--json FILE`` appends the run to FILE's list of runs.

    python benchmarks/bench_loss.py [--device cpu|cuda] [--n 4096] [--dim 768] [--vocab 50304]
        [--dtype bf16|fp32 ...] [--chunk-rows 0,1024 ...] [--compile] [--json FILE]
        [--model-batch 32 [--model-steps 10] [--skip-head]]

Defaults: CPU N=4096 (8 x 512 tokens: a CPU step at N=8192 takes ~10 s in fp32), CUDA N=32768
(the 124M run's 32 x 1024). ``--chunk-rows 0`` is the default chunking (``default_chunk_rows``).
CPU times are wall clock and, beside them, the process's CPU time per step (``cpu_ms``): on a
CPU shared with other work the second is the steadier.

``--model-batch B`` adds the whole 124M GPT-2 training step at B x 1024 with train.fused_loss
off and on (``model_steps``: ms, MFU over 989 TFLOP/s, peak GiB), as the trainer steps it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from llm_foundry.bench import cpu_model  # noqa: E402
from llm_foundry.models.loss import default_chunk_rows, linear_cross_entropy  # noqa: E402

IGNORED = 0.01  # share of targets set to ignore_index (prompts, padding)
PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16 (datasheet), the MFU denominator of issue 30


def inputs(n: int, d: int, v: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g).to(device).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.02).to(device).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < IGNORED] = -100
    return x, w, t.to(device)


def plain(x, w, t):
    return F.cross_entropy(F.linear(x, w).float(), t)


def make_step(kind: str, chunk_rows: int, compiled: bool):
    """A function (x, w, t) -> loss whose backward fills x.grad and w.grad."""
    if kind == "plain":
        fn = plain
    else:

        def fn(x, w, t):
            return linear_cross_entropy(x, w, t, chunk_rows=chunk_rows or None)

    return torch.compile(fn) if compiled else fn


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def status_bytes(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure(args, kind: str, dtype: str, chunk_rows: int, compiled: bool) -> dict:
    """One contender in this process: times, peak bytes over the resident, loss, gradients."""
    device = torch.device(args.device)
    x, w, t = inputs(args.n, args.dim, args.vocab, device)
    step = make_step(kind, chunk_rows, compiled)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")

    def run():
        x.grad = w.grad = None
        with amp:
            loss = step(x, w, t)
        loss.backward()
        return loss

    for _ in range(args.warmup):
        run()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM starts again from the resident size
        base = status_bytes("VmRSS")
    times, cpu = [], []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = run()
        sync(device)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else status_bytes("VmHWM")
    # two matmuls forward and backward's two: 6 N D V FLOPs per step (the fused head's too)
    flops = 6 * args.n * args.dim * args.vocab
    ms = statistics.median(times) * 1e3
    return dict(
        kind=kind,
        dtype=dtype,
        compiled=compiled,
        chunk_rows=(chunk_rows or default_chunk_rows(args.n, args.vocab))
        if kind == "fused"
        else None,
        ms=round(ms, 3),
        ms_all=[round(s * 1e3, 3) for s in times],
        # the process's CPU time per step: on a shared CPU, less disturbed by other work
        cpu_ms=None if device.type == "cuda" else round(statistics.median(cpu) * 1e3, 3),
        tflops=round(flops / (ms / 1e3) / 1e12, 3),
        peak_over_resident_mib=round((peak - base) / 2**20, 1),
        loss=loss.item(),
        grads=[x.grad.detach().cpu(), w.grad.detach().cpu()],
    )


def model_steps(args) -> list[dict]:
    """The 124M GPT-2 (vocabulary 50304) training step at ``--model-batch`` x 1024, built and
    stepped as the trainer does it (build_model, build_optimizer: fused AdamW on CUDA, bf16
    autocast, torch.compile of the model, clip 1.0, one loss.item()), with train.fused_loss off
    and on: ms per step, MFU (the model's flops_per_token x tokens / time over ``PEAK_FLOPS``),
    peak memory (the allocator's, CUDA). Random tokens already on the device."""
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 50304, (2, args.model_batch, 1024), generator=g).to(device)
    out = []
    for fused in (False, True):
        out.append(model_step(args, device, x, y, fused))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def model_step(args, device: torch.device, x, y, fused: bool) -> dict:
    from llm_foundry.presets import get_preset
    from llm_foundry.train.build import build_model
    from llm_foundry.train.config import TrainConfig
    from llm_foundry.train.optim import build_optimizer, set_lr

    batch, block = x.shape
    mc = get_preset("gpt2", vocab_size=50304, max_seq_len=block)
    tc = TrainConfig(batch_size=batch, block_size=block, dtype="bf16", compile=True,
                     fused_loss=fused, device=device.type)  # fmt: skip
    model = build_model(mc, tc, device)
    opt = build_optimizer(model, tc, device)
    set_lr(opt, 6e-4)
    fwd = torch.compile(model)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = fwd(x, y)[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    t0 = time.perf_counter()
    losses = [step() for _ in range(3)]  # compile and warm up
    compile_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.model_steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    flops = model.flops_per_token(block) * batch * block / (ms / 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    r = dict(fused_loss=fused, batch=batch, block=block, ms=round(ms, 2),
             ms_all=[round(t * 1e3, 2) for t in times], mfu=round(flops / PEAK_FLOPS, 4),
             peak_gib=None if peak is None else round(peak, 2), losses=losses,
             warmup_and_compile_s=round(compile_s, 1))  # fmt: skip
    print(f"124M step, batch {batch}x{block}, fused_loss={fused}: {ms:.2f} ms, MFU "
          f"{r['mfu']:.3f}, peak {r['peak_gib']} GiB, losses {losses[0]:.4f} .. {losses[-1]:.4f}",
          flush=True)  # fmt: skip
    return r


def contenders(args) -> list[tuple[str, str, int, bool]]:
    out = []
    for dtype in args.dtype:
        for compiled in (False, True) if args.compile else (False,):
            out.append(("plain", dtype, 0, compiled))
            out += [("fused", dtype, c, compiled) for c in args.chunk_rows]
    return out


def child(args) -> None:
    """CPU: one contender (``--one i``) in its own process; its result as JSON on stdout, its
    gradients in ``--grads`` (a .pt file) for the parent's comparison."""
    kind, dtype, chunk, compiled = contenders(args)[args.one]
    r = measure(args, kind, dtype, chunk, compiled)
    torch.save(r.pop("grads"), args.grads)
    print("RESULT " + json.dumps(r))


def compare(r: dict, ref: dict) -> dict:
    """Relative differences to the plain eager head's loss and gradients (same dtype)."""
    out = dict(loss_rel_diff=abs(r["loss"] - ref["loss"]) / abs(ref["loss"]))
    for name, g, g0 in zip(("grad_x", "grad_w"), r["grads"], ref["grads"], strict=True):
        out[f"{name}_rel_diff"] = ((g - g0).abs().max() / g0.abs().max()).item()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--n", type=int, default=None, help="rows (tokens); cpu 4096, cuda 32768")
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--dtype", default="bf16,fp32", help="comma list of bf16 (autocast), fp32")
    ap.add_argument("--chunk-rows", default="0", help="comma list; 0: default_chunk_rows")
    ap.add_argument("--compile", action="store_true", help="also torch.compile'd contenders")
    ap.add_argument("--warmup", type=int, default=None, help="cpu 1, cuda 3")
    ap.add_argument("--repeats", type=int, default=None, help="cpu 3, cuda 10")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--model-batch", type=int, default=0,
                    help="also time the 124M GPT-2 training step at this batch x 1024, "
                         "train.fused_loss off and on (0: not)")  # fmt: skip
    ap.add_argument("--model-steps", type=int, default=10, help="timed model steps")
    ap.add_argument("--skip-head", action="store_true", help="the model step only")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--grads", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    args.n = args.n or (32768 if cuda else 4096)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    args.repeats = args.repeats or (10 if cuda else 3)
    args.dtype = args.dtype.split(",")
    args.chunk_rows = [int(c) for c in args.chunk_rows.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one is not None:
        return child(args)
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no GPU here")

    results = []
    for i, (kind, dtype, chunk, compiled) in enumerate([] if args.skip_head else contenders(args)):
        if cuda:
            r = measure(args, kind, dtype, chunk, compiled)
            torch.cuda.empty_cache()
        else:  # its own process: a clean peak, and no allocator state carried between them
            grads = Path(f"/tmp/bench_loss_grads_{os.getpid()}_{i}.pt")
            cmd = [sys.executable, __file__, *sys.argv[1:], "--one", str(i), "--grads", str(grads)]
            # every allocation above 64 KiB its own mapping, returned when freed (glibc would
            # otherwise keep freed chunks below its moving threshold resident: a peak over the
            # resident would miss them)
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
            p = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if p.returncode:
                sys.exit(p.stderr[-3000:])
            line = [s for s in p.stdout.splitlines() if s.startswith("RESULT ")][-1]
            r = json.loads(line[len("RESULT ") :])
            r["grads"] = torch.load(grads)
            grads.unlink()
        results.append(r)
        ref = next(q for q in results if q["kind"] == "plain" and q["dtype"] == dtype
                   and not q["compiled"])  # fmt: skip
        r.update(compare(r, ref))
        name = kind if kind == "plain" else f"{kind} ({r['chunk_rows']} rows)"
        print(
            f"{dtype:4s} {'compiled' if compiled else 'eager':8s} {name:20s} {r['ms']:9.1f} ms "
            f"{r['tflops']:7.2f} TFLOP/s  peak +{r['peak_over_resident_mib']:8.1f} MiB  "
            f"loss {r['loss']:.6f} (rel diff {r['loss_rel_diff']:.1e}, grads "
            f"{max(r['grad_x_rel_diff'], r['grad_w_rel_diff']):.1e})",
            flush=True,
        )
    for r in results:
        del r["grads"]
    steps = model_steps(args) if args.model_batch else None
    if cuda:
        machine = torch.cuda.get_device_name()
    else:
        machine = f"{cpu_model()}, {torch.get_num_threads()} threads"
    report = dict(
        date=datetime.date.today().isoformat(),
        machine=machine,
        device=args.device,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
        n=args.n,
        dim=args.dim,
        vocab=args.vocab,
        ignored_share=IGNORED,
        warmup=args.warmup,
        repeats=args.repeats,
        logits_fp32_mib=round(args.n * args.vocab * 4 / 2**20, 1),
        results=results,
        model_steps=steps,
    )
    if args.json:  # each run appended to the file's "runs"
        path = Path(args.json)
        runs = json.loads(path.read_text()).get("runs", []) if path.exists() else []
        path.write_text(json.dumps({"runs": [*runs, report]}, indent=1) + "\n")
        print(f"wrote {args.json} (run {len(runs) + 1})")


if __name__ == "__main__":
    main()
