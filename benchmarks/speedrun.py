"""Shakespeare speedrun: training time (and tokens) to nanoGPT's CPU-recipe val loss, 1.886.

The target is the final validation loss nanoGPT's README reports for its CPU recipe on tiny
Shakespeare characters (4 layers, 4 heads, 128 wide, block 64, batch 12, 2000 iterations). The
score is the training time an entrant needs to first reach it; nanoGPT's own model and recipe run
in the same process as the reference (``--nanogpt DIR``, a checkout holding its ``model.py``).

Rules, the same for every entrant:
  data        tiny Shakespeare characters, nanoGPT's split (first 90% train, last 10% val).
  validation  one fixed set: 100 batches of 12 x 64 = 1,200 non-overlapping windows spread evenly
              over the validation split (76,800 predicted tokens, 69% of it), scored every
              ``--eval-interval`` steps (25) with the same function for every model.
  clock       training time only: the sum of the steps' own times (batch, forward, backward,
              clip, optimizer, one host sync); evaluation, checkpoints and logging are outside it.
              A run stops at the first evaluation at or below the target (``--full``: the whole
              recipe), so "time to target" is the training time up to that evaluation's step.
  order       interleaved by seed (nanoGPT s0, A s0, B s0, nanoGPT s1, ...) so that machine noise
              hits every entrant alike; one process, ``--threads`` threads (default: all cores).
  reference   nanoGPT's training time to the target on this validation set, or its whole
              2000-step time where it never gets there (the report says which); every ratio is
              an entrant's time over the reference of the same seed.

Our entrants train through ``Trainer`` (the ``llm-foundry train`` path); only its ``evaluate`` is
replaced, by the fixed validation set above. nanoGPT trains in a loop written here after its
``train.py`` (random windows like its ``get_batch``, its cosine schedule with warmup, AdamW from
its ``configure_optimizers``, clip 1.0).

Ctrl-C (or SIGTERM) stops the whole speedrun at once (our entrants at the end of the step under
way): one line, exit 130 (143), no report; the working folder (data, checkpoints) is removed
then as after a run, unless ``--keep`` is given.

    python benchmarks/speedrun.py --nanogpt DIR [--seeds 3] [--json] [--quick] [--full]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from bench_shakespeare import data_dir, load_nanogpt, nanogpt_model

from llm_foundry.ablation import first_crossing, training_seconds
from llm_foundry.bench import cpu_model
from llm_foundry.cli.options import SettingsParser, at_least_one
from llm_foundry.cli.signals import stopped
from llm_foundry.data import load_split
from llm_foundry.plots import read_metrics
from llm_foundry.presets import get_preset
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.trainer import Trainer

TARGET = 1.886  # nanoGPT README, CPU recipe, final val loss
BATCH, BLOCK = 12, 64
VAL_BATCHES = 100  # of BATCH x BLOCK: 1,200 windows, 76,800 predicted tokens
EVAL_ROWS = 240  # windows per forward pass when scoring (only speed depends on it)
RESULTS = Path(__file__).resolve().parent
PROG = "speedrun.py"


@dataclass
class Entrant:
    """One contender: nanoGPT's reference (``nanogpt=True``) or a preset with overrides."""

    name: str
    preset: str | None = None
    model: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)
    nanogpt: bool = False
    note: str = ""


NANOGPT_RECIPE = dict(
    max_steps=2000, lr=1e-3, min_lr=1e-4, warmup_steps=100, betas=(0.9, 0.99), weight_decay=0.1,
    grad_clip=1.0,
)  # fmt: skip

ENTRANTS = [
    Entrant("nanoGPT", nanogpt=True, note="its GPT and CPU recipe, 2000-step cosine (reference)"),
    Entrant(
        "llama AdamW 2000-step cosine",
        "llama-shakespeare-char",
        note="the library default: nanoGPT's recipe on the LLaMA-style preset",
    ),
    Entrant(
        "llama Muon 800-step wsd",
        "llama-shakespeare-char",
        train=dict(
            optimizer="muon",
            muon_lr=0.04,
            lr=4e-3,
            min_lr=0.0,
            warmup_steps=20,
            max_steps=800,
            schedule="wsd",
            decay_frac=0.5,
        ),
        note="Muon 0.04 on the blocks' matrices, AdamW 4e-3 on embeddings/head/norms; 20 warmup, "
        "held, linear decay to 0 over the second half (recipe adamw-vs-muon)",
    ),
    Entrant(
        "llama+QK-norm Muon batch 24",
        "llama-shakespeare-char",
        model=dict(qk_norm=True),
        train=dict(
            optimizer="muon",
            muon_lr=0.03,
            lr=3e-3,
            min_lr=0.0,
            warmup_steps=15,
            max_steps=250,
            schedule="cosine",
            batch_size=24,
        ),
        note="RMSNorm on each head's q and k; batch 24 x 64; Muon 0.03 on the blocks' matrices, "
        "AdamW 3e-3 on the rest; 15 warmup, cosine to 0 over 250 steps",
    ),
]


# ----------------------------------------------------------------------------------------------
# One validation set for everyone


def fixed_val_set(
    data: Path, batches: int = VAL_BATCHES
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``batches * BATCH`` non-overlapping windows spread evenly over the validation split, as
    (x, y) chunks of ``EVAL_ROWS`` rows."""
    val = np.asarray(load_split(data, "val"), dtype=np.int64)
    n = batches * BATCH
    stride = (len(val) - BLOCK - 1) // (n - 1)
    if stride < BLOCK:
        raise ValueError(f"validation split too short for {n} non-overlapping windows")
    starts = np.arange(n) * stride
    w = torch.from_numpy(val[starts[:, None] + np.arange(BLOCK + 1)])
    return [(c[:, :-1].contiguous(), c[:, 1:].contiguous()) for c in w.split(EVAL_ROWS)]


@torch.no_grad()
def val_loss(model: torch.nn.Module, forward, chunks) -> float:
    """Mean next-token loss over every predicted token of ``chunks``; ``forward(x, y)`` returns
    (logits, mean loss) as both nanoGPT's GPT and ours do."""
    was = model.training
    model.eval()
    total = sum(forward(x, y)[1].double().item() * y.numel() for x, y in chunks)
    model.train(was)
    return total / sum(y.numel() for _, y in chunks)


class Stopped(KeyboardInterrupt):
    """A signal (``signal_name``: SIGINT for Ctrl-C, SIGTERM) ended the speedrun; the message
    says during which entrant."""

    def __init__(self, signal_name: str, where: str = ""):
        super().__init__(where)
        self.signal_name = signal_name


def _raise_stopped(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def say_eval(step: int, loss: float) -> None:
    print(f"    step {step}: val loss {loss:.4f}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# Our entrants: the trainer, with evaluation on the fixed set


class SpeedrunTrainer(Trainer):
    """``Trainer`` whose evaluation scores the fixed validation set and which ends the run after
    the step whose evaluation is at or below ``target`` (the recipe's max_steps unchanged)."""

    def __init__(self, *args, val_chunks, target: float | None, **kwargs):
        super().__init__(*args, **kwargs)
        self.val_chunks, self.target, self.curve = val_chunks, target, []

    def evaluate(self) -> float:
        v = val_loss(self.model, self.forward, self.val_chunks)
        self.curve.append((self.step, v))
        say_eval(self.step, v)
        return v

    def should_stop(self) -> str | None:
        if self.target is None or not self.curve or self.curve[-1][0] != self.step:
            return None  # no target, or no evaluation at this step
        v = self.curve[-1][1]
        return f"val loss {v:.4f} <= target {self.target}" if v <= self.target else None


def run_ours(e: Entrant, data: Path, seed: int, out: Path, chunks, eval_interval: int,
             stop_at_target: bool, max_steps: int | None = None) -> dict:  # fmt: skip
    train = dict(
        dict(eval_interval=eval_interval, eval_batches=1, checkpoint_interval=0, keep_last=1),
        **e.train,
    )
    tc = TrainConfig(sample_tokens=0, progress=False, seed=seed, **train)
    if max_steps:
        tc = TrainConfig(**{**tc.to_dict(), "max_steps": min(max_steps, tc.max_steps)})
    mc = get_preset(e.preset, max_seq_len=BLOCK, **e.model)
    trainer = SpeedrunTrainer(mc, tc, data, out, val_chunks=chunks,
                              target=TARGET if stop_at_target else None)  # fmt: skip
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # its own lines say what say_eval does
        result = trainer.run()
    if result.interrupted:  # it saved and stopped at a step's end: so does the speedrun
        raise Stopped(result.stopped_by, f"{e.name}, seed {seed}, at step {result.step}")
    wall = time.perf_counter() - t0
    train_rows, _ = read_metrics(out / "metrics.jsonl")
    secs = training_seconds(train_rows, tc.tokens_per_step)
    curve = [(s, s * tc.tokens_per_step, secs[s], v) for s, v in trainer.curve]
    dts = [tc.tokens_per_step / r["tokens_per_s"] * 1e3 for r in train_rows]
    return _result(e, seed, curve, len(train_rows), tc.max_steps, secs[len(train_rows)], wall,
                   _median(dts[10:] or dts), trainer.model.num_params())  # fmt: skip


def _median(xs) -> float | None:
    xs = list(xs)
    return statistics.median(xs) if xs else None


# ----------------------------------------------------------------------------------------------
# nanoGPT's reference: its model and recipe in a loop after its train.py


def nanogpt_lr(it: int, r: dict = NANOGPT_RECIPE) -> float:
    """nanoGPT train.py's get_lr: linear warmup, then cosine to min_lr at max_steps."""
    warm, decay = r["warmup_steps"], r["max_steps"]
    if it < warm:
        return r["lr"] * (it + 1) / (warm + 1)
    if it > decay:
        return r["min_lr"]
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - warm) / (decay - warm)))
    return r["min_lr"] + coeff * (r["lr"] - r["min_lr"])


def run_nanogpt(e: Entrant, module, data: Path, seed: int, chunks, eval_interval: int,
                stop_at_target: bool, max_steps: int | None = None) -> dict:  # fmt: skip
    r = NANOGPT_RECIPE
    train = torch.from_numpy(np.asarray(load_split(data, "train"), dtype=np.int64))
    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
    torch.manual_seed(seed)
    model = nanogpt_model(module, vocab)
    with contextlib.redirect_stdout(sys.stderr):
        opt = model.configure_optimizers(r["weight_decay"], r["lr"], r["betas"], "cpu")
    g = torch.Generator().manual_seed(seed)
    steps = min(max_steps or r["max_steps"], r["max_steps"])
    curve, dts, total, t_wall = [], [], 0.0, time.perf_counter()
    model.train()
    for it in range(steps):
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = nanogpt_lr(it)
        ix = torch.randint(len(train) - BLOCK, (BATCH,), generator=g)  # its get_batch
        x = torch.stack([train[i : i + BLOCK] for i in ix])
        y = torch.stack([train[i + 1 : i + 1 + BLOCK] for i in ix])
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), r["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        dt = time.perf_counter() - t0
        total += dt
        dts.append(dt * 1e3)
        step = it + 1
        if step % eval_interval == 0 or step == steps:
            v = val_loss(model, model, chunks)
            curve.append((step, step * BATCH * BLOCK, total, v))
            say_eval(step, v)
            if stop_at_target and v <= TARGET:
                break
    params = sum(p.numel() for p in model.parameters())
    return _result(e, seed, curve, len(dts), r["max_steps"], total,
                   time.perf_counter() - t_wall, _median(dts[10:] or dts), params)  # fmt: skip


def _result(e, seed, curve, steps, max_steps, train_s, wall_s, ms, params) -> dict:
    hit = first_crossing([(s, v, t) for s, _, t, v in curve], TARGET)
    return dict(
        entrant=e.name,
        seed=seed,
        params=params,
        steps_run=steps,
        recipe_steps=max_steps,
        train_s=round(train_s, 3),
        wall_s=round(wall_s, 2),
        median_ms_per_step=None if ms is None else round(ms, 2),
        target_step=hit[0] if hit else None,
        target_tokens={s: n for s, n, _, _ in curve}[hit[0]] if hit else None,
        target_train_s=round(hit[2], 3) if hit else None,
        final_val_loss=round(curve[-1][3], 4) if curve else None,
        curve=[
            dict(step=s, tokens=n, train_s=round(t, 3), val_loss=round(v, 4))
            for s, n, t, v in curve
        ],  # fmt: skip
    )


# ----------------------------------------------------------------------------------------------
# The report


def summarise(
    results: list[dict], entrants: list[Entrant], seeds: list[int]
) -> tuple[list[dict], dict]:
    """Per entrant: per-seed steps / tokens / seconds to target and the ratio to the reference
    of the same seed (nanoGPT's time to target, or its whole run where it never got there)."""
    by = {(r["entrant"], r["seed"]): r for r in results}
    ref_name = next((e.name for e in entrants if e.nanogpt), None)
    refs = {}
    for s in seeds:
        r = by.get((ref_name, s))
        if r is not None:
            reached = r["target_train_s"] is not None
            refs[s] = dict(
                seconds=r["target_train_s"] if reached else r["train_s"],
                basis="time to target" if reached else f"whole {r['steps_run']}-step run",
            )
    rows = []
    for e in entrants:
        runs = [by[(e.name, s)] for s in seeds if (e.name, s) in by]
        ratios = [
            r["target_train_s"] / refs[r["seed"]]["seconds"]
            for r in runs
            if r["target_train_s"] is not None and r["seed"] in refs
        ]
        reached = [r for r in runs if r["target_step"] is not None]
        rows.append(
            dict(
                entrant=e.name,
                note=e.note,
                preset=e.preset,
                model=e.model,
                train=e.train,
                reference=e.nanogpt,
                seeds_reaching_target=f"{len(reached)}/{len(runs)}",
                target_steps=[r["target_step"] for r in runs],
                target_tokens=[r["target_tokens"] for r in runs],
                target_train_s=[r["target_train_s"] for r in runs],
                median_ms_per_step=_median(
                    r["median_ms_per_step"] for r in runs if r["median_ms_per_step"] is not None
                ),
                ratio_to_reference=[round(x, 3) for x in ratios],
                median_ratio=round(statistics.median(ratios), 3) if ratios else None,
                final_val_loss=[r["final_val_loss"] for r in runs],
            )
        )
    return rows, refs


def plot(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = [row["entrant"] for row in report["entrants"]]
    styles = ["-", "--", ":", "-."]
    for run in report["runs"]:
        i, k = names.index(run["entrant"]), report["seeds"].index(run["seed"])
        pts = [(c["train_s"], c["val_loss"]) for c in run["curve"]]
        if pts:
            ax.plot(*zip(*pts, strict=True), styles[k % 4], color=colors[i % len(colors)], lw=1.4,
                    label=f"{run['entrant']}, seed {run['seed']}")  # fmt: skip
    ax.axhline(TARGET, color="black", lw=0.8, ls=":", label=f"target {TARGET}")
    ax.set_ylim(TARGET - 0.15, TARGET + 0.9)
    ax.set_xlabel("training time, s (evaluation excluded)")
    ax.set_ylabel("validation loss (fixed set, nats/token)")
    m = report["machine"]
    ax.set_title(f"Shakespeare speedrun, {m['cpu']}, {m['threads']} threads, {report['date']}",
                 fontsize=9)  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def _fmt(xs, f="{}"):
    return " ".join("-" if x is None else f.format(x) for x in xs)


def print_report(report: dict) -> None:
    m = report["machine"]
    print(f"{report['date']}  {m['cpu']}  {m['threads']} threads  torch {m['torch']}")
    print(f"seeds {report['seeds']}; target val loss <= {TARGET}; validation: "
          f"{report['validation']['windows']} windows of {BLOCK} "
          f"({report['validation']['tokens']:,} tokens), every {report['eval_interval']} steps")  # fmt: skip
    print("reference per seed: " + ", ".join(
        f"seed {s}: {r['seconds']:.1f} s ({r['basis']})" for s, r in report["reference"].items()
    ))  # fmt: skip
    for row in report["entrants"]:
        print(f"\n{row['entrant']}  ({row['note']})")
        print(f"  reached target: {row['seeds_reaching_target']} seeds; "
              f"median {_fmt([row['median_ms_per_step']], '{:.1f}')} ms/step")  # fmt: skip
        print(f"  steps to target:  {_fmt(row['target_steps'])}")
        print(f"  tokens to target: {_fmt(row['target_tokens'], '{:,}')}")
        print(f"  seconds to target (training only): {_fmt(row['target_train_s'], '{:.1f}')}")
        print(f"  final val loss: {_fmt(row['final_val_loss'])}")
        if not row["reference"]:
            ratio = row["median_ratio"]
            print(f"  ratio to nanoGPT (same seed): {_fmt(row['ratio_to_reference'], '{:.0%}')}"
                  + (f"; median {ratio:.0%}" if ratio is not None else ""))  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options, checked; a usage error raises ``argparse.ArgumentError`` (one line)."""
    names = "\n".join(
        f'  "{e.name}"' + ("  (always run)" if e.nanogpt else "") + "\n"
        + textwrap.fill(e.note, 92, initial_indent=" " * 6, subsequent_indent=" " * 6)
        for e in ENTRANTS
    )  # fmt: skip
    ap = SettingsParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        epilog=f"entrants (--only takes one name, quoted: names hold spaces):\n{names}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout (model.py)")
    ap.add_argument("--seeds", type=at_least_one, default=3)
    ap.add_argument("--seed0", type=int, default=1337, help="first seed (seeds run seed0 + i)")
    ap.add_argument("--eval-interval", type=at_least_one, default=25)
    ap.add_argument(
        "--threads", type=at_least_one, default=None, help="torch threads (default: all)"
    )
    ap.add_argument("--full", action="store_true", help="run whole recipes, not to the target")
    ap.add_argument("--only", action="append", metavar="NAME",
                    help="an entrant to run (repeatable; the reference always runs)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 seed, 60 steps each")
    ap.add_argument("--json", action="store_true",
                    help=f"write {RESULTS.name}/results_speedrun_DATE.json and .png")  # fmt: skip
    ap.add_argument("--keep", action="store_true",
                    help="keep the working folder (data, checkpoints) and say where")  # fmt: skip
    args = ap.parse_args(argv)
    known = [e.name for e in ENTRANTS]
    for name in args.only or []:
        if name not in known:
            ap.error(f"--only {name!r}: no such entrant; valid: {', '.join(map(repr, known))}")
    if not (args.nanogpt / "model.py").is_file():
        ap.error(f"--nanogpt {args.nanogpt}: no model.py there; pass a checkout of "
                 "https://github.com/karpathy/nanoGPT")  # fmt: skip
    return args


def run_all(args, module, root: Path) -> dict:
    """Every entrant at every seed, interleaved, in ``root``; the report."""
    entrants = [e for e in ENTRANTS if e.nanogpt or not args.only or e.name in args.only]
    max_steps, seeds = None, [args.seed0 + i for i in range(args.seeds)]
    if args.quick:
        max_steps, seeds, args.eval_interval = 60, seeds[:1], 20
    data = data_dir(root)
    chunks = fixed_val_set(data)
    stop = not args.full
    results = []
    for seed in seeds:  # interleaved: every entrant's seed s before any seed s + 1
        for e in entrants:
            print(f"[seed {seed}] {e.name} ...", file=sys.stderr, flush=True)
            try:
                with contextlib.redirect_stdout(sys.stderr):
                    if e.nanogpt:
                        r = run_nanogpt(e, module, data, seed, chunks, args.eval_interval, stop,
                                        max_steps)  # fmt: skip
                    else:
                        r = run_ours(e, data, seed, root / f"{e.name}-{seed}".replace(" ", "_"),
                                     chunks, args.eval_interval, stop, max_steps)  # fmt: skip
            except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM raised as Stopped
                name = getattr(err, "signal_name", "SIGINT")
                raise Stopped(name, str(err) or f"{e.name}, seed {seed}") from None
            hit = r["target_step"]
            print(f"    {r['steps_run']} steps, {r['train_s']:.1f} s training "
                  f"({r['wall_s']:.1f} s wall), final val {r['final_val_loss']}; target "
                  + (f"at step {hit} after {r['target_train_s']:.1f} s" if hit else "not reached"),
                  file=sys.stderr, flush=True)  # fmt: skip
            results.append(r)
    rows, refs = summarise(results, entrants, seeds)
    return dict(
        date=time.strftime("%Y-%m-%d"),
        command="python benchmarks/speedrun.py " + " ".join(sys.argv[1:]),
        machine=dict(
            cpu=cpu_model(),
            threads=torch.get_num_threads(),
            torch=torch.__version__,
            python=platform.python_version(),
        ),  # fmt: skip
        target=TARGET,
        seeds=seeds,
        eval_interval=args.eval_interval,
        stopped_at_target=stop,
        validation=dict(
            windows=VAL_BATCHES * BATCH,
            tokens=VAL_BATCHES * BATCH * BLOCK,
            placement="non-overlapping, evenly spread over the val split",
        ),  # fmt: skip
        clock="sum of training steps' own times; evaluation excluded",
        reference={str(s): r for s, r in refs.items()},
        entrants=rows,
        runs=results,
    )


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except argparse.ArgumentError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    module = load_nanogpt(args.nanogpt)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    root = Path(tempfile.mkdtemp(prefix="speedrun-"))
    on_term = signal.signal(signal.SIGTERM, _raise_stopped)  # the working folder goes then too
    try:
        report = run_all(args, module, root)
    except KeyboardInterrupt as err:
        name = getattr(err, "signal_name", "SIGINT")
        return stopped(PROG, name, f"{str(err) or 'before it finished'}; no report written")
    finally:
        signal.signal(signal.SIGTERM, on_term)
        if args.keep:
            print(f"kept the working folder {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    print_report(report)
    if args.json:
        stem = RESULTS / f"results_speedrun_{report['date']}{'-quick' if args.quick else ''}"
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
        plot(report, stem.with_suffix(".png"))
        print(f"\nwrote {stem}.json and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
