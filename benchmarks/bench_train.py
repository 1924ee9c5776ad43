"""Training throughput and model FLOPs utilisation, side by side with HF transformers.

For each size (nanoGPT's CPU-recipe model, its "baby GPT" in GPT-2 and LLaMA style, and a 124M
GPT-2) one training step (forward, backward, clip, AdamW, one host sync) of: HF transformers'
model of the same architecture (GPT2LMHeadModel / LlamaForCausalLM, its default AdamW), ours
eager and ours compiled, fp32, and, where this CPU can do it in reasonable time, bf16 autocast.
Contenders of one size run round-robin on the same batches so machine noise hits all alike.
MFU = achieved FLOP/s (``flops_per_token`` x tokens / time) over the fp32 peak matmul FLOP/s
measured in the same run (best of 5 timings of 1024x1024 products); bf16 rows get none (a bf16 product runs at ~1
GFLOP/s here, slower than the autocast step itself, so it is no peak).

    python benchmarks/bench_train.py [--json] [--rounds 3] [--quick] [--sizes char,baby,124m]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from llm_foundry.presets import get_preset
from llm_foundry.train.build import build_model
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.optim import build_optimizer

CPU = torch.device("cpu")

# name -> (preset, overrides, batch, block, include bf16)
SIZES = {
    "char-gpt2": ("gpt2-shakespeare-char", {}, 12, 64, True),
    "char-llama": ("llama-shakespeare-char", {}, 12, 64, True),
    "baby-gpt2": ("gpt2-shakespeare", {}, 4, 256, False),
    "baby-llama": ("llama-shakespeare", {}, 4, 256, False),
    "gpt2-124m": ("gpt2", {"max_seq_len": 256}, 1, 256, False),
}


def peak_gflops(dtype: torch.dtype, n: int = 1024, reps: int = 10, trials: int = 5) -> float:
    """The best of ``trials`` timings of ``reps`` (n x n) @ (n x n) products: a peak, so the
    fastest trial, not the median, on this noisy VM."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = 0.0
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t) / 1e9)
    return best


def recipe(lr: float = 1e-4, betas=(0.9, 0.999)) -> TrainConfig:
    """The training settings our contenders step with: AdamW at ``lr``, weight decay 0.1."""
    return TrainConfig(lr=lr, min_lr=0.0, beta1=betas[0], beta2=betas[1], weight_decay=0.1, seed=0)


def our_model(cfg):
    """Our model of ``cfg`` as the trainer builds it (seed 0), on the CPU."""
    return build_model(cfg, recipe(), CPU)


def hf_model(cfg):
    """HF transformers' model of the same architecture (``interop.hf.config_to_hf``). HF's GPT-2
    always has biases, so a bias-free GPT-2-style config is timed against the nearest HF one."""
    import transformers

    from llm_foundry.interop.hf import config_to_hf

    if cfg.pos_encoding == "learned":
        cfg = cfg.replace(attn_bias=True, mlp_bias=True, norm_bias=True)
    model = transformers.AutoModelForCausalLM.from_config(config_to_hf(cfg))
    model.config._attn_implementation = "sdpa"
    return model


class Contender:
    """A model, its AdamW and one training step (forward, backward, clip, update, one sync)."""

    def __init__(
        self,
        name,
        model,
        compile=False,
        bf16=False,
        hf=False,
        lr=1e-4,
        betas=(0.9, 0.999),
        opt=None,
    ):
        self.name, self.model, self.hf, self.bf16 = name, model, hf, bf16
        self.fwd = torch.compile(model) if compile else model
        if opt is None and hf:  # HF gets torch's default AdamW (what its users get)
            opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, fused=False)
        elif opt is None:  # ours: the trainer's (fused AdamW on its decay groups)
            opt = build_optimizer(model, recipe(lr, betas), CPU)
        # else: the optimizer another project builds for its model
        self.opt = opt
        self.params = sum(p.numel() for p in model.parameters())
        self.times: list[float] = []  # seconds per step, one entry per timed round

    def step(self, x, y) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            if self.hf:
                logits = self.fwd(input_ids=x).logits
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            else:
                loss = self.fwd(x, y)[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss.item()  # one host sync per step, as the trainer does for logging


def round_robin(contenders: list[Contender], batches, rounds: int, warmup: int) -> None:
    """Warm up (and compile) each contender on ``warmup`` batches, then time ``rounds`` rounds
    in which every contender in turn steps through all batches, so that machine noise hits all
    alike; sets ``warmup_s`` and appends seconds per step to ``times``."""
    for c in contenders:
        t = time.perf_counter()
        for x, y in batches[:warmup]:
            c.step(x, y)
        c.warmup_s = time.perf_counter() - t
    for _ in range(rounds):
        for c in contenders:
            t = time.perf_counter()
            for x, y in batches:
                c.step(x, y)
            c.times.append((time.perf_counter() - t) / len(batches))


def bench_size(name: str, rounds: int, steps: int, peaks: dict) -> list[dict]:
    preset, over, batch, block, with_bf16 = SIZES[name]
    cfg = get_preset(preset, **over)
    ours = our_model(cfg)
    contenders = [
        Contender("HF transformers", hf_model(cfg), hf=True),
        Contender("ours eager", ours),
        Contender("ours compiled", our_model(cfg), compile=True),
    ]
    if with_bf16:
        contenders.append(Contender("ours eager bf16", our_model(cfg), bf16=True))
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, cfg.vocab_size, (2, batch, block), generator=g) for _ in range(steps)
    ]
    round_robin(contenders, batches, rounds, warmup=2)
    flops_per_step = ours.flops_per_token(block) * batch * block
    hf_s = statistics.median(contenders[0].times)
    rows = []
    for c in contenders:
        s = statistics.median(c.times)
        # bf16 autocast on this kind of CPU has no fast matmul: no meaningful peak to divide by
        peak = peaks["fp32"] if not c.bf16 else None
        rows.append(
            dict(
                size=name,
                preset=preset,
                params=c.params,
                batch=f"{batch}x{block}",
                contender=c.name,
                ms_per_iter=round(s * 1e3, 1),
                tokens_per_s=round(batch * block / s),
                vs_hf=round(hf_s / s, 2),
                gflop_per_s=round(flops_per_step / s / 1e9, 1),
                mfu=round(flops_per_step / s / 1e9 / peak, 3) if peak else None,
                warmup_s=round(c.warmup_s, 1),
            )
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"of {', '.join(SIZES)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="steps per timed round")
    ap.add_argument("--quick", action="store_true", help="the two char sizes, 1 round of 2 steps")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sizes = args.sizes.split(",")
    if args.quick:
        sizes, args.rounds, args.steps = ["char-gpt2", "char-llama"], 1, 2
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"--sizes: unknown {unknown}; valid: {', '.join(SIZES)}")
    peaks = {"fp32": peak_gflops(torch.float32), "bf16": peak_gflops(torch.bfloat16, 512, 3, 1)}
    rows = []
    for name in sizes:
        print(f"measuring {name} ...", file=sys.stderr)
        rows += bench_size(name, args.rounds, args.steps, peaks)
    report = dict(
        date=time.strftime("%Y-%m-%d"),
        command="python benchmarks/bench_train.py " + " ".join(sys.argv[1:]),
        machine=dict(
            cpu=platform.processor() or platform.machine(),
            threads=torch.get_num_threads(),
            torch=torch.__version__,
            peak_gflops={k: round(v, 1) for k, v in peaks.items()},
        ),
        rows=rows,
    )
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['date']}  peak matmul GFLOP/s: {report['machine']['peak_gflops']}")
    cols = ("size", "contender", "params", "batch", "ms_per_iter", "tokens_per_s", "vs_hf", "mfu")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
