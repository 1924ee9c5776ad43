"""Ablations: train variants of one model under one budget and compare them in one table.

A *study* names a base (preset + model/train overrides), its variants (named override sets
and/or a grid from ``vary``), how many seeds, and optional extras: an evaluation past the
trained context (``extrapolation``) and probes (``init_grad_norms``, ``norm_speed``). Every
variant trains with the same seeds, data and token budget; seed i of every variant uses
``train.seed + i``, so all variants see the same batches.

Layout of ``OUT``: ``study.json``; ``runs/VARIANT/seedI/`` (a normal training run plus
``result.json`` once finished: a finished run is never trained again, an unfinished one resumes
from its latest checkpoint); ``results.json``, ``results.md``, ``val_loss.png`` (and
``extrapolation.png``, probe files) rebuilt from the runs at the end.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import llm_foundry
from llm_foundry import lock
from llm_foundry.config import ModelConfig, load_yaml
from llm_foundry.data import data_fingerprint, load_split
from llm_foundry.models import Transformer
from llm_foundry.plots import read_metrics
from llm_foundry.presets import get_preset
from llm_foundry.train.config import TrainConfig

RECIPES_DIR = Path(__file__).parent / "recipes"
PROBES = ("init_grad_norms", "norm_speed")


@dataclass
class Variant:
    name: str
    model: dict = field(default_factory=dict)  # overrides of the base model config
    train: dict = field(default_factory=dict)  # overrides of the base train config
    preset: str | None = None  # this variant's base preset (default: the study's)


@dataclass
class Study:
    """What to train and compare; a recipe is a YAML file of these fields."""

    name: str = "ablation"
    description: str = ""
    claim: str = ""  # the claim under test, as the design documents state it
    preset: str | None = "llama-shakespeare-char"
    model: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)
    variants: list[Variant] = field(default_factory=list)
    vary: dict[str, list] = field(default_factory=dict)  # grid: field -> values
    seeds: int = 1
    extrapolation: list[float] = field(default_factory=list)  # eval contexts, x block_size
    eval_tokens: int = 32768  # validation tokens scored per extrapolation context
    probes: list[str] = field(default_factory=list)
    speed_rounds: int = 5  # interleaved timing rounds of every variant's training step
    compare: str = "first"  # verdicts against the first variant, or "previous" (one change a step)

    @classmethod
    def from_dict(cls, d: dict) -> Study:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown study field(s) {unknown}; valid: {sorted(known)}")
        d = dict(d)
        d["variants"] = [
            v if isinstance(v, Variant) else Variant(**v) for v in d.get("variants", [])
        ]
        study = cls(**d)
        bad = [p for p in study.probes if p not in PROBES]
        if bad:
            raise ValueError(f"unknown probe(s) {bad}; valid: {', '.join(PROBES)}")
        if study.compare not in ("first", "previous"):
            raise ValueError(f"compare={study.compare!r}: valid values are 'first', 'previous'")
        if not isinstance(study.seeds, int) or study.seeds < 1:
            raise ValueError(f"seeds={study.seeds!r} must be a positive integer")
        return study

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def load_study(source: str | Path) -> Study:
    """A built-in recipe by name, or a YAML/JSON study file."""
    path = RECIPES_DIR / f"{source}.yaml"
    if not path.exists():
        path = Path(source)
    if not path.exists():
        raise FileNotFoundError(
            f"no recipe or study file {str(source)!r}; built-in recipes: {', '.join(recipe_names())}"
        )
    return Study.from_dict(load_yaml(path.read_text()) or {})


# ----------------------------------------------------------------------------------------------
# Grids and overrides: "norm=layernorm,rmsnorm", "train.lr=1e-3,3e-3"


def _split_target(key: str) -> tuple[str, str]:
    """'train.lr' -> ('train', 'lr'); 'norm' or 'model.norm' -> ('model', 'norm')."""
    section, _, name = key.rpartition(".")
    section = section or "model"
    valid_fields = {
        "model": {f.name for f in dataclasses.fields(ModelConfig)},
        "train": {f.name for f in dataclasses.fields(TrainConfig)},
    }
    if section not in valid_fields:
        raise ValueError(f"{key!r}: prefix must be model. or train.; got {section!r}")
    if name not in valid_fields[section]:
        raise ValueError(
            f"{key!r}: {section} has no field {name!r}; valid: {', '.join(sorted(valid_fields[section]))}"
        )
    return section, name


def parse_assignment(item: str) -> tuple[str, str, list]:
    """'field=a,b' -> (section, field, [a, b]) with YAML scalar typing (1e-3 -> float)."""
    key, eq, values = item.partition("=")
    if not eq or not values:
        raise ValueError(f"expected FIELD=VALUE[,VALUE...], got {item!r}")
    section, name = _split_target(key.strip())
    return section, name, [_scalar(v) for v in values.split(",")]


def _scalar(text: str):
    """'4' -> 4, '1e-3' -> 0.001 (YAML 1.1 would keep it a string), 'true' -> True, else str."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return load_yaml(text)


def expand(study: Study) -> list[Variant]:
    """The study's variants times its ``vary`` grid (every combination), uniquely named."""
    base = study.variants or [Variant(name="")]
    axes = [(parse_assignment(f"{k}=x")[:2], list(v)) for k, v in study.vary.items()]
    out = []
    for v in base:
        for combo in itertools.product(*[vals for _, vals in axes]) if axes else [()]:
            model, train, parts = dict(v.model), dict(v.train), [v.name] if v.name else []
            for ((section, name), _), value in zip(axes, combo, strict=True):
                (model if section == "model" else train)[name] = value
                parts.append(f"{name}={value}")
            out.append(Variant(",".join(parts) or "base", model, train, v.preset))
    names = [v.name for v in out]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must be unique; got {names}")
    return out


def configs(study: Study, variant: Variant, seed_index: int) -> tuple[ModelConfig, TrainConfig]:
    preset = variant.preset or study.preset
    changes = {**study.model, **variant.model}
    mc = get_preset(preset).replace(**changes) if preset else ModelConfig.from_dict(changes)
    tc = TrainConfig.from_dict({**study.train, **variant.train})
    return mc, dataclasses.replace(tc, seed=tc.seed + seed_index)


# ----------------------------------------------------------------------------------------------
# Measurements of one trained model


def training_memory_bytes(model: Transformer, x: torch.Tensor, y: torch.Tensor) -> int:
    """Peak training memory of one step. CUDA: the allocator's peak. CPU (no allocator
    statistics): counted bytes of weights + gradients + AdamW's two moments + the activations
    autograd saves for the backward pass (each storage once)."""
    if x.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        model(x, y)[1].backward()
        model.zero_grad(set_to_none=True)
        return torch.cuda.max_memory_allocated()
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)[1]
    loss.backward()
    model.zero_grad(set_to_none=True)
    activations = sum(n for ptr, n in seen.items() if ptr not in params)
    return 4 * sum(params.values()) + activations


@torch.no_grad()
def decode_tokens_per_s(model: Transformer, n_tokens: int | None = None, repeats: int = 3) -> float:
    """Batch-1 greedy decoding speed with the KV cache (eager), median of ``repeats``."""
    from llm_foundry.generate import generate

    n = n_tokens or model.cfg.max_seq_len - 1
    idx = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
    generate(model, idx, 4, temperature=0.0)  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        generate(model, idx, n, temperature=0.0)
        times.append(time.perf_counter() - t)
    return n / statistics.median(times)


def step_times_ms(models: dict[str, Transformer], tc: TrainConfig, rounds: int) -> dict[str, float]:
    """ms per training step (forward, backward, clip, AdamW) of every model on the same batch,
    timed round-robin so machine noise hits all alike; median over rounds of 10 steps."""
    g = torch.Generator().manual_seed(0)
    vocab = min(m.cfg.vocab_size for m in models.values())
    device = next(next(iter(models.values())).parameters()).device
    x, y = torch.randint(0, vocab, (2, tc.batch_size, tc.block_size), generator=g).to(device)
    opts = {
        k: torch.optim.AdamW(m.param_groups(0.1), lr=1e-4, fused=device.type in ("cpu", "cuda"))
        for k, m in models.items()
    }

    def step(name: str) -> None:
        m = models[name]
        loss = m(x, y)[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        loss.item()

    for name in models:  # warm-up
        for _ in range(3):
            step(name)
    samples: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(rounds):
        for name in models:
            t = time.perf_counter()
            for _ in range(10):
                step(name)
            samples[name].append((time.perf_counter() - t) / 10 * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def extrapolation(model: Transformer, tokens: np.ndarray, block: int, factors, n_tokens: int):
    """Loss/perplexity at context = factor x block on the first ``n_tokens`` validation tokens
    (non-overlapping windows); learned positions past their table come back "cannot run"."""
    from llm_foundry.evaluate import evaluate_tokens

    rows = []
    for f in factors:
        ctx = int(round(f * block))
        windows = max(1, n_tokens // ctx)
        r = evaluate_tokens(model, tokens, ctx, max_windows=windows, batch_size=4)
        rows.append(dict(r, factor=f))
    return rows


# ----------------------------------------------------------------------------------------------
# One run


def run_one(study: Study, variant: Variant, seed_index: int, data: Path, run_dir: Path) -> dict:
    """Train (or resume, or reuse) one variant x seed and measure it; returns its result."""
    from llm_foundry.train.state import latest_checkpoint
    from llm_foundry.train.trainer import Trainer

    mc, tc = configs(study, variant, seed_index)
    result_file = run_dir / "result.json"
    # everything a result depends on: settings, the corpus and tokenizer, the code that ran
    fingerprint = dict(
        model=mc.to_dict(),
        train=tc.to_dict(),
        data=data_fingerprint(data),
        code=dict(llm_foundry=llm_foundry.__version__),
    )
    fingerprint = json.loads(json.dumps(fingerprint))  # tuples as lists, as read back
    if result_file.exists():
        try:
            done = json.loads(result_file.read_text())
            saved = done["fingerprint"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{result_file} is damaged ({e!r}); delete it to train that run again"
            ) from None
        changed = [
            f"{s}.{k}"
            for s in fingerprint
            for k in fingerprint[s]
            if (saved.get(s) or {}).get(k) != fingerprint[s][k]
        ]
        if changed:
            raise ValueError(
                f"{run_dir} holds a result made from other inputs ({', '.join(changed)} "
                "differ), so it is not reused: use another --out, or delete that directory to "
                "train it again"
            )
        print(f"[{variant.name} seed {seed_index}] finished earlier: reusing {result_file}")
        return done
    resume = latest_checkpoint(run_dir / "checkpoints") is not None
    trainer = Trainer(mc, tc, data, run_dir, resume=resume)
    t0 = time.perf_counter()
    res = trainer.run()
    if res.interrupted:
        raise KeyboardInterrupt(f"{variant.name} seed {seed_index} interrupted; rerun to resume")
    model = trainer.model.eval()
    train, evals = read_metrics(run_dir / "metrics.jsonl")
    tail = [r["loss"] for r in train[-max(1, len(train) // 20) :]]
    dts = [tc.tokens_per_step / r["tokens_per_s"] for r in train[min(10, len(train) - 1) :]]
    x, y = trainer.sampler.next()
    out = dict(
        variant=variant.name,
        seed=tc.seed,
        fingerprint=fingerprint,
        params=model.num_params(),
        train_loss=statistics.fmean(tail),  # mean of the last 5% of steps
        val_loss=evals[-1]["val_loss"] if evals else None,
        val_curve=[(r["step"], r["val_loss"]) for r in evals],
        train_ms_per_iter=statistics.median(dts) * 1e3,
        train_wall_s=time.perf_counter() - t0,
        peak_mem_bytes=training_memory_bytes(
            model.train(), x.to(trainer.device), y.to(trainer.device)
        ),
        decode_tokens_per_s=decode_tokens_per_s(model.eval()),
        kv_bytes_per_token=model.kv_cache_bytes_per_token(4),
        skipped_steps=res.skipped_steps,
    )
    if study.extrapolation:
        val = np.asarray(load_split(data, "val"))
        out["extrapolation"] = extrapolation(
            model, val, tc.block_size, study.extrapolation, study.eval_tokens
        )
    result_file.write_text(json.dumps(out, indent=1))
    return out


# ----------------------------------------------------------------------------------------------
# The whole study


def run_study(study: Study, data: str | Path, out: str | Path) -> dict:
    """Train every variant x seed (skipping finished ones), then write the table and plots."""
    data, out = Path(data), Path(out)
    with lock.hold(out, "ablation directory"):
        return _run_study(study, data, out)


def _run_study(study: Study, data: Path, out: Path) -> dict:
    study = dataclasses.replace(study, model={**study.model, "vocab_size": _vocab(data)})
    variants = expand(study)
    (out / "study.json").write_text(json.dumps(study.to_dict(), indent=1))
    budgets = {v.name: configs(study, v, 0)[1].tokens_per_step for v in variants}
    if len(set(budgets.values())) > 1:
        print(f"note: variants differ in tokens per step {budgets}: not an equal-budget comparison")
    runs: dict[str, list[dict]] = {}
    for i, (v, s) in enumerate(itertools.product(variants, range(study.seeds))):
        print(f"=== [{i + 1}/{len(variants) * study.seeds}] {v.name}, seed index {s}")
        runs.setdefault(v.name, []).append(
            run_one(study, v, s, data, out / "runs" / _slug(v.name) / f"seed{s}")
        )
    print("=== timing every variant's training step, interleaved")
    models = {v.name: Transformer(configs(study, v, 0)[0]) for v in variants}
    tc0 = configs(study, variants[0], 0)[1]
    speed = step_times_ms(models, tc0, study.speed_rounds) if study.speed_rounds else {}
    rows = summarise(variants, runs, speed, tc0.tokens_per_step, study.compare)
    report = dict(study=study.to_dict(), rows=rows, runs=runs, machine=machine())
    for probe in study.probes:
        print(f"=== probe {probe}")
        report[probe] = PROBE_FUNCS[probe](study, variants, data)
    write_report(report, out)
    return report


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in name)[:120] or "base"


def _mean_std(values: list[float]) -> tuple[float, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return math.nan, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def summarise(variants, runs, speed, tokens_per_step, compare: str = "first") -> list[dict]:
    """One row per variant: means (and std over seeds) and the verdict against the first
    variant, or against the row before it (``compare="previous"``)."""
    rows = []
    for v in variants:
        rs = runs[v.name]
        val, val_sd = _mean_std([r["val_loss"] for r in rs])
        train, train_sd = _mean_std([r["train_loss"] for r in rs])
        ms = speed.get(v.name, statistics.median(r["train_ms_per_iter"] for r in rs))
        row = dict(
            variant=v.name,
            seeds=len(rs),
            params=rs[0]["params"],
            train_loss=train,
            train_loss_std=train_sd,
            val_loss=val,
            val_loss_std=val_sd,
            ms_per_iter=ms,
            ms_per_iter_source="interleaved" if v.name in speed else "training",
            tokens_per_s=tokens_per_step / ms * 1e3,
            peak_mem_mib=max(r["peak_mem_bytes"] for r in rs) / 2**20,
            decode_tokens_per_s=statistics.median(r["decode_tokens_per_s"] for r in rs),
            kv_bytes_per_token=rs[0]["kv_bytes_per_token"],
        )
        if "extrapolation" in rs[0]:
            row["extrapolation"] = _mean_extrapolation(rs)
        rows.append(row)
    for i, row in enumerate(rows):
        ref = rows[max(i - 1, 0)] if compare == "previous" else rows[0]
        row["delta_val"] = row["val_loss"] - ref["val_loss"]
        row["verdict"] = verdict(row, ref)
    return rows


def verdict(row: dict, ref: dict) -> str:
    """'better'/'worse' only when the difference exceeds twice its standard error over seeds."""
    if row is ref:
        return "reference"
    if row["val_loss_std"] is None or ref["val_loss_std"] is None:
        return "1 seed: noise unknown"
    se = math.sqrt(
        row["val_loss_std"] ** 2 / row["seeds"] + ref["val_loss_std"] ** 2 / ref["seeds"]
    )
    if abs(row["delta_val"]) <= 2 * se:
        return f"within seed noise (2 s.e. = {2 * se:.3f})"
    return f"{'better' if row['delta_val'] < 0 else 'worse'} (> 2 s.e. = {2 * se:.3f})"


def _mean_extrapolation(rs: list[dict]) -> list[dict]:
    out = []
    for i, first in enumerate(rs[0]["extrapolation"]):
        cells = [r["extrapolation"][i] for r in rs]
        if "loss" not in first:
            out.append(dict(factor=first["factor"], context=first["context"], status="cannot run"))
            continue
        loss, sd = _mean_std([c["loss"] for c in cells])
        out.append(
            dict(
                factor=first["factor"],
                context=first["context"],
                loss=loss,
                loss_std=sd,
                ppl=math.exp(loss),
            )
        )
    return out


def machine() -> dict:
    import platform

    import llm_foundry

    return dict(
        date=time.strftime("%Y-%m-%d"),
        cpu=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        cuda=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        torch=torch.__version__,
        llm_foundry=llm_foundry.__version__,
    )


# ----------------------------------------------------------------------------------------------
# Probes: measurements a recipe asks for besides training


def probe_init_grad_norms(study: Study, variants: list[Variant], data: Path) -> dict:
    """Per-layer gradient norm of one batch at initialisation, with and without residuals."""
    from llm_foundry.data import BatchSampler
    from llm_foundry.monitor import layer_grad_norms

    out = {}
    for v in variants:
        mc, tc = configs(study, v, 0)
        x, y = BatchSampler(load_split(data, "train"), tc.block_size, tc.batch_size, tc.seed).next()
        for residual in (True, False):
            torch.manual_seed(tc.seed)
            model = Transformer(mc.replace(residual=residual, vocab_size=_vocab(data)))
            model(x, y)[1].backward()
            out[f"{v.name}, residual={residual}"] = layer_grad_norms(model)
    return out


NORM_SPEED_SHAPES = [(768, 128), (8192, 768), (8192, 4096)]  # (rows, dim): this recipe, GPT-2, 7B


def probe_norm_speed(study: Study, variants: list[Variant], data: Path) -> dict:
    """LayerNorm vs RMSNorm alone: forward and forward+backward ms on (rows, dim) inputs, eager
    and compiled, interleaved rounds, median."""
    from llm_foundry.models.components import RMSNorm

    shapes = NORM_SPEED_SHAPES
    impls = {"layernorm": lambda d: torch.nn.LayerNorm(d), "rmsnorm": lambda d: RMSNorm(d)}
    rows = []
    for rows_, dim in shapes:
        x = torch.randn(rows_, dim, requires_grad=True)
        g = torch.randn(rows_, dim)
        fns = {}
        for name, make in impls.items():
            for compiled in (False, True):
                m = make(dim)
                f = torch.compile(m) if compiled else m
                fns[(name, compiled, "fwd")] = lambda f=f, x=x: f(x.detach())
                fns[(name, compiled, "fwd+bwd")] = lambda f=f, x=x, g=g: f(x).backward(g)
        reps = min(200, max(3, int(2e7 // (rows_ * dim))))  # ~equal time per shape
        times: dict = {k: [] for k in fns}
        for fn in fns.values():  # warm-up and compile
            fn()
            fn()
        for _ in range(7):
            for k, fn in fns.items():
                t = time.perf_counter()
                for _ in range(reps):
                    fn()
                times[k].append((time.perf_counter() - t) / reps * 1e3)
        for (name, compiled, what), ts in times.items():
            rows.append(
                dict(
                    shape=[rows_, dim],
                    norm=name,
                    compiled=compiled,
                    op=what,
                    ms=statistics.median(ts),
                )
            )
    return dict(rows=rows)


def _vocab(data: Path) -> int:
    from llm_foundry.data import load_meta

    return load_meta(data)["vocab_size"]


PROBE_FUNCS = {"init_grad_norms": probe_init_grad_norms, "norm_speed": probe_norm_speed}


# ----------------------------------------------------------------------------------------------
# Report: markdown, JSON, plots


def _pm(mean: float, sd: float | None, digits: int = 4) -> str:
    if mean is None or math.isnan(mean):
        return "n/a"
    return f"{mean:.{digits}f}" + (f" ± {sd:.{digits}f}" if sd is not None else "")


def markdown(report: dict) -> str:
    st, rows, m = report["study"], report["rows"], report["machine"]
    ref = "previous row" if st.get("compare") == "previous" else rows[0]["variant"]
    lines = [f"# {st['name']}", ""]
    if st["description"]:
        lines += [st["description"].strip(), ""]
    if st["claim"]:
        lines += [f"Claim under test: {st['claim'].strip()}", ""]
    tc = configs(Study.from_dict(st), expand(Study.from_dict(st))[0], 0)[1]
    lines += [
        f"Budget: {tc.max_steps} steps x {tc.tokens_per_step:,} tokens, seeds {st['seeds']} "
        f"(train.seed + 0..{st['seeds'] - 1}). Machine: {m['cpu']}, {m['threads']} threads, "
        f"{m['cuda'] or 'no GPU'}, torch {m['torch']}, {m['date']}.",
        "",
        f"| variant | params | train loss | val loss | Δ val vs {ref} | verdict | ms/iter | tokens/s | peak mem MiB | decode tok/s | KV B/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['params']:,} | {_pm(r['train_loss'], r['train_loss_std'])} | "
            f"{_pm(r['val_loss'], r['val_loss_std'])} | {r['delta_val']:+.4f} | {r['verdict']} | "
            f"{r['ms_per_iter']:.1f} | {r['tokens_per_s']:,.0f} | {r['peak_mem_mib']:.1f} | "
            f"{r['decode_tokens_per_s']:.0f} | {r['kv_bytes_per_token']:,} |"
        )
    lines += [
        "",
        "Train loss: mean of the last 5% of steps; val loss: the final evaluation; ± is the "
        "standard deviation over seeds. ms/iter and tokens/s: one training step (forward, backward, "
        "clip, AdamW) of every variant timed round-robin on one batch after training (median of "
        f"{st['speed_rounds']} rounds). Peak memory: CUDA allocator peak on a GPU; on CPU the "
        "counted bytes of weights, gradients, AdamW moments and saved activations of one step. "
        "Decode: batch-1 greedy with the KV cache, eager. KV bytes per token in fp32.",
    ]
    if "extrapolation" in rows[0]:
        lines += ["", "## Loss past the training context", ""]
        ex0 = rows[0]["extrapolation"]
        lines.append(
            "| variant | " + " | ".join(f"{e['context']} ({e['factor']:g}x)" for e in ex0) + " |"
        )
        lines.append("|---" * (len(ex0) + 1) + "|")
        for r in rows:
            cells = [
                "cannot run" if "loss" not in e else f"{e['loss']:.3f} (ppl {e['ppl']:.2f})"
                for e in r["extrapolation"]
            ]
            lines.append(f"| {r['variant']} | " + " | ".join(cells) + " |")
        lines += [
            "",
            f"Validation loss on the first {st['eval_tokens']:,} validation tokens in "
            "non-overlapping windows of each context; every token is scored once.",
        ]
    if "init_grad_norms" in report:
        lines += ["", "## Gradient norm per layer at initialisation (one batch)", ""]
        g = report["init_grad_norms"]
        n = len(next(iter(g.values())))
        lines.append("| model | " + " | ".join(f"layer {i}" for i in range(n)) + " | first/last |")
        lines.append("|---" * (n + 2) + "|")
        for k, norms in g.items():
            ratio = norms[0] / norms[-1] if norms[-1] else math.inf
            lines.append(f"| {k} | " + " | ".join(f"{x:.3g}" for x in norms) + f" | {ratio:.3g} |")
    if "norm_speed" in report:
        lines += ["", "## LayerNorm vs RMSNorm alone (ms per call, median)", ""]
        lines += [
            "| shape | mode | op | layernorm | rmsnorm | layernorm / rmsnorm |",
            "|---|---|---|---|---|---|",
        ]
        cells: dict = {}
        for r in report["norm_speed"]["rows"]:
            cells.setdefault((tuple(r["shape"]), r["compiled"], r["op"]), {})[r["norm"]] = r["ms"]
        for (shape, comp, op), c in cells.items():
            lines.append(
                f"| {shape[0]}x{shape[1]} | {'compiled' if comp else 'eager'} | {op} | "
                f"{c['layernorm']:.3f} | {c['rmsnorm']:.3f} | {c['layernorm'] / c['rmsnorm']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def write_report(report: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "results.md").write_text(markdown(report))
    plot_val_curves(report, out / "val_loss.png")
    if "extrapolation" in report["rows"][0]:
        plot_extrapolation(report, out / "extrapolation.png")
    if "init_grad_norms" in report:
        plot_grad_norms(report["init_grad_norms"], out / "init_grad_norms.png")
    print(f"wrote {out / 'results.md'}, {out / 'results.json'} and plots")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(fig, ax, png: Path) -> None:
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png)
    _plt().close(fig)


def plot_val_curves(report: dict, png: Path) -> None:
    """Validation loss against step, one line per variant (mean over seeds, band = min..max)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=100)
    for name, rs in report["runs"].items():
        steps = [s for s, _ in rs[0]["val_curve"]]
        curves = np.array([[v for _, v in r["val_curve"]] for r in rs])
        (line,) = ax.plot(steps, curves.mean(0), "o-", ms=3, lw=1.6, label=name)
        if len(rs) > 1:
            ax.fill_between(steps, curves.min(0), curves.max(0), color=line.get_color(), alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(f"{report['study']['name']}: validation loss ({report['study']['seeds']} seed(s))")
    lows = [r["val_loss"] for r in report["rows"]]
    ax.set_ylim(min(lows) - 0.1, max(lows) + 0.6)  # zoom on the part where variants differ
    ax.grid(alpha=0.3)
    _finish(fig, ax, png)


def plot_extrapolation(report: dict, png: Path) -> None:
    """Perplexity against evaluation context (log x); runs that cannot run are left out."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for r in report["rows"]:
        pts = [(e["context"], e["ppl"]) for e in r["extrapolation"] if "ppl" in e]
        if pts:
            ax.plot(*zip(*pts, strict=True), "o-", lw=1.8, label=r["variant"])
    block = report["rows"][0]["extrapolation"][0]["context"]
    ax.axvline(block, color="grey", ls=":", label="training context")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    from matplotlib.ticker import FormatStrFormatter

    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_xlabel("evaluation context (tokens)")
    ax.set_ylabel("validation perplexity")
    ax.set_title(f"{report['study']['name']}: perplexity past the training context")
    ax.grid(alpha=0.3, which="both")
    _finish(fig, ax, png)


def plot_grad_norms(norms: dict, png: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for name, values in norms.items():
        ax.plot(range(len(values)), values, "o-" if "True" in name else "x--", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("gradient norm at initialisation")
    ax.set_title("per-layer gradient norm, one batch at initialisation")
    ax.grid(alpha=0.3, which="both")
    _finish(fig, ax, png)


# ----------------------------------------------------------------------------------------------
# llm-foundry ablate


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="llm-foundry ablate",
        description="Train variants of one model with the same seeds, data and budget; write a "
        "table (markdown + JSON) and the validation curves. Rerunning skips finished variants.",
    )
    p.add_argument("--recipe", help=f"built-in study: {', '.join(recipe_names())}, or a YAML file")
    p.add_argument(
        "--preset", help="base architecture (default: the recipe's, else llama-shakespeare-char)"
    )
    p.add_argument(
        "--vary",
        action="append",
        default=[],
        metavar="FIELD=V1,V2",
        help="grid axis; model field by default, train.FIELD for training (repeatable)",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="FIELD=V", help="override for every variant"
    )
    p.add_argument("--seeds", type=int, help="seeds per variant (mean ± std)")
    p.add_argument("--data", default="data/shakespeare_char", help="directory written by prepare")
    p.add_argument("--out", help="output directory (default runs/ablate-NAME)")
    p.add_argument("--list", action="store_true", help="list the built-in recipes and exit")
    p.add_argument(
        "--report", metavar="DIR", help="rebuild DIR's table and plots from its results.json"
    )
    ns = p.parse_args(argv)
    if ns.report:
        report = json.loads((Path(ns.report) / "results.json").read_text())
        write_report(report, Path(ns.report))
        return 0
    if ns.list:
        for name in recipe_names():
            s = load_study(name)
            print(f"{name:<20} {s.description.strip().splitlines()[0] if s.description else ''}")
        return 0
    study = load_study(ns.recipe) if ns.recipe else Study()
    if ns.preset:
        study.preset = ns.preset
    if ns.seeds is not None:
        study.seeds = ns.seeds
    for item in ns.set:
        section, name, values = parse_assignment(item)
        getattr(study, section)[name] = values[0]
    for item in ns.vary:
        section, name, values = parse_assignment(item)
        study.vary[name if section == "model" else f"train.{name}"] = values
    if not study.variants and not study.vary:
        raise ValueError("nothing to compare: give --recipe NAME or at least one --vary FIELD=A,B")
    study = Study.from_dict(study.to_dict())  # validate
    data = Path(ns.data)
    if not (data / "meta.json").exists():
        if ns.data != "data/shakespeare_char":
            raise FileNotFoundError(
                f"{data / 'meta.json'} not found: run llm-foundry prepare first"
            )
        from llm_foundry.data import prepare

        print(f"preparing the default corpus (tiny Shakespeare, characters) in {data}")
        prepare(data, dataset="shakespeare", tokenizer="char")
    for v in expand(study):  # fail on a bad variant before training anything
        configs(study, v, 0)
    out = Path(ns.out or f"runs/ablate-{study.name}")
    report = run_study(study, data, out)
    print(markdown(report))
    return 0
