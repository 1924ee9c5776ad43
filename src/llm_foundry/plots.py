"""Every PNG plot: a run's losses (``train`` draws it), learning-rate schedules, attention
patterns, position encodings (RoPE, sinusoidal, ALiBi) and a run's training dynamics
(``llm-foundry inspect`` draws those).

Plotting functions (``plot_*``) take plain numbers and a path and return the path; the command
(``cli/inspect.py``) parses arguments, computes the numbers and prints what was written.
Every figure has a fixed size in inches at ``DPI`` dots per inch, so its pixel size is known.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

DPI = 100


def _plt():
    """pyplot on the Agg backend, imported late so ``llm-foundry --help`` stays fast."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed (servers, CI)
    import matplotlib.pyplot as plt

    return plt


def png_path(out: str | Path, flag: str = "--out") -> Path:
    """The PNG file ``out`` names (``.png`` added when it has no suffix). Raises ValueError (one
    line naming ``flag``, the value and what is valid) when it cannot be one: empty, another
    format, a directory, or under a path that is a file."""
    text = str(out)
    if not text.strip():
        raise ValueError(f"{flag} is empty: give a .png file path")
    if text.endswith("/") or Path(text).is_dir():
        raise ValueError(f"{flag} {text} is a directory: give a .png file path")
    path = Path(text)
    if not path.suffix:
        path = path.with_suffix(".png")
    if path.suffix.lower() != ".png":
        raise ValueError(f"{flag} {text}: plots are written as PNG; give a name ending in .png")
    if path.is_dir():
        raise ValueError(f"{flag} {text}: {path} is a directory: give a .png file path")
    parent = next((d for d in path.parents if d.exists()), None)  # the nearest that exists
    if parent is not None and not parent.is_dir():
        raise ValueError(
            f"{flag} {text}: {parent} is a file, not a directory: give a .png path in a directory"
        )
    return path


def _save(fig, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at ``png_path(path)``; missing parent directories are made."""
    path = png_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)  # no bbox_inches="tight": the pixel size stays figsize * DPI
    _plt().close(fig)
    return path


def png_size(path: str | Path) -> tuple[int, int]:
    """(width, height) in pixels, read from the PNG's IHDR chunk."""
    head = Path(path).read_bytes()[:24]
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG file")
    return struct.unpack(">II", head[16:24])


def _token_label(s: str, width: int = 6) -> str:
    """A short printable tick label: whitespace made visible, long tokens cut."""
    s = s.replace(" ", "·").replace("\n", "\\n").replace("\t", "\\t")
    s = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in s)
    return s if len(s) <= width else s[: width - 1] + "…"


def _token_ticks(ax, tokens: list[str], max_ticks: int, fontsize: float) -> None:
    """Label every k-th token so at most ``max_ticks`` labels share an axis."""
    step = max(1, math.ceil(len(tokens) / max_ticks))
    ticks = list(range(0, len(tokens), step))
    labels = [_token_label(tokens[i]) for i in ticks]
    ax.set_xticks(ticks, labels, rotation=90, fontsize=fontsize)
    ax.set_yticks(ticks, labels, fontsize=fontsize)


# ----------------------------------------------------------------------------------------------
# Plots


def read_metrics(path: str | Path) -> tuple[list[dict], list[dict]]:
    """Split ``metrics.jsonl`` into train records and eval records (other kinds, such as
    ``monitor`` records, are left out)."""
    from llm_foundry.rundir import read_records

    train, evals = [], []
    for rec in read_records(path):
        if "val_loss" in rec:
            evals.append(rec)
        elif "loss" in rec:
            train.append(rec)
    return train, evals


def plot_losses(metrics_path: str | Path, out_png: str | Path, title: str = "") -> Path:
    """Train loss (raw and smoothed) and validation loss against the step."""
    train, evals = read_metrics(metrics_path)
    fig, ax = _plt().subplots(figsize=(8, 5))
    if train:
        steps = [r["step"] for r in train]
        losses = [r["loss"] for r in train]
        ax.plot(steps, losses, color="tab:blue", alpha=0.25, lw=0.8, label="train (per step)")
        smooth, ema = [], losses[0]
        for v in losses:
            ema = 0.95 * ema + 0.05 * v
            smooth.append(ema)
        ax.plot(steps, smooth, color="tab:blue", lw=1.8, label="train (EMA 0.95)")
    if evals:
        steps, vals = [r["step"] for r in evals], [r["val_loss"] for r in evals]
        ax.plot(steps, vals, "o-", color="tab:orange", lw=1.8, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return _save(fig, out_png)


def lr_curves(train_cfg, compare: bool = False) -> dict[str, dict[int, float]]:
    """schedule name -> {step: lr} for steps 1..max_steps, numbered as training numbers them
    (metrics.jsonl's ``step``: step k is the k-th update and trains at ``lr_at(k - 1)``):
    ``train_cfg``'s schedule, or every schedule's."""
    import dataclasses

    from llm_foundry.train.schedule import SCHEDULES, lr_at

    names = list(SCHEDULES) if compare else [train_cfg.schedule]
    cfgs = {n: dataclasses.replace(train_cfg, schedule=n) for n in names}
    steps = range(1, train_cfg.max_steps + 1)
    return {n: {k: lr_at(k - 1, c) for k in steps} for n, c in cfgs.items()}


def plot_lr(train_cfg, path: str | Path, compare: bool = False) -> Path:
    """lr of steps 1..max_steps as training numbers them (``lr_curves``); ``compare`` overlays
    every schedule on the same knobs. The warmup ends at step warmup_steps, the first at lr."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    for name, lrs in lr_curves(train_cfg, compare).items():
        mine = name == train_cfg.schedule  # the configured schedule stands out
        ax.plot(list(lrs), list(lrs.values()), lw=2.2 if mine else 1.2, label=name)
    if train_cfg.warmup_steps:
        ax.axvline(train_cfg.warmup_steps, color="gray", ls=":", lw=1, label="end of warmup")
    ax.set_xlabel("step (as metrics.jsonl numbers them: 1 = the first update)")
    ax.set_ylabel("learning rate")
    ax.set_title(
        f"{train_cfg.schedule}: warmup {train_cfg.warmup_steps}, {train_cfg.max_steps} steps, "
        f"lr {train_cfg.lr:g} -> {train_cfg.min_lr:g}"
    )
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def attention_figsize(n_rows: int, n_cols: int) -> tuple[float, float]:
    """Inches of an attention figure: one big panel, or a grid of cells shrunk to fit ~24 in."""
    if n_rows == n_cols == 1:
        return 6.5, 6.0
    cell = min(3.0, max(1.5, 24 / max(n_rows, n_cols)))
    return cell * n_cols + 1.0, cell * n_rows + 0.5  # room for the colorbar and the title


def plot_attention(weights, tokens: list[str], path: str | Path, layers=None, heads=None) -> Path:
    """Heatmaps of attention probabilities ``weights`` (L, H, T, T): row = query, column = key.

    ``layers`` and ``heads`` name the rows and columns shown (default 0..L-1, 0..H-1)."""
    import numpy as np

    plt = _plt()
    w = np.asarray(weights, dtype=np.float32)
    n_rows, n_cols, T = w.shape[0], w.shape[1], w.shape[2]
    layers = list(range(n_rows)) if layers is None else list(layers)
    heads = list(range(n_cols)) if heads is None else list(heads)
    single = n_rows == n_cols == 1
    size = attention_figsize(n_rows, n_cols)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=size, squeeze=False, layout="constrained")
    cell = (size[0] - (0 if single else 1.0)) / n_cols  # inches per panel: how many labels fit
    for r in range(n_rows):
        for c in range(n_cols):
            ax = axes[r, c]
            # the future (above the diagonal) is masked to exactly 0: show it blank, not dark
            img = np.where(np.tril(np.ones((T, T), dtype=bool)), w[r, c], np.nan)
            im = ax.imshow(img, cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_title(f"layer {layers[r]} head {heads[c]}", fontsize=10 if single else 8)
            _token_ticks(ax, tokens, max(4, int(cell * 8)), 7 if single else 5)
            if single:
                ax.set_xlabel("key (attended to)")
                ax.set_ylabel("query (attending)")
    fig.colorbar(im, ax=axes, shrink=0.8, label="attention probability")
    return _save(fig, path)


def plot_rope(
    curves: dict[str, list[float]], cos_table, path: str | Path, context: int, title: str
) -> Path:
    """Left: wavelength (tokens per full turn) of each dimension pair for each scaling in
    ``curves`` (name -> inv_freq). Right: cos of the rotation angle, position x pair."""
    import numpy as np

    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    for name, inv_freq in curves.items():
        wl = 2 * math.pi / np.asarray(inv_freq, dtype=np.float64)
        ax.plot(range(len(wl)), wl, "o-", ms=3, lw=1.5, label=name)
    ax.axhline(context, color="gray", ls=":", lw=1, label=f"context {context}")
    ax.set_yscale("log")
    ax.set_xlabel("dimension pair i (features i and i + head_dim/2)")
    ax.set_ylabel("wavelength 2π / inv_freq (tokens)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    im = ax2.imshow(np.asarray(cos_table), aspect="auto", cmap="RdBu", vmin=-1, vmax=1)
    ax2.set_xlabel("dimension pair i")
    ax2.set_ylabel("position")
    ax2.set_title("cos(position · inv_freq): fast pairs left, slow pairs right", fontsize=10)
    fig.colorbar(im, ax=ax2)
    return _save(fig, path)


def plot_sinusoidal(table, path: str | Path) -> Path:
    """The (T, D) sinusoidal table: even features sin, odd cos, slower to the right."""
    import numpy as np

    plt = _plt()
    t = np.asarray(table)
    fig, ax = plt.subplots(figsize=(8, 5), layout="constrained")
    im = ax.imshow(t, aspect="auto", cmap="RdBu", vmin=-1, vmax=1, interpolation="nearest")
    ax.set_xlabel("feature (even: sin, odd: cos)")
    ax.set_ylabel("position")
    ax.set_title(f"sinusoidal positions: {t.shape[0]} positions x {t.shape[1]} features")
    fig.colorbar(im, ax=ax)
    return _save(fig, path)


def alibi_figsize(n_heads: int) -> tuple[float, float]:
    cols = min(4, n_heads)
    return 3.0 * cols + 1.0, 3.0 * math.ceil(n_heads / cols) + 0.5


def plot_alibi(slopes: list[float], length: int, path: str | Path) -> Path:
    """Each head's bias slope * (key - query) over ``length`` positions; the future is blank."""
    import numpy as np

    plt = _plt()
    n = len(slopes)
    cols, rows = min(4, n), math.ceil(n / min(4, n))
    fig, axes = plt.subplots(
        rows, cols, figsize=alibi_figsize(n), squeeze=False, layout="constrained"
    )
    dist = np.arange(length)[None, :] - np.arange(length)[:, None]  # key - query, <= 0: past
    low = -max(slopes) * max(1, length - 1)  # one color scale for all heads: slopes compare
    for h, ax in enumerate(axes.flat):
        if h >= n:
            ax.axis("off")
            continue
        bias = np.where(dist <= 0, slopes[h] * dist, np.nan)
        im = ax.imshow(bias, cmap="magma", vmin=low, vmax=0, interpolation="nearest")
        ax.set_title(f"head {h}: slope {slopes[h]:.4g} = 2^{math.log2(slopes[h]):.3g}", fontsize=8)
        ax.set_xlabel("key", fontsize=7)
        ax.set_ylabel("query", fontsize=7)
        ax.tick_params(labelsize=6)
    fig.colorbar(im, ax=axes, shrink=0.8, label="bias added to the attention score")
    return _save(fig, path)


DYNAMICS_FIGSIZE = (16.0, 9.0)


def plot_dynamics(
    records: list[dict],
    path: str | Path,
    title: str,
    entropy_min: float | None = None,
    rank_frac: float | None = None,
) -> Path:
    """A 2 x 3 grid against the step, one line per layer: attention entropy (mean over heads,
    and the lowest head dashed), effective ranks of W_q, W_k and the hidden states, gradient
    norm and activation RMS. ``records`` are ``llm_foundry.train.monitor`` records ({"step", "monitor"});
    the warning thresholds, when given, are drawn as red dotted lines."""
    import numpy as np
    from matplotlib.lines import Line2D

    plt = _plt()
    steps = [r["step"] for r in records]
    m = [r["monitor"] for r in records]
    n_layers = len(m[0]["rank_wq"])
    series = {k: np.array([rec[k] for rec in m], dtype=float) for k in m[0] if k != "full_rank"}
    entropy = np.array([rec["attn_entropy"] for rec in m], dtype=float)  # (steps, L, H)
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.9, n_layers))
    marker = dict(marker="o", ms=3) if len(steps) <= 40 else {}
    fig, axes = plt.subplots(2, 3, figsize=DYNAMICS_FIGSIZE, layout="constrained")
    ax = axes[0, 0]
    for i in range(n_layers):
        ax.plot(steps, entropy[:, i].mean(-1), color=colors[i], lw=1.6, **marker)
        ax.plot(steps, entropy[:, i].min(-1), color=colors[i], lw=1.0, ls="--")
    ax.axhline(m[0]["entropy_uniform"], color="gray", ls=":", lw=1.2)
    ax.set_title("attention entropy (nats): mean of heads, lowest head dashed")
    panels = [
        (axes[0, 1], "rank_wq", "effective rank of W_q"),
        (axes[0, 2], "rank_wk", "effective rank of W_k"),
        (axes[1, 0], "rank_hidden", "effective rank of hidden states (B*T x D)"),
        (axes[1, 1], "grad_norm", "gradient norm of each block (before clipping)"),
        (axes[1, 2], "act_rms", "activation RMS of each block's output"),
    ]
    for ax, key, label in panels:
        for i in range(n_layers):
            ax.plot(steps, series[key][:, i], color=colors[i], lw=1.6, **marker)
        ax.set_title(label)
        if key.startswith("rank_"):
            full = m[0]["full_rank"][key[5:]]
            ax.axhline(full, color="gray", ls=":", lw=1.2)
            if rank_frac:
                ax.axhline(rank_frac * full, color="tab:red", ls=":", lw=1.2)
            ax.set_ylim(0, full * 1.05)
        elif min(series[key].min(), 1) > 0:  # magnitudes: span decades
            ax.set_yscale("log")
    if entropy_min:
        axes[0, 0].axhline(entropy_min, color="tab:red", ls=":", lw=1.2)
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.title.set_fontsize(10)
    styles = [
        Line2D([], [], color="k", lw=1.6, label="mean of heads / value"),
        Line2D([], [], color="k", lw=1.0, ls="--", label="lowest head"),
        Line2D([], [], color="gray", ls=":", label="uniform attention / full rank"),
        Line2D([], [], color="tab:red", ls=":", label="warning threshold"),
    ]
    if n_layers <= 12:
        layers = [
            Line2D([], [], color=colors[i], lw=2, label=f"layer {i}") for i in range(n_layers)
        ]
        fig.legend(handles=layers + styles, loc="outside right upper", fontsize=9)
    else:  # too many for a legend: a colour scale of the layer index
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import ListedColormap, Normalize

        sm = ScalarMappable(Normalize(-0.5, n_layers - 0.5), ListedColormap(colors))
        fig.colorbar(sm, ax=axes, label="layer", shrink=0.8)
        axes[0, 0].legend(handles=styles, fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def plot_experts(records: list[dict], path: str | Path, title: str) -> Path:
    """Expert load over training, one panel per layer: each expert's share of the interval's
    (token, slot) assignments against the step (1/E dotted: perfect balance), and below, each
    layer's coefficient of variation. ``records``: ``{"step", "experts": {"load", "cv"}}``."""
    import numpy as np

    plt = _plt()
    steps = [r["step"] for r in records]
    load = np.array([r["experts"]["load"] for r in records], dtype=float)  # (records, L, E)
    n_layers, n_experts = load.shape[1:]
    cols = min(n_layers, 4)
    rows = -(-n_layers // cols)
    fig, axes = plt.subplots(
        rows + 1, cols, figsize=(4.2 * cols, 3.0 * (rows + 1)), layout="constrained", squeeze=False
    )
    colors = plt.get_cmap("tab20" if n_experts > 10 else "tab10")(np.arange(n_experts) % 20)
    for i in range(n_layers):
        ax = axes[i // cols, i % cols]
        for e in range(n_experts):
            ax.plot(steps, load[:, i, e], color=colors[e], lw=1.4, label=f"expert {e}")
        ax.axhline(1 / n_experts, color="gray", ls=":", lw=1.2)
        ax.set_title(f"layer {i}: share of assignments", fontsize=10)
        ax.set_ylim(0, max(load[:, i].max() * 1.1, 2 / n_experts))
        ax.grid(alpha=0.3)
    for j in range(n_layers, rows * cols):
        axes[j // cols, j % cols].axis("off")
    cv_ax = axes[rows, 0]
    for j in range(1, cols):
        axes[rows, j].axis("off")
    cv = np.array([r["experts"]["cv"] for r in records], dtype=float)
    for i in range(n_layers):
        cv_ax.plot(steps, cv[:, i], lw=1.4, label=f"layer {i}")
    cv_ax.set_title("coefficient of variation of the load (0: balanced)", fontsize=10)
    cv_ax.set_xlabel("step")
    cv_ax.grid(alpha=0.3)
    cv_ax.legend(fontsize=8)
    if n_experts <= 16:
        axes[0, 0].legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    return _save(fig, path)


# ----------------------------------------------------------------------------------------------
# Sub-commands


def plot_preference(metrics_path: str | Path, out_png: str | Path, title: str = "") -> Path:
    """A DPO run (``train.task=dpo``) against the step: its loss, the implicit rewards of the
    chosen and rejected completions and their margin, and the reward accuracy (the share of pairs
    whose chosen completion out-scores the rejected one); training per step, validation as
    points."""
    train, evals = read_metrics(metrics_path)
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), layout="constrained")
    panels = [
        (axes[0], [("loss", "loss", "tab:blue")], "DPO loss"),
        (axes[1], [("rewards/chosen", "chosen", "tab:green"),
                   ("rewards/rejected", "rejected", "tab:red"),
                   ("rewards/margins", "margin", "tab:purple")], "reward (beta x log-ratio)"),
        (axes[2], [("rewards/accuracies", "accuracy", "tab:blue")], "reward accuracy"),
    ]  # fmt: skip
    for ax, series, ylabel in panels:
        for key, label, color in series:
            got = [r for r in train if key in r]
            if got:
                ax.plot([r["step"] for r in got], [r[key] for r in got], color=color, alpha=0.35,
                        lw=0.8, label=f"{label} (train)")  # fmt: skip
            val = "val_loss" if key == "loss" else f"val_{key}"
            got = [r for r in evals if val in r]
            if got:
                ax.plot([r["step"] for r in got], [r[val] for r in got], "o-", color=color,
                        lw=1.8, label=f"{label} (validation)")  # fmt: skip
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].axhline(0, color="gray", lw=0.8)
    fig.suptitle(title or "preference tuning")
    return _save(fig, out_png)
