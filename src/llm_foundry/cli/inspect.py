"""``llm-foundry inspect WHAT``: PNG plots (lr schedule, attention, RoPE, sinusoidal, ALiBi,
training dynamics), drawn by ``llm_foundry.plots``; ``--json`` prints the plotted numbers."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from llm_foundry.cli.options import (
    SettingsParser,
    add_settings_arguments,
    given_overrides,
    settings_from,
)
from llm_foundry.plots import (
    lr_curves,
    plot_alibi,
    plot_attention,
    plot_dynamics,
    plot_experts,
    plot_lr,
    plot_rope,
    plot_sinusoidal,
    png_path,
    png_size,
)
from llm_foundry.presets import preset_names

# cells a heatmap may hold: a panel is a few hundred pixels a side, so more cells only cost
# memory (ALiBi at 100,000 positions: 75 GiB for each 100,000 x 100,000 array)
MAX_CELLS = 2**22
MAX_PANELS = 128  # ALiBi heads drawn, four a row: BLOOM-176B's 112 fit


def _common(p) -> None:
    """--out and --json, shared by every sub-command."""
    what = p.prog.split()[-1]
    p.add_argument("--out", default=f"inspect_{what}.png", help="PNG file to write")
    p.add_argument("--json", action="store_true", help="print the plotted numbers as JSON")


def _parse(p: SettingsParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; ``ns.out`` becomes the checked PNG path, before anything is computed."""
    ns = p.parse_args(argv)
    ns.out = png_path(ns.out)
    return ns


def _check_cells(shape: str, cells: int, fix: str) -> None:
    """Refuse a heatmap of more than ``MAX_CELLS`` cells: ``shape`` says how many it asked for,
    ``fix`` what to give instead."""
    if cells > MAX_CELLS:
        raise ValueError(
            f"{shape} is {cells:,} cells, past the {MAX_CELLS:,} a heatmap draws: {fix}"
        )


def _run_dir(value: str):
    """The training run ``--run value`` names, refused (one line) when it is not one: a file
    (say, its metrics.jsonl) is answered with the directory that holds it."""
    from llm_foundry.rundir import METRICS, RunDir

    if not value.strip():
        raise ValueError("--run is empty: give a run directory of llm-foundry train")
    run = RunDir(value)
    if run.path.is_file():
        raise ValueError(
            f"--run {value} is a file: give the run directory that holds it ({run.path.parent})"
        )
    if not run.path.is_dir():
        raise FileNotFoundError(
            f"--run {value}: no such directory (give a run directory of llm-foundry train)"
        )
    if not (run.path / METRICS).exists():
        raise FileNotFoundError(
            f"--run {value}: no {METRICS} in it (give a run directory of llm-foundry train)"
        )
    return run


def _report(ns, path: Path, **numbers) -> int:
    if ns.json:
        w, h = png_size(path)
        print(json.dumps({"path": str(path), "width": w, "height": h, **numbers}, indent=2))
    else:
        print(f"wrote {path}")
    return 0


def cmd_lr(argv: list[str]) -> int:
    from llm_foundry.train.schedule import SCHEDULES

    p = SettingsParser(
        prog="llm-foundry inspect lr",
        description="Plot the learning rate of every step 1..max_steps (as training numbers them).",
    )
    add_settings_arguments(p, ("train",))
    p.add_argument("--compare", action="store_true", help=f"overlay {', '.join(SCHEDULES)}")
    _common(p)
    ns = _parse(p, argv)
    cfg = settings_from(ns, ("train",)).train
    path = plot_lr(cfg, ns.out, compare=ns.compare)
    return _report(ns, path, train=cfg.to_dict(), lr=lr_curves(cfg, ns.compare))


def _load_model(ns, cfg):
    """(model, tokenizer or None, source): any checkpoint kind, or a random preset."""
    import torch

    from llm_foundry.loading import load_any
    from llm_foundry.models.transformer import Transformer
    from llm_foundry.tokenizer import load_tokenizer

    if ns.checkpoint:
        model, tok, info = load_any(ns.checkpoint, tokenizer=ns.tokenizer)
        return model, tok, str(info.checkpoint)
    torch.manual_seed(0)  # the demo shows the same random model every run
    tok = load_tokenizer(ns.tokenizer) if ns.tokenizer else None
    return Transformer(cfg).eval(), tok, f"random {ns.preset or 'custom'} model"


def _pick(name: str, value: int | None, n: int) -> list[int]:
    """All of 0..n-1, or the one index asked for (checked)."""
    if value is None:
        return list(range(n))
    if not 0 <= value < n:
        raise ValueError(
            f"--{name} {value} is out of range: the model has {n} {name}s (0..{n - 1})"
        )
    return [value]


def token_labels(tok, ids: list[int]) -> list[str]:
    """A heatmap's label for each id: its text, or a special token's literal (``<s>``), which
    decoding skips and would leave blank."""
    hf = getattr(tok, "hf", None)
    added = hf.get_added_tokens_decoder() if hf is not None else {}
    special = {i: t.content for i, t in added.items() if t.special}
    return [special[i] if i in special else tok.decode([i]) for i in ids]


def cmd_attention(argv: list[str]) -> int:
    import torch

    p = SettingsParser(
        prog="llm-foundry inspect attention",
        description="Heatmaps of attention probabilities (query x key) for a prompt: every "
        "layer x head, or one. Load --checkpoint DIR (a checkpoint, run or HF transformers "
        "directory), or build a random --preset NAME for a demo.",
    )
    add_settings_arguments(p, ("model",), f"architecture preset: {', '.join(preset_names())}")
    p.add_argument("--checkpoint", default=None, help="checkpoint, run or HF directory to load")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the ckpt's)")
    p.add_argument("--prompt", default="To be, or not to be, that is the question")
    p.add_argument("--layer", type=int, default=None, help="one layer (default: all)")
    p.add_argument("--head", type=int, default=None, help="one head (default: all)")
    p.add_argument("--max-tokens", type=int, default=64, help="show at most this many")
    _common(p)
    ns = _parse(p, argv)
    if not ns.checkpoint and not ns.preset:
        raise ValueError("inspect attention needs --checkpoint DIR or --preset NAME")
    if ns.checkpoint and ns.preset:
        raise ValueError("give --checkpoint or --preset, not both (the checkpoint has a config)")
    if ns.checkpoint:  # before settings_from: its defaults are not the checkpoint's config
        given = [f"--model.{k}" for k in given_overrides(ns, ("model",))["model"]]
        given += [f"--config {f}" for f in ns.config]
        if given:
            raise ValueError(
                f"{', '.join(given)}: --model.* and --config apply to --preset; a checkpoint "
                "has its own config"
            )
    cfg = None if ns.checkpoint else settings_from(ns, ("model",)).model
    if not ns.prompt:
        raise ValueError("--prompt is empty: attention needs at least one token")
    if ns.max_tokens < 1:
        raise ValueError(f"--max-tokens {ns.max_tokens} must be >= 1")
    model, tok, source = _load_model(ns, cfg)
    mc = model.cfg
    if tok is not None:
        ids = tok.encode(ns.prompt)
        if max(ids) >= mc.vocab_size:
            raise ValueError(
                f"the tokenizer gives token id {max(ids)}, past the model's vocab_size "
                f"{mc.vocab_size}: pass the tokenizer the model was trained with"
            )
        tokens = token_labels(tok, ids)
    else:  # no tokenizer: the prompt's UTF-8 bytes stand in for ids (fine for a random model)
        raw = ns.prompt.encode("utf-8")
        ids = [b % mc.vocab_size for b in raw]
        tokens = [chr(b) if b < 128 else f"\\x{b:02x}" for b in raw]
    keep = min(len(ids), ns.max_tokens, mc.max_seq_len)
    if keep < len(ids):
        print(f"note: the prompt has {len(ids)} tokens; showing the first {keep}", file=sys.stderr)
    ids, tokens = ids[:keep], tokens[:keep]
    layers = _pick("layer", ns.layer, mc.n_layers)
    heads = _pick("head", ns.head, mc.n_heads)
    with torch.no_grad():
        per_layer = model.attention_weights(torch.tensor([ids]))  # L x (1, H, T, T)
    w = torch.stack([per_layer[i][0, heads] for i in layers]).float()  # (L', H', T, T)
    path = plot_attention(w.numpy(), tokens, ns.out, layers, heads)
    single = len(layers) == len(heads) == 1
    return _report(
        ns,
        path,
        source=source,
        tokens=tokens,
        layers=layers,
        heads=heads,
        weights=w[0, 0].tolist() if single else None,
    )


def cmd_rope(argv: list[str]) -> int:
    import torch

    from llm_foundry.models.position import rope_cos_sin, rope_inv_freq

    p = SettingsParser(
        prog="llm-foundry inspect rope",
        description="RoPE rotation speed and wavelength of each dimension pair; with --factor F "
        "(or a model with rope_scaling) also the linear and NTK-scaled ones.",
    )
    add_settings_arguments(p, ("model",), f"architecture preset: {', '.join(preset_names())}")
    p.add_argument("--factor", type=float, default=None, help="overlay linear/ntk scaling")
    p.add_argument("--length", type=int, default=None, help="positions in the cos heatmap")
    _common(p)
    ns = _parse(p, argv)
    # NaN fails every comparison: the test is written so that only a finite F >= 1 passes
    if ns.factor is not None and not (math.isfinite(ns.factor) and ns.factor >= 1):
        raise ValueError(
            f"--factor {ns.factor:g} must be a finite number >= 1 (a context extension factor; "
            "1: no scaling)"
        )
    cfg = settings_from(ns, ("model",)).model
    hd, theta = cfg.head_size, cfg.rope_theta
    factor = ns.factor
    if factor is None and cfg.rope_scaling != "none":
        factor = cfg.rope_factor
    curves = {"none": rope_inv_freq(hd, theta)}
    if factor and factor > 1:
        for kind in ("linear", "ntk"):
            curves[f"{kind} x{factor:g}"] = rope_inv_freq(hd, theta, kind, factor)
    length = ns.length if ns.length is not None else min(cfg.max_seq_len, 1024)
    if length < 1:
        raise ValueError(f"--length {length} must be >= 1")
    pairs = hd // 2
    _check_cells(
        f"--length {length} x {pairs} dimension pairs",
        length * pairs,
        f"give --length at most {max(1, MAX_CELLS // pairs)}",
    )
    own = rope_inv_freq(hd, theta, cfg.rope_scaling, cfg.rope_factor)  # what the model uses
    cos, _ = rope_cos_sin(torch.arange(length), own)
    title = f"head_dim {hd}, theta {theta:g}, scaling {cfg.rope_scaling}"
    if cfg.pos_encoding != "rope":
        title += f" (this model uses {cfg.pos_encoding} positions)"
    path = plot_rope(
        {k: v.tolist() for k, v in curves.items()},
        cos[:, : hd // 2].numpy(),
        ns.out,
        cfg.max_seq_len,
        title,
    )
    inv = {k: v.tolist() for k, v in curves.items()}
    wavelength = {k: [2 * math.pi / f for f in v] for k, v in inv.items()}
    return _report(
        ns, path, head_dim=hd, theta=theta, inv_freq=inv, wavelength=wavelength, length=length
    )


def cmd_sinusoidal(argv: list[str]) -> int:
    import torch

    from llm_foundry.models.position import sinusoidal_table

    p = SettingsParser(
        prog="llm-foundry inspect sinusoidal",
        description="The fixed sin/cos position table (Vaswani et al. 2017) as a heatmap.",
    )
    p.add_argument("--dim", type=int, default=64, help="model width (even)")
    p.add_argument("--length", type=int, default=128, help="positions")
    _common(p)
    ns = _parse(p, argv)
    if ns.dim < 2 or ns.dim % 2:
        raise ValueError(f"--dim {ns.dim} must be an even number >= 2")
    if ns.length < 1:
        raise ValueError(f"--length {ns.length} must be >= 1")
    longest = MAX_CELLS // ns.dim
    _check_cells(
        f"--length {ns.length} x --dim {ns.dim}",
        ns.length * ns.dim,
        f"at --dim {ns.dim} give --length at most {longest}"
        if longest
        else f"give --dim at most {MAX_CELLS}",
    )
    table = sinusoidal_table(torch.arange(ns.length), ns.dim)
    path = plot_sinusoidal(table.numpy(), ns.out)
    wavelength = [2 * math.pi * 10000.0 ** (i / ns.dim) for i in range(0, ns.dim, 2)]
    return _report(ns, path, dim=ns.dim, length=ns.length, wavelength=wavelength)


def cmd_alibi(argv: list[str]) -> int:
    from llm_foundry.models.position import alibi_slopes

    p = SettingsParser(
        prog="llm-foundry inspect alibi",
        description="ALiBi attention biases slope * (key - query), one panel per head.",
    )
    p.add_argument("--n-heads", type=int, default=8, help="attention heads")
    p.add_argument("--length", type=int, default=16, help="positions")
    _common(p)
    ns = _parse(p, argv)
    if not 1 <= ns.n_heads <= MAX_PANELS:
        raise ValueError(f"--n-heads {ns.n_heads} must be 1..{MAX_PANELS} (one panel per head)")
    if ns.length < 1:
        raise ValueError(f"--length {ns.length} must be >= 1")
    n, t = ns.n_heads, ns.length
    _check_cells(
        f"--n-heads {n} x --length {t} x {t}",
        n * t * t,
        f"at --n-heads {n} give --length at most {math.isqrt(MAX_CELLS // n)}",
    )
    slopes = alibi_slopes(ns.n_heads).tolist()
    path = plot_alibi(slopes, ns.length, ns.out)
    return _report(ns, path, n_heads=ns.n_heads, length=ns.length, slopes=slopes)


def cmd_dynamics(argv: list[str]) -> int:
    from llm_foundry.rundir import METRICS
    from llm_foundry.train.monitor import read_monitor

    p = SettingsParser(
        prog="llm-foundry inspect dynamics",
        description="Plot a run's training-dynamics records (attention entropy, effective "
        "ranks, per-layer gradient norms, activation RMS) against the step. The run must have "
        "been trained with --train.monitor_interval N.",
    )
    p.add_argument("--run", required=True, help="run directory (holds metrics.jsonl)")
    _common(p)
    ns = _parse(p, argv)
    run = _run_dir(ns.run)
    metrics = run.path / METRICS
    records = read_monitor(metrics)
    if not records:
        raise ValueError(
            f"{metrics} has no monitor records: train with --train.monitor_interval N (e.g. 100) "
            "to record attention entropy, effective ranks and per-layer gradient norms every N "
            "steps"
        )
    train = run.info().get("train", {})
    interval = train.get("monitor_interval")
    every = f", every {interval} steps" if interval else ""
    path = plot_dynamics(
        records,
        ns.out,
        f"{run.path.name}: training dynamics ({len(records)} records{every})",
        train.get("monitor_entropy_min"),
        train.get("monitor_rank_frac"),
    )
    return _report(
        ns,
        path,
        run=str(run.path),
        steps=[r["step"] for r in records],
        layers=len(records[0]["monitor"]["rank_wq"]),
        monitor=[r["monitor"] for r in records],
    )


def cmd_experts(argv: list[str]) -> int:
    p = SettingsParser(
        prog="llm-foundry inspect experts",
        description="Plot how a mixture-of-experts run spread its tokens over the experts: each "
        "expert's share per layer against the step, and the load's coefficient of variation.",
    )
    p.add_argument("--run", required=True, help="run directory (holds metrics.jsonl)")
    _common(p)
    ns = _parse(p, argv)
    run = _run_dir(ns.run)
    records = [r for r in run.metrics() if "experts" in r]
    if not records:
        raise ValueError(
            f"{run.path / 'metrics.jsonl'} has no expert-load records: the model has no experts "
            "(train with --model.n_experts N, e.g. --preset moe-shakespeare-char)"
        )
    dead = sorted({tuple(d) for r in records for d in r["experts"]["dead"]})
    path = plot_experts(records, ns.out, f"{run.path}: expert load ({len(records)} records)")
    return _report(
        ns,
        path,
        run=str(run.path),
        steps=[r["step"] for r in records],
        final_cv=records[-1]["experts"]["cv"],
        ever_dead=[list(d) for d in dead],
    )


COMMANDS = {
    "lr": (cmd_lr, "learning rate against the step (--compare: every schedule)"),
    "attention": (cmd_attention, "attention heatmaps of a checkpoint (or random preset)"),
    "rope": (cmd_rope, "RoPE wavelengths per dimension pair, with linear/NTK scaling"),
    "sinusoidal": (cmd_sinusoidal, "the sinusoidal position table"),
    "alibi": (cmd_alibi, "ALiBi bias matrices, one per head"),
    "dynamics": (cmd_dynamics, "a run's attention entropy, ranks, grad norms against the step"),
    "experts": (cmd_experts, "a mixture-of-experts run's expert load against the step"),
}


USAGE = (
    "usage: llm-foundry inspect WHAT [options] [--out FILE.png] [--json]\n\nWHAT:\n"
    + "\n".join(f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items())
)


def main(argv: list[str]) -> int:
    """Dispatch ``inspect WHAT ...`` on ``argv[0]``."""
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if not argv:
        raise ValueError(
            f"inspect needs a sub-command: one of {', '.join(COMMANDS)} (llm-foundry inspect -h)"
        )
    if argv[0] not in COMMANDS:
        raise ValueError(
            f"unknown inspect sub-command {argv[0]!r}; choose one of {', '.join(COMMANDS)}"
        )
    try:
        return COMMANDS[argv[0]][0](argv[1:])
    except argparse.ArgumentError as e:  # a settings flag unknown or mistyped
        from llm_foundry.cli.options import flag_hint

        raise ValueError(f"inspect {argv[0]}: {e}{flag_hint(str(e))}") from None
