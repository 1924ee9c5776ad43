"""bf16 or fp32 on this CPU: what the detection says, what it measures, and what bf16 costs in loss.

Four parts, in one run:
  detection  ``llm_foundry.train.precision.bf16_support("cpu")`` (CPU flags and a measured
             matmul) and what ``train.dtype auto`` resolves to here.
  matmul     fp32 vs bf16 ``n x n`` matrix products (fastest of a few, timed in turns).
  quality    the tiny Shakespeare char model (preset llama-shakespeare-char, TrainConfig's
             recipe cut to ``--steps``) through ``Trainer``, ``--seeds`` seeds in fp32 and the same
             seeds in bf16 autocast; final val loss (``--eval-batches`` batches) of each.
             Criterion: bf16 keeps the loss within seed noise when |mean(bf16) - mean(fp32)| <=
             2 x the fp32 runs' standard deviation across seeds. The same seed gives both dtypes
             the same initial weights and batches, so the per-seed differences are reported too.
  step time  median ms per training step of those runs (steps 11 on), fp32 vs bf16.

    python benchmarks/bench_precision.py [--json] [--steps 200] [--seeds 3] [--threads N] [--quick]

With ``--json`` the report is also written to benchmarks/results_precision_DATE.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_shakespeare import data_dir

from llm_foundry.bench import cpu_model
from llm_foundry.presets import get_preset
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.precision import FAST_RATIO, bf16_support, resolve_dtype, time_matmuls
from llm_foundry.train.trainer import Trainer

HERE = Path(__file__).resolve().parent
PRESET = "llama-shakespeare-char"
NOISE_STDS = 2.0  # "within seed noise": the mean difference at most this many fp32 seed stds


def matmul_row(n: int, reps: int) -> dict:
    """fp32 and bf16 times of one ``n x n`` matmul, GFLOP/s and the bf16/fp32 speed ratio."""
    t32, t16 = time_matmuls(n, reps)
    flops = 2 * n**3
    return dict(
        n=n,
        fp32_ms=round(t32 * 1e3, 3),
        bf16_ms=round(t16 * 1e3, 3),
        fp32_gflop_s=round(flops / t32 / 1e9, 1),
        bf16_gflop_s=round(flops / t16 / 1e9, 1),
        bf16_speed_vs_fp32=round(t32 / t16, 3),
    )


def train_run(data: Path, out: Path, dtype: str, seed: int, steps: int, eval_batches: int) -> dict:
    """One short run of the recipe: its final val loss and median ms per step."""
    tc = TrainConfig(
        max_steps=steps,
        seed=seed,
        dtype=dtype,
        eval_interval=steps,  # one evaluation, at the end
        eval_batches=eval_batches,
        checkpoint_interval=steps,
        sample_tokens=0,
        progress=False,
    )
    t0 = time.perf_counter()
    trainer = Trainer(get_preset(PRESET, max_seq_len=64), tc, data, out)
    result = trainer.run()
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if "loss" in r][10:]  # the first steps warm caches and allocators
    ms = statistics.median(tc.tokens_per_step / r["tokens_per_s"] * 1e3 for r in timed)
    val = [r["val_loss"] for r in rows if "val_loss" in r][-1]
    return dict(
        dtype=dtype,
        seed=seed,
        steps=result.step,
        final_val_loss=round(val, 4),
        median_ms_per_step=round(ms, 1),
        wall_s=round(wall, 1),
    )


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def compare(runs: list[dict]) -> dict:
    """fp32 vs bf16 final val loss: mean +- std of each, per-seed differences, the verdict."""
    loss = {d: [r["final_val_loss"] for r in runs if r["dtype"] == d] for d in ("fp32", "bf16")}
    ms = {d: [r["median_ms_per_step"] for r in runs if r["dtype"] == d] for d in ("fp32", "bf16")}
    (m32, s32), (m16, s16) = mean_std(loss["fp32"]), mean_std(loss["bf16"])
    diff = m16 - m32
    return dict(
        fp32_val_loss_mean=round(m32, 4),
        fp32_val_loss_std=round(s32, 4),
        bf16_val_loss_mean=round(m16, 4),
        bf16_val_loss_std=round(s16, 4),
        mean_difference=round(diff, 4),
        per_seed_difference=[
            round(b - a, 4) for a, b in zip(loss["fp32"], loss["bf16"], strict=True)
        ],
        criterion=f"|mean difference| <= {NOISE_STDS:g} x fp32 seed std",
        within_seed_noise=abs(diff) <= NOISE_STDS * s32,
        fp32_ms_per_step=round(statistics.fmean(ms["fp32"]), 1),
        bf16_ms_per_step=round(statistics.fmean(ms["bf16"]), 1),
        bf16_step_speed_vs_fp32=round(
            statistics.fmean(ms["fp32"]) / statistics.fmean(ms["bf16"]), 2
        ),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="steps of each training run")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per dtype")
    ap.add_argument("--eval-batches", type=int, default=50, help="batches of the final val loss")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="20-step runs, 2 seeds (a smoke test)")
    ap.add_argument(
        "--json", action="store_true", help="print JSON and write results_precision_DATE.json"
    )
    args = ap.parse_args()
    if args.quick:
        args.steps, args.seeds = 20, 2
    if args.steps < 11 or args.seeds < 1:
        ap.error("--steps must be >= 11 (the first 10 are not timed) and --seeds >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    support = bf16_support("cpu")
    auto, why = resolve_dtype("auto", "cpu")
    report = dict(
        date=time.strftime("%Y-%m-%d"),
        command="python benchmarks/bench_precision.py " + " ".join(sys.argv[1:]),
        machine=dict(
            cpu=cpu_model(),
            cpu_capability=torch.backends.cpu.get_cpu_capability(),
            threads=torch.get_num_threads(),
            torch=torch.__version__,
            python=platform.python_version(),
        ),
        detection=dict(
            fast=support.fast,
            reason=support.reason,
            ratio=support.ratio,
            threshold=FAST_RATIO,
            auto_chooses=auto,
            auto_line=why,
        ),  # fmt: skip
        matmul=[matmul_row(n, reps=5) for n in (256, 512)],
        preset=PRESET,
        steps=args.steps,
        seeds=list(range(args.seeds)),
    )
    root = Path(tempfile.mkdtemp(prefix="bench_precision-"))
    data = data_dir(root)
    corpus = json.loads((data / "meta.json").read_text())["source"]
    print(f"corpus: {corpus} (LLM_FOUNDRY_SHAKESPEARE=FILE reads another copy)", file=sys.stderr)
    runs = []
    # the trainer's lines go to stderr so that --json prints only JSON on stdout
    with contextlib.redirect_stdout(sys.stderr):
        for seed in report["seeds"]:
            for dtype in ("fp32", "bf16"):  # in turns, so machine noise hits both alike
                out = root / f"{dtype}-{seed}"
                runs.append(train_run(data, out, dtype, seed, args.steps, args.eval_batches))
                print(f"{runs[-1]}", file=sys.stderr)
    report["runs"] = runs
    report["comparison"] = compare(runs)
    if args.json:
        text = json.dumps(report, indent=2)
        (
            HERE / f"results_precision_{report['date']}{'-quick' if args.quick else ''}.json"
        ).write_text(text + "\n")
        print(text)
        return 0
    d, c = report["detection"], report["comparison"]
    print(f"{report['date']}  {report['machine']['cpu']}  torch {report['machine']['torch']}  "
          f"{report['machine']['threads']} threads")  # fmt: skip
    print(f"detection: {'fast' if d['fast'] else 'slow'}: {d['reason']}; auto chooses {auto}")
    for m in report["matmul"]:
        print(f"matmul {m['n']}^2: fp32 {m['fp32_ms']} ms ({m['fp32_gflop_s']} GFLOP/s), bf16 "
              f"{m['bf16_ms']} ms ({m['bf16_gflop_s']} GFLOP/s): bf16 {m['bf16_speed_vs_fp32']}x")  # fmt: skip
    print(f"{PRESET}, {args.steps} steps, seeds {report['seeds']}:")
    print(f"  fp32 val loss {c['fp32_val_loss_mean']} +- {c['fp32_val_loss_std']}, "
          f"{c['fp32_ms_per_step']} ms/step")  # fmt: skip
    print(f"  bf16 val loss {c['bf16_val_loss_mean']} +- {c['bf16_val_loss_std']}, "
          f"{c['bf16_ms_per_step']} ms/step ({c['bf16_step_speed_vs_fp32']}x fp32's speed)")  # fmt: skip
    verdict = "within" if c["within_seed_noise"] else "NOT within"
    print(f"  difference {c['mean_difference']:+} (per seed {c['per_seed_difference']}): "
          f"{verdict} seed noise ({c['criterion']})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
