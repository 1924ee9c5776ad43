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
        if any("diverged" in r for r in rs):
            rows.append(diverged_row(v.name, rs, speed, tokens_per_step))
            continue
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
        if "diverged" in row:  # its verdict is its status
            continue
        if "diverged" in ref:  # nothing to compare with
            row["delta_val"] = row["delta_best_val"] = None
            row["verdict"] = row["best_verdict"] = f"no comparison: {ref['variant']} diverged"
            continue
        row["delta_val"] = row["val_loss"] - ref["val_loss"]
        row["verdict"] = verdict(row, ref)
        row["delta_best_val"] = row["best_val_loss"] - ref["best_val_loss"]
        best = "reference" if row is ref else verdict(_best_view(row), _best_view(ref))
        row["best_verdict"] = best
    return rows


def diverged_text(rs: list[dict]) -> str:
    """'diverged at step 7', or with seeds 'diverged at step 7 (seed 1338; 1 of 3 seeds)'."""
    hit = [r for r in rs if "diverged" in r]
    steps = ", ".join(str(r["diverged"]["step"]) for r in hit)
    text = f"diverged at step{'s' * (len(hit) > 1)} {steps}"
    if len(rs) > 1:
        seeds = ", ".join(str(r["seed"]) for r in hit)
        text += f" (seed{'s' * (len(hit) > 1)} {seeds}; {len(hit)} of {len(rs)} seeds)"
    return text


def diverged_row(name: str, rs: list[dict], speed: dict, tokens_per_step: int) -> dict:
    """The row of a variant a seed of which diverged: its sizes and interleaved step time (they
    do not depend on training), its status as the verdict, no losses (the seeds that finished
    are in the report's runs)."""
    ms = speed.get(name)
    status = diverged_text(rs)
    return dict(
        variant=name,
        seeds=len(rs),
        params=rs[0]["params"],
        active_params=rs[0].get("active_params", rs[0]["params"]),
        expert_cv=None,
        diverged=[dict(seed=r["seed"], **r["diverged"]) for r in rs if "diverged" in r],
        train_loss=None,
        train_loss_std=None,
        val_loss=None,
        val_loss_std=None,
        ms_per_iter=ms,
        ms_per_iter_source="interleaved" if ms is not None else None,
        tokens_per_s=None if ms is None else tokens_per_step / ms * 1e3,
        peak_mem_mib=None,
        decode_tokens_per_s=None,
        kv_bytes_per_token=rs[0]["kv_bytes_per_token"],
        best_val_loss=None,
        best_val_loss_std=None,
        best_val_steps=[],
        delta_val=None,
        delta_best_val=None,
        verdict=status,
        best_verdict=status,
    )


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
        if "diverged" in r:
            val, verdict_ = r["verdict"], "diverged"
        else:
            val, verdict_ = _pm(r["val_loss"], r["val_loss_std"]), r["verdict"]
        lines.append(
            f"| {r['variant']} | {r['params']:,} | {_pm(r['train_loss'], r['train_loss_std'])} | "
            f"{val} | {_cell(r['delta_val'], '+.4f')} | {verdict_} | "
            f"{_cell(r['ms_per_iter'], '.1f')} | {_cell(r['tokens_per_s'], ',.0f')} | "
            f"{_cell(r['peak_mem_mib'], '.1f')} | {_cell(r['decode_tokens_per_s'], '.0f')} | "
            f"{r['kv_bytes_per_token']:,} |"
        )
    if any(r.get("active_params", r["params"]) != r["params"] for r in rows):
        lines += [
            "",
            "| variant | total params | active params per token | expert load CV |",
            "|---|---|---|---|",
        ]
        for r in rows:
            cv = r.get("expert_cv")
            cv_text = "n/a" if "diverged" in r else "dense" if cv is None else f"{cv:.3f}"
            lines.append(
                f"| {r['variant']} | {r['params']:,} | {r['active_params']:,} | {cv_text} |"
            )
        lines += [
            "",
            "Expert load CV: standard deviation over mean of the tokens each expert received in "
            "the last logged interval, averaged over layers (0 = perfectly balanced).",
        ]
    timed = (
        "one training step (forward, backward, clip, the variant's optimizer) of every variant "
        f"timed round-robin on one batch after training (median of {st['speed_rounds']} rounds)"
        if any(r.get("ms_per_iter_source") != "training" for r in rows if "diverged" not in r)
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
    if any(
        "diverged" not in r and r.get("best_val_loss", r["val_loss"]) < r["val_loss"] for r in rows
    ):
        lines += _best_table(rows, ref)
    if any("to_target" in r for r in rows):
        lines += _target_table(rows, st["seeds"])
    if ex0 := _extrapolation_of(rows):
        lines += ["", "## Loss past the training context", ""]
        lines.append(
            "| variant | " + " | ".join(f"{e['context']} ({e['factor']:g}x)" for e in ex0) + " |"
        )
        lines.append("|---" * (len(ex0) + 1) + "|")
        for r in rows:
            cells = [
                "cannot run" if "loss" not in e else f"{e['loss']:.3f} (ppl {e['ppl']:.2f})"
                for e in r.get("extrapolation") or [{}] * len(ex0)
            ]
            if "diverged" in r:
                cells = [r["verdict"]] * len(ex0)
            lines.append(f"| {r['variant']} | " + " | ".join(cells) + " |")
        lines += [
            "",
            f"Validation loss on the first {st['eval_tokens']:,} validation tokens in "
            "non-overlapping windows of each context; every token is scored once.",
        ]
    if any("diverged" in r for r in rows):
        lines += _diverged_section(report)
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


def _cell(x, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _extrapolation_of(rows: list[dict]) -> list[dict] | None:
    """The extrapolation cells of the first row that has them (a diverged row has none)."""
    return next((r["extrapolation"] for r in rows if "extrapolation" in r), None)


def _diverged_section(report: dict) -> list[str]:
    """Each diverged run with the trainer's message: which value was not finite, and what to
    change. Its evaluations before that are in the plot."""
    lines = ["", "## Diverged runs", ""]
    for r in report["rows"]:
        for d in r.get("diverged") or []:
            lines.append(f"- {r['variant']}, seed {d['seed']}: {d['message']}")
    return lines + [
        "",
        "A diverged run is a result: rerunning the study reuses it (and trains the others); "
        "change its settings, or delete its directory under runs/, to train it again.",
    ]


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
        if "diverged" in r:
            lines.append(f"| {r['variant']} | {r['verdict']} | n/a | n/a | diverged |")
            continue
        steps = " / ".join("n/a" if s is None else str(s) for s in r["best_val_steps"])
        lines.append(
            f"| {r['variant']} | {_pm(r['best_val_loss'], r['best_val_loss_std'])} | {steps} | "
            f"{_cell(r['delta_best_val'], '+.4f')} | {r['best_verdict']} |"
        )
    return lines + [
        "",
        "Some run's validation loss rose after its lowest point (overfitting), so the final "
        "evaluation of the table above and the best one can rank the variants differently. The "
        "best is picked on the validation split itself, so it is slightly optimistic; the "
        "resolution is train.eval_interval.",
    ]


def _target_table(rows: list[dict], seeds: int) -> list[str]:
    target = next(r["to_target"]["target"] for r in rows if "to_target" in r)

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
        if "diverged" in r:
            lines.append(f"| {r['variant']} | {r['verdict']} | n/a | n/a | n/a | n/a |")
            continue
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
    if _extrapolation_of(report["rows"]):
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
    """Validation loss against step, one line per variant (mean over seeds, band = min..max); a
    variant a seed of which diverged: each seed's evaluations before it and a dashed line at
    the step. The y axis zooms on where the variants end (``zoom``); evaluations above it are
    drawn on its top edge as triangles, so no point is left out."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=100)
    status = {r["variant"]: r["verdict"] for r in report["rows"] if "diverged" in r}
    drawn = []  # (steps, values, color) of every curve, for the points above the zoom
    for name, rs in report["runs"].items():
        if name in status:
            color = ax.plot([], [], "o--", ms=3, lw=1.2, label=f"{name} ({status[name]})")[0]
            color = color.get_color()
            for r in rs:
                steps = [s for s, _ in r.get("val_curve") or ()]
                values = [v for _, v in r.get("val_curve") or ()]
                ax.plot(steps, values, "o--", ms=3, lw=1.2, color=color)
                drawn.append((steps, values, color))
                if "diverged" in r:
                    ax.axvline(r["diverged"]["step"], color=color, ls="--", lw=0.8)
            continue
        steps = [s for s, _ in rs[0]["val_curve"]]
        curves = np.array([[v for _, v in r["val_curve"]] for r in rs])
        (line,) = ax.plot(steps, curves.mean(0), "o-", ms=3, lw=1.6, label=name)
        drawn.append((steps, list(curves.mean(0)), line.get_color()))
        if len(rs) > 1:
            ax.fill_between(steps, curves.min(0), curves.max(0), color=line.get_color(), alpha=0.2)
            drawn.append((steps, list(curves.min(0)), line.get_color()))
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(f"{report['study']['name']}: validation loss ({report['study']['seeds']} seed(s))")
    target = report["study"].get("target_loss")
    if target is not None:
        ax.axhline(target, color="black", lw=0.8, ls=":", label=f"target {target:g}")
    finals = [r["val_loss"] for r in report["rows"] if "diverged" not in r]
    limits = zoom([v for _, vs, _ in drawn for v in vs], finals)
    if limits is not None:
        ax.set_ylim(*limits)
        above = [(s, v, c) for ss, vs, c in drawn for s, v in zip(ss, vs, strict=True)
                 if v > limits[1]]  # fmt: skip
        for s, _, c in above:  # on the edge, not clipped
            ax.plot(s, limits[1], "^", ms=7, color=c, clip_on=False, zorder=3)
        if above:
            ax.plot([], [], "^", ms=7, color="grey",
                    label=f"above {limits[1]:.2f} (up to {max(v for _, v, _ in above):.2f})")  # fmt: skip
    ax.grid(alpha=0.3)
    _finish(fig, ax, png)


ZOOM_HIDES_AT_MOST = 0.25  # of the points drawn: a short run's curves are shown whole


def zoom(values: list[float], finals: list[float]) -> tuple[float, float] | None:
    """(bottom, top) of the validation plot: from the lowest point drawn - 0.1 to the highest
    final loss + 0.6, the part where variants differ (a long run's first evaluations lie far
    above it); None (the whole range) without a final loss, or where that would leave more
    than ZOOM_HIDES_AT_MOST of the points above the plot (a run of a few evaluations)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    finals = [v for v in finals if v is not None and math.isfinite(v)]
    if not values or not finals:
        return None
    low, high = min(values) - 0.1, max(finals) + 0.6
    if sum(v > high for v in values) > ZOOM_HIDES_AT_MOST * len(values):
        return None
    return low, high


def log_ticks(low: float, high: float, n: int = 6) -> list[float]:
    """About ``n`` tick values for a log axis spanning [low, high] (> 0), evenly spaced in log
    and rounded to two significant digits: a narrow range (13..30) gets labels of its own
    where a log axis labels only the powers of ten and a few multiples of them."""
    if high <= low:
        return [float(f"{low:.2g}")]
    ticks = [float(f"{v:.2g}") for v in np.geomspace(low, high, n)]
    return sorted(set(ticks))


def plot_extrapolation(report: dict, png: Path) -> None:
    """Perplexity against evaluation context (log x and y, each evaluated context and about six
    perplexities labelled); runs that cannot run or diverged are left out."""
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullLocator, ScalarFormatter

    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    ppl, contexts = [], []
    for r in report["rows"]:
        pts = [(e["context"], e["ppl"]) for e in r.get("extrapolation") or () if "ppl" in e]
        if pts:
            ax.plot(*zip(*pts, strict=True), "o-", lw=1.8, label=r["variant"])
            ppl += [p for _, p in pts]
        contexts += [e["context"] for e in r.get("extrapolation") or ()]
    block = _extrapolation_of(report["rows"])[0]["context"]
    ax.axvline(block, color="grey", ls=":", label="training context")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    contexts = sorted(set(contexts))
    ax.xaxis.set_major_locator(FixedLocator(contexts))  # the contexts evaluated, as numbers
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(ScalarFormatter())
    if ppl:
        ax.yaxis.set_major_locator(FixedLocator(log_ticks(min(ppl), max(ppl))))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.set_xlabel("evaluation context (tokens)")
    ax.set_ylabel("validation perplexity")
    ax.set_title(f"{report['study']['name']}: perplexity past the training context")
    ax.grid(alpha=0.3)
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
