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

from llm_foundry.ablation.report import (
    first_crossing,
    markdown,
    summarise,
    training_seconds,
    verdict,
    write_report,
)
from llm_foundry.ablation.runner import (
    PROBE_FUNCS,
    probe_init_grad_norms,
    probe_norm_speed,
    run_one,
    run_study,
)
from llm_foundry.ablation.spec import (
    PROBES,
    RECIPES_DIR,
    Study,
    Variant,
    configs,
    expand,
    load_study,
    recipe_names,
)
from llm_foundry.settings import parse_assignment

__all__ = [
    "PROBES",
    "PROBE_FUNCS",
    "RECIPES_DIR",
    "Study",
    "Variant",
    "configs",
    "expand",
    "first_crossing",
    "load_study",
    "markdown",
    "parse_assignment",
    "probe_init_grad_norms",
    "probe_norm_speed",
    "recipe_names",
    "run_one",
    "run_study",
    "summarise",
    "training_seconds",
    "verdict",
    "write_report",
]
