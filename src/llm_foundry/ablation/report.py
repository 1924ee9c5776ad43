"""A study's results as a table (markdown and JSON), verdicts against seed noise, and plots."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np

from llm_foundry.ablation.spec import Study, configs, expand


def first_crossing(curve, target: float):
    """The first point of ``curve`` (tuples or lists whose second item is a validation loss,
    in step order) at or below ``target``, or None if no point gets there."""
    return next((p for p in curve if p[1] is not None and p[1] <= target), None)


def training_seconds(train_records: list[dict], tokens_per_step: int) -> dict[int, float]:
    """step -> seconds spent in training steps up to and including it, from a run's
    metrics.jsonl train records (each step's own time is tokens_per_step / tokens_per_s, so the
    sum leaves out evaluation, checkpoints and logging)."""
    out, total = {}, 0.0
    for r in train_records:
        total += tokens_per_step / r["tokens_per_s"]
        out[r["step"]] = total
    return out


def _mean_std(values: list[float]) -> tuple[float, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return math.nan, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def summarise(
    variants, runs, speed, tokens_per_step, compare: str = "first", target_loss=None
) -> list[dict]:
    """One row per variant: means (and std over seeds) and the verdict against the first
    variant, or against the row before it (``compare="previous"``); with ``target_loss``, also
    each seed's first evaluation at or below it (``to_target``)."""
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
            active_params=rs[0].get("active_params", rs[0]["params"]),
            expert_cv=_mean_or_none([r.get("expert_cv") for r in rs]),
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
        if target_loss is not None:
            row["to_target"] = to_target(rs, target_loss, tokens_per_step, ms)
        row.update(best_val(rs))
        rows.append(row)
    for i, row in enumerate(rows):
        ref = rows[max(i - 1, 0)] if compare == "previous" else rows[0]
        row["delta_val"] = row["val_loss"] - ref["val_loss"]
        row["verdict"] = verdict(row, ref)
        row["delta_best_val"] = row["best_val_loss"] - ref["best_val_loss"]
        best = "reference" if row is ref else verdict(_best_view(row), _best_view(ref))
        row["best_verdict"] = best
    return rows


def best_val(rs: list[dict]) -> dict:
    """Each seed's lowest evaluation and its step, and their mean ± std over seeds: the figure
    to compare when a model overfits before its last step."""
    best = []
    for r in rs:
        points = [(v, s) for s, v in r.get("val_curve") or () if v is not None]
        best.append(min(points, default=(None, None)))
    mean, sd = _mean_std([v for v, _ in best])
    return dict(best_val_loss=mean, best_val_loss_std=sd, best_val_steps=[s for _, s in best])


def _best_view(row: dict) -> dict:
    """``row`` with its best-evaluation figures where ``verdict`` reads the final ones."""
    return dict(
        seeds=row["seeds"],
        val_loss_std=row["best_val_loss_std"],
        delta_val=row["delta_best_val"],
    )


def to_target(rs: list[dict], target: float, tokens_per_step: int, ms_per_iter: float) -> dict:
    """When each run's validation loss first reached ``target``: per seed the evaluation's step,
    tokens and training seconds (None: not reached, or a run saved before training seconds
    were recorded), and the mean step times the variant's ms/iter (a time that does not depend
    on what else the machine ran during training)."""
    steps, secs = [], []
    for r in rs:
        times = r.get("val_curve_train_s") or [None] * len(r["val_curve"])
        hit = first_crossing([(s, v, t) for (s, v), t in zip(r["val_curve"], times, strict=True)],
                             target)  # fmt: skip
        steps.append(hit[0] if hit else None)
        secs.append(hit[2] if hit else None)
    reached = [s for s in steps if s is not None]
    mean_steps = statistics.fmean(reached) if len(reached) == len(rs) else None
    return dict(
        target=target,
        steps=steps,
        tokens=[None if s is None else s * tokens_per_step for s in steps],
        train_s=secs,
        reached=len(reached),
        mean_steps=mean_steps,
        projected_s=None if mean_steps is None else mean_steps * ms_per_iter / 1e3,
    )


def _mean_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


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
    if any(r.get("active_params", r["params"]) != r["params"] for r in rows):
        lines += [
            "",
            "| variant | total params | active params per token | expert load CV |",
            "|---|---|---|---|",
        ]
        for r in rows:
            cv = r.get("expert_cv")
            lines.append(
                f"| {r['variant']} | {r['params']:,} | {r['active_params']:,} | "
                f"{'dense' if cv is None else f'{cv:.3f}'} |"
            )
        lines += [
            "",
            "Expert load CV: standard deviation over mean of the tokens each expert received in "
            "the last logged interval, averaged over layers (0 = perfectly balanced).",
        ]
    timed = (
        "one training step (forward, backward, clip, the variant's optimizer) of every variant "
        f"timed round-robin on one batch after training (median of {st['speed_rounds']} rounds)"
        if any(r.get("ms_per_iter_source") != "training" for r in rows)
        else "the median step time of each run's own training, its first 10 steps left out "
        "(speed_rounds 0: no round-robin timing), so what else the machine ran meanwhile counts"
    )
    lines += [
        "",
        "Train loss: mean of the last 5% of steps; val loss: the final evaluation; ± is the "
        f"standard deviation over seeds. ms/iter and tokens/s: {timed}. Peak memory: CUDA "
        "allocator peak on a GPU; on CPU the "
        "counted bytes of weights, gradients, AdamW moments and saved activations of one step. "
        "Decode: batch-1 greedy with the KV cache, eager. KV bytes per token in fp32.",
    ]
    if any(r.get("best_val_loss", r["val_loss"]) < r["val_loss"] for r in rows):
        lines += _best_table(rows, ref)
    if "to_target" in rows[0]:
        lines += _target_table(rows, st["seeds"])
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


def _best_table(rows: list[dict], ref: str) -> list[str]:
    """The lowest evaluation of each run, shown when some run's validation loss rose after it."""
    lines = [
        "",
        "## Best validation loss (the lowest evaluation of each run)",
        "",
        f"| variant | best val loss | at step (per seed) | Δ best val vs {ref} | verdict |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        steps = " / ".join("n/a" if s is None else str(s) for s in r["best_val_steps"])
        lines.append(
            f"| {r['variant']} | {_pm(r['best_val_loss'], r['best_val_loss_std'])} | {steps} | "
            f"{r['delta_best_val']:+.4f} | {r['best_verdict']} |"
        )
    return lines + [
        "",
        "Some run's validation loss rose after its lowest point (overfitting), so the final "
        "evaluation of the table above and the best one can rank the variants differently. The "
        "best is picked on the validation split itself, so it is slightly optimistic; the "
        "resolution is train.eval_interval.",
    ]


def _target_table(rows: list[dict], seeds: int) -> list[str]:
    target = rows[0]["to_target"]["target"]

    def cells(values, fmt):
        return " / ".join("not reached" if v is None else fmt.format(v) for v in values)

    lines = [
        "",
        f"## Steps and training time to val loss <= {target:g}",
        "",
        "| variant | seeds reaching it | step (per seed) | tokens (per seed) | training s (per seed) "
        "| mean steps x ms/iter |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["to_target"]
        proj = "n/a" if t["projected_s"] is None else f"{t['projected_s']:.1f} s"
        lines.append(
            f"| {r['variant']} | {t['reached']}/{r['seeds']} | {cells(t['steps'], '{}')} | "
            f"{cells(t['tokens'], '{:,}')} | {cells(t['train_s'], '{:.1f}')} | {proj} |"
        )
    return lines + [
        "",
        "Step: the first evaluation at or below the target (so the resolution is "
        "train.eval_interval). Training s: the sum of that run's step times up to it, "
        "evaluation and checkpoints excluded; it depends on whatever else ran on the machine "
        "meanwhile. The last column multiplies the mean step by the ms/iter of the table above "
        "(all variants timed round-robin), which is the steadier time comparison.",
    ]


def write_report(report: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "results.md").write_text(markdown(report))
    plot_val_curves(report, out / "val_loss.png")
    if "extrapolation" in report["rows"][0]:
        plot_extrapolation(report, out / "extrapolation.png")
    if "init_grad_norms" in report:
        plot_grad_norms(report["init_grad_norms"], out / "init_grad_norms.png")


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
    target = report["study"].get("target_loss")
    if target is not None:
        ax.axhline(target, color="black", lw=0.8, ls=":", label=f"target {target:g}")
    finals = [r["val_loss"] for r in report["rows"]]
    lows = [r.get("best_val_loss", r["val_loss"]) for r in report["rows"]]
    ax.set_ylim(min(lows) - 0.1, max(finals) + 0.6)  # zoom on the part where variants differ
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
