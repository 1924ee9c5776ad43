"""Training every variant x seed of a study (resumable, never reusing stale results), the
measurements taken of each trained model, and the probes a recipe can ask for."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import llm_foundry
from llm_foundry import lock
from llm_foundry.ablation.progress import StudyInterrupted, bar, kept_on_interrupt
from llm_foundry.ablation.report import summarise, training_seconds, write_report
from llm_foundry.ablation.spec import Study, Variant, configs, expand, run_dir_name
from llm_foundry.data import PreparedSplit, data_fingerprint, load_meta, parse_sources, split_stream
from llm_foundry.data.preference import is_preference
from llm_foundry.models.position import position_traits
from llm_foundry.models.transformer import Transformer
from llm_foundry.plots import read_metrics
from llm_foundry.rundir import METRICS, RunDir
from llm_foundry.train.build import build_model, build_sampler, is_sft, model_config_for_data
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.optim import build_optimizer, set_lr
from llm_foundry.train.state import write_json_atomic

log = logging.getLogger(__name__)


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


def step_times_ms(
    models: dict[str, Transformer],
    tc: TrainConfig,
    rounds: int,
    train_cfgs: dict[str, TrainConfig] | None = None,
    progress: Callable[[int, int], None] | None = None,
    each_round: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """ms per training step (forward, backward, clip, optimizer) of every model on the same
    batch, timed round-robin so machine noise hits all alike; median over rounds of 10 steps.
    Each model steps the optimizer its ``train_cfgs`` entry names (``tc`` without one), built
    as the trainer builds it, at a small lr. ``progress(done, total)`` is told the models timed
    (rounds x models), ``each_round(r, {name: ms})`` each round's times (r from 1)."""
    g = torch.Generator().manual_seed(0)
    vocab = min(m.cfg.vocab_size for m in models.values())
    device = next(next(iter(models.values())).parameters()).device
    x, y = torch.randint(0, vocab, (2, tc.batch_size, tc.block_size), generator=g).to(device)
    opts = {}
    for k, m in models.items():
        opts[k] = build_optimizer(m, (train_cfgs or {}).get(k, tc), device)
        set_lr(opts[k], 1e-4)

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
    for r in range(rounds):
        for i, name in enumerate(models):
            t = time.perf_counter()
            for _ in range(10):
                step(name)
            samples[name].append((time.perf_counter() - t) / 10 * 1e3)
            if progress:
                progress(r * len(models) + i + 1, rounds * len(models))
        if each_round:
            each_round(r + 1, {k: v[-1] for k, v in samples.items()})
    return {k: statistics.median(v) for k, v in samples.items()}


def extrapolation(
    model: Transformer,
    tokens: np.ndarray,
    block: int,
    factors,
    n_tokens: int,
    progress: Callable[[int], contextlib.AbstractContextManager] | None = None,
    each: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Loss/perplexity at context = factor x block on the first ``n_tokens`` validation tokens
    (non-overlapping windows); learned positions past their table come back "cannot run".
    ``progress(context)`` gives the context in which that context is scored (yielding an
    ``evaluate_tokens`` progress callback or None); ``each(row)`` is told each row when done."""
    from llm_foundry.evaluate import evaluate_tokens

    rows = []
    for f in factors:
        ctx = int(round(f * block))
        windows = max(1, n_tokens // ctx)
        with progress(ctx) if progress else contextlib.nullcontext() as update:
            r = evaluate_tokens(model, tokens, ctx, max_windows=windows, batch_size=4,
                                progress=update)  # fmt: skip
        rows.append(dict(r, factor=f))
        if each:
            each(rows[-1])
    return rows


def run_one(study: Study, variant: Variant, seed_index: int, data: Path, run_dir: Path) -> dict:
    """Train (or resume, or reuse) one variant x seed and measure it; returns its result. A run
    whose loss or gradient norm became non-finite (``TrainingDiverged``) is a result too:
    ``diverged`` {step, message}, what is known without a trained model, and its evaluations
    before it; a rerun reuses it as it reuses a finished one."""
    from llm_foundry.train.trainer import Trainer, TrainingDiverged

    mc, tc = configs(study, variant, seed_index)
    result_file = run_dir / "result.json"
    # everything a result depends on: settings, the corpus and tokenizer, the code that ran
    fingerprint = dict(
        model={**mc.to_dict(), "n_kv_heads": mc.kv_heads},  # None and n_heads are one setting
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
        how = f"diverged at step {done['diverged']['step']}" if "diverged" in done else "finished"
        log.info(f"[{variant.name} seed {seed_index}] {how} earlier: reusing {result_file}")
        return done
    resume = RunDir(run_dir).latest() is not None
    trainer = Trainer(mc, tc, data, run_dir, resume=resume)
    t0 = time.perf_counter()
    try:
        res = trainer.run()
    except TrainingDiverged as e:
        # run() raises before it counts the step whose update it refused
        out = diverged_result(variant, tc, fingerprint, trainer, run_dir, trainer.step + 1, str(e))
        write_json_atomic(result_file, out)
        log.info(f"[{variant.name} seed {seed_index}] diverged: {e} (kept as its result; "
                 "the study goes on)")  # fmt: skip
        return out
    if res.interrupted:
        raise StudyInterrupted(
            res.stopped_by, f"{variant.name} seed {seed_index} interrupted; rerun to resume"
        )
    tag = f"[{variant.name} seed {seed_index}]"
    extra = ""
    if study.extrapolation:
        ctxs = ", ".join(str(int(round(f * tc.block_size))) for f in study.extrapolation)
        extra = f", then its loss at contexts {ctxs} on {study.eval_tokens:,} validation tokens"
    log.info(f"{tag} trained: measuring its training memory and decode speed{extra}")
    with kept_on_interrupt(
        f"measuring {variant.name} seed {seed_index} after its training",
        f"its checkpoint {res.checkpoint} and every run finished before it (the rerun measures "
        "this one again without training it)",
    ):
        out = measure(study, variant, data, run_dir, trainer, res, fingerprint, t0, tag)
        write_json_atomic(result_file, out)
    return out


def measure(study: Study, variant: Variant, data: Path, run_dir: Path, trainer, res,
            fingerprint: dict, t0: float, tag: str) -> dict:  # fmt: skip
    """The result of a run trained since ``t0``: its losses and timings from metrics.jsonl,
    training memory, decode speed and the study's extrapolation (a bar per context where
    train.progress is on, and one line each)."""
    tc = trainer.tc
    model = trainer.model.eval()
    train, evals = read_metrics(run_dir / METRICS)
    tail = [r["loss"] for r in train[-max(1, len(train) // 20) :]]
    dts = [tc.tokens_per_step / r["tokens_per_s"] for r in train[min(10, len(train) - 1) :]]
    seconds = training_seconds(train, tc.tokens_per_step)
    x, y = trainer.sampler.next()
    out = dict(
        variant=variant.name,
        seed=tc.seed,
        fingerprint=fingerprint,
        params=model.num_params(),
        active_params=model.active_params(),
        expert_cv=_final_expert_cv(run_dir),
        train_loss=statistics.fmean(tail),  # mean of the last 5% of steps
        val_loss=evals[-1]["val_loss"] if evals else None,
        val_curve=[(r["step"], r["val_loss"]) for r in evals],
        # seconds of training steps (evaluation and checkpoints excluded) up to each evaluation
        val_curve_train_s=[seconds.get(r["step"]) for r in evals],
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

        def said(row: dict) -> None:
            if "loss" in row:
                log.info(f"{tag} context {row['context']}: loss {row['loss']:.4f}, ppl "
                         f"{row['ppl']:.2f} ({row['windows']} windows)")  # fmt: skip
            else:
                log.info(f"{tag} context {row['context']}: {row['status']} ({row['reason']})")

        val = np.asarray(split_stream(data, "val"))
        out["extrapolation"] = extrapolation(
            model, val, tc.block_size, study.extrapolation, study.eval_tokens,
            progress=lambda ctx: bar(f"{tag} eval context {ctx}", "window", tc.progress),
            each=said,
        )  # fmt: skip
    return out


def diverged_result(variant: Variant, tc: TrainConfig, fingerprint: dict, trainer, run_dir: Path,
                    step: int, message: str) -> dict:  # fmt: skip
    """The result of a run that diverged at ``step``: the model's sizes, its evaluations before
    the divergence, and no losses or timings (there is no trained model to measure)."""
    model = trainer.model
    _, evals = read_metrics(run_dir / METRICS)
    return dict(
        variant=variant.name,
        seed=tc.seed,
        fingerprint=fingerprint,
        diverged=dict(step=step, message=message),
        params=model.num_params(),
        active_params=model.active_params(),
        kv_bytes_per_token=model.kv_cache_bytes_per_token(4),
        val_curve=[(r["step"], r["val_loss"]) for r in evals],
    )


def _final_expert_cv(run_dir: Path) -> float | None:
    """Mean over layers of the expert-load coefficient of variation in the run's last
    expert-load record (None for a dense model): 0 is perfectly balanced."""
    records = [r for r in RunDir(run_dir).metrics() if "experts" in r]
    return statistics.fmean(records[-1]["experts"]["cv"]) if records else None


def run_study(study: Study, data: str | Path, out: str | Path) -> dict:
    """Train every variant x seed (skipping finished ones), then write the table and plots.
    Everything is checked before the first variant trains: the study's fields (as a recipe's
    are), and each variant against the data and this machine's memory."""
    data, out = Path(data), Path(out)
    study = Study.from_dict(study.to_dict())  # a study built in code is checked as a recipe is
    with lock.hold(out, "ablation directory"):
        return _run_study(study, data, out)


def preflight(study: Study, variants: list[Variant], data: Path) -> None:
    """Refuse (one line naming the variant) what would fail only after some variants trained:
    what a variant's trainer checks of the data (``train.build``: block_size within
    max_seq_len, sft_packing / data_sampling against the kind of data, a window of each
    split), a variant too large for this machine's memory, an extrapolation context longer than
    the validation split."""
    from llm_foundry.train.distributed import resolve_device
    from llm_foundry.train.memory import check_training_memory

    val = sum(len(t) for t in PreparedSplit(data, "val").tokens)
    meta = load_meta(data)
    sampled: set[tuple] = set()  # the batch settings whose samplers were built: each once
    for v in variants:
        mc, tc = configs(study, v, 0)
        try:  # what building the variant's trainer checks of the data, as it checks it
            mc = model_config_for_data(mc, tc, meta, data)
            key = (tc.block_size, tc.batch_size, tc.data_sampling, tc.document_mask,
                   tc.sft_packing)  # fmt: skip
            if key not in sampled and not is_preference(meta):  # pairs: train.task=dpo's own
                sampled.add(key)
                for split, seed in (("train", tc.seed), ("val", tc.seed + 1)):
                    build_sampler(parse_sources(data), split, tc, seed, sft=is_sft(meta))
        except ValueError as e:
            raise ValueError(f"variant {v.name!r}: {e}") from None
        if tc.tensorboard:  # MissingExtra now, not after the variants before it trained
            from llm_foundry.train.metrics import require_tensorboard

            require_tensorboard()
        try:
            device = resolve_device(tc.device)
        except ValueError as e:  # a GPU recipe on a machine without one
            runs = len(variants) * study.seeds
            raise ValueError(
                f"variant {v.name!r}: {e} (--set train.device=cpu runs it here anyway: "
                f"{runs} run(s) of {tc.max_steps:,} steps x {tc.tokens_per_step:,} tokens)"
            ) from None
        try:
            check_training_memory(mc, tc, device)
        except ValueError as e:
            raise ValueError(f"variant {v.name!r}: {e}") from None
        for f in study.extrapolation:
            ctx = int(round(f * tc.block_size))
            if position_traits(mc).trained_rows and ctx > mc.max_seq_len:
                continue  # reported as "cannot run", not an error
            if ctx + 1 > val:
                raise ValueError(
                    f"extrapolation factor {f:g} x block_size {tc.block_size} of variant "
                    f"{v.name!r} is a context of {ctx:,} tokens; {data}/val.bin has {val:,} "
                    f"(one window needs {ctx + 1:,}): use smaller factors"
                )


def _run_study(study: Study, data: Path, out: Path) -> dict:
    study = dataclasses.replace(study, model={**study.model, "vocab_size": _vocab(data)})
    variants = expand(study)
    preflight(study, variants, data)
    (out / "study.json").write_text(json.dumps(study.to_dict(), indent=1))
    budgets = {v.name: configs(study, v, 0)[1].tokens_per_step for v in variants}
    if len(set(budgets.values())) > 1:
        log.info(
            f"note: variants differ in tokens per step {budgets}: not an equal-budget comparison"
        )
    runs: dict[str, list[dict]] = {}
    for i, (v, s) in enumerate(itertools.product(variants, range(study.seeds))):
        log.info(f"=== [{i + 1}/{len(variants) * study.seeds}] {v.name}, seed index {s}")
        runs.setdefault(v.name, []).append(
            run_one(study, v, s, data, out / "runs" / run_dir_name(v.name) / f"seed{s}")
        )
    n_runs = sum(len(r) for r in runs.values())
    kept = f"the results of all {n_runs} runs under {out / 'runs'} (the rerun reuses them)"
    tc0 = configs(study, variants[0], 0)[1]
    speed: dict[str, float] = {}
    if study.speed_rounds:
        log.info(f"=== timing every variant's training step, interleaved: {study.speed_rounds} "
                 f"round(s) of 10 steps of each of {len(variants)} variants")  # fmt: skip
        with kept_on_interrupt("timing every variant's training step", kept):
            speed = _time_steps(study, variants, tc0)
    rows = summarise(variants, runs, speed, tc0.tokens_per_step, study.compare, study.target_loss)
    report = dict(study=study.to_dict(), rows=rows, runs=runs, machine=machine())
    for probe in study.probes:
        log.info(f"=== probe {probe}")
        with kept_on_interrupt(f"running the probe {probe}", kept):
            report[probe] = PROBE_FUNCS[probe](study, variants, data)
    write_report(report, out)
    return report


def _time_steps(study: Study, variants: list[Variant], tc0: TrainConfig) -> dict[str, float]:
    """``step_times_ms`` of every variant's training step (a bar where train.progress is on,
    and one line per round)."""
    tcs = {v.name: configs(study, v, 0)[1] for v in variants}
    cpu = torch.device("cpu")
    # the step each variant trains (its adapters, checkpointing), timed: no need for its weights
    models = {v.name: build_model(configs(study, v, 0)[0], tcs[v.name], cpu, init_from=False)
              for v in variants}  # fmt: skip
    rounds = study.speed_rounds

    def said(r: int, ms: dict[str, float]) -> None:
        log.info(f"timing round {r}/{rounds}: "
                 + ", ".join(f"{k} {v:.1f} ms/step" for k, v in ms.items()))  # fmt: skip

    with bar("timing steps", "variant", tc0.progress) as update:
        return step_times_ms(models, tc0, rounds, tcs, progress=update, each_round=said)


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


def probe_init_grad_norms(study: Study, variants: list[Variant], data: Path) -> dict:
    """Per-layer gradient norm of one batch at initialisation, with and without residuals."""
    from llm_foundry.data import BatchSampler
    from llm_foundry.train.monitor import layer_grad_norms

    out = {}
    for v in variants:
        mc, tc = configs(study, v, 0)
        first = PreparedSplit(data, "train").tokens[0]  # one batch: the first shard holds it
        x, y = BatchSampler(first, tc.block_size, tc.batch_size, tc.seed).next()
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
    from llm_foundry.models.norm import RMSNorm

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
