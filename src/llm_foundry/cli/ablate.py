"""``llm-foundry ablate``: train variants under one budget and compare them in one table."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llm_foundry.ablation import (
    Study,
    expand,
    load_study,
    markdown,
    recipe_names,
    run_study,
    write_report,
)
from llm_foundry.ablation.spec import LIST_AXIS_SEPARATOR, LIST_FIELDS, parse_override
from llm_foundry.cli.options import SettingsParser, at_least_one
from llm_foundry.cli.signals import stopped, terminate_as_interrupt


def main(argv: list[str]) -> int:
    # SIGTERM outside a variant's training steps (which save and stop on their own): ended as
    # Ctrl-C is, so the study's phase says what it keeps
    with terminate_as_interrupt() as signals:
        try:
            return _main(argv)
        except KeyboardInterrupt as e:
            from llm_foundry.ablation.progress import StudyInterrupted

            name = e.signal_name if isinstance(e, StudyInterrupted) else None
            name = name or (signals[0] if signals else "SIGINT")
            what = str(e) or "interrupted; finished variants are kept: rerun to go on"
            return stopped("llm-foundry ablate", name, what)


def summary(description: str, width: int = 90) -> str:
    """A recipe's description for one line of ``--list``: its first sentence, cut at a word
    before ``width`` characters with an ellipsis."""
    text = " ".join(description.split())
    first = text.split(". ")[0].rstrip(".")
    if len(first) <= width:
        return first
    return first[: first.rfind(" ", 0, width - 1)] + " …"


def as_set_flags(argv: list[str]) -> list[str]:
    """``train``'s spelling of an override, ``--model.F V`` / ``--train.F V`` (or with ``=``),
    read as ``--set F=V`` / ``--set train.F=V``: what works for one run works for a study."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        section, dot, rest = arg.partition(".")
        if dot and section in ("--model", "--train") and rest:
            field, eq, value = rest.partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{arg} needs a value ({arg} V, or {arg}=V)")
                value, i = argv[i + 1], i + 1
            out += ["--set", f"{'train.' if section == '--train' else ''}{field}={value}"]
        else:
            out.append(arg)
        i += 1
    return out


def _main(argv: list[str]) -> int:
    lists = ", ".join(f"{s}.{f}" for s, f in sorted(LIST_FIELDS))
    p = SettingsParser(
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
        help="grid axis; model field by default, train.FIELD for training (repeatable). A "
        f"comma-list field ({lists}) separates its values with '{LIST_AXIS_SEPARATOR}': "
        f"train.lora_targets=wq,wv{LIST_AXIS_SEPARATOR}w1,w2,w3",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=V",
        help="override for every variant (train's --model.FIELD V and --train.FIELD V work too); "
        f"one value, so a comma is refused except in a comma-list field ({lists}), which takes "
        "the whole list: train.lora_targets=wq,wv",
    )
    p.add_argument("--seeds", type=at_least_one, help="seeds per variant (mean ± std)")
    p.add_argument("--data", default="data/shakespeare_char", help="directory written by prepare")
    p.add_argument("--out", help="output directory (default runs/ablate-NAME)")
    p.add_argument("--list", action="store_true", help="list the built-in recipes and exit")
    p.add_argument(
        "--report", metavar="DIR", help="rebuild DIR's table and plots from its results.json"
    )
    ns = p.parse_args(as_set_flags(argv))
    for flag in ("report", "list"):  # they read no study: a grid flag with them is refused
        if getattr(ns, flag) and (ignored := given_flags(p, ns, exclude=flag)):
            raise ValueError(f"--{flag} builds no study, so {', '.join(ignored)} would be "
                             f"ignored: give --{flag} alone")  # fmt: skip
    if ns.report:
        results = Path(ns.report) / "results.json"
        if not results.is_file():
            raise FileNotFoundError(f"--report {ns.report}: no {results}; give the directory an "
                                    "ablate run wrote (its --out)")  # fmt: skip
        report = json.loads(results.read_text())
        write_report(report, Path(ns.report))
        print(
            f"wrote {Path(ns.report) / 'results.md'}, {Path(ns.report) / 'results.json'} and plots"
        )
        return 0
    if ns.list:
        for name in recipe_names():
            s = load_study(name)
            gpu = " [GPU]" if s.train.get("device") == "cuda" else ""
            print(f"{name:<21}{summary(s.description)}{gpu}")
        return 0
    study = load_study(ns.recipe) if ns.recipe else Study()  # a recipe's problems name its file
    if ns.preset:
        study.preset = ns.preset
    if ns.seeds is not None:
        study.seeds = ns.seeds
    for item in ns.set:
        section, name, values = parse_override(item)
        if len(values) > 1:
            raise ValueError(f"--set {item}: one value per --set (a grid is --vary)")
        getattr(study, section)[name] = values[0]
    given: dict[str, str] = {}  # axis -> the --vary that gave it
    one_value = []
    for item in ns.vary:
        section, name, values = parse_override(item, axis=True)
        axis = name if section == "model" else f"train.{name}"
        if axis in given:
            raise ValueError(f"--vary {item}: {axis} is varied already by --vary {given[axis]}; "
                             "give each field one --vary with all its values")  # fmt: skip
        given[axis] = item
        study.vary[axis] = values
        one_value += [item] * (len(values) == 1)
    changed = ([f"--preset {ns.preset}"] * bool(ns.preset) + [f"--set {x}" for x in ns.set]
               + [f"--seeds {ns.seeds}"] * (ns.seeds is not None))  # fmt: skip
    if ns.recipe and changed:  # results.md says what ran, not only what the recipe says
        study.description = (f"{study.description.strip()}\n\nRun with changes to the recipe: "
                             f"{', '.join(changed)}.").strip()  # fmt: skip
    if not study.variants and not study.vary:
        if ns.recipe:
            raise ValueError(f"--recipe {ns.recipe} defines nothing to compare: give it variants: "
                             "or vary: (or add --vary FIELD=A,B)")  # fmt: skip
        raise ValueError("nothing to compare: give --recipe NAME or at least one --vary FIELD=A,B")
    try:  # every field and variant, before anything trains
        study = Study.from_dict(study.to_dict())
    except ValueError as e:
        source = f"--recipe {ns.recipe}" if ns.recipe else "the study"
        raise ValueError(f"{source} with --preset/--seeds/--set/--vary: {e}") from None
    if one_value:  # an axis of one value: a setting of every variant, not a comparison
        variants = expand(study)
        if len(variants) == 1:
            raise ValueError(f"--vary {one_value[0]} has one value, so the study has one variant "
                             f"({variants[0].name}) and nothing to compare: give two or more, "
                             "--vary FIELD=A,B")  # fmt: skip
        print(f"note: --vary {', '.join(one_value)}: one value, the same in every variant "
              "(as --set would give it; the variants' names show it)", file=sys.stderr)  # fmt: skip
    data = Path(ns.data)
    if not (data / "meta.json").exists():
        if ns.data != "data/shakespeare_char":
            raise FileNotFoundError(
                f"{data / 'meta.json'} not found: run llm-foundry prepare first"
            )
        from llm_foundry.cli.train import prepare_default

        prepare_default(data)
    out = Path(ns.out or f"runs/ablate-{study.name}")  # the name is a plain name: checked
    report = run_study(study, data, out)
    print(f"wrote {out / 'results.md'}, {out / 'results.json'} and plots")
    print(markdown(report))
    diverged = [f"{r['variant']} {r['verdict']}" for r in report["rows"] if "diverged" in r]
    if diverged:  # the report is written; the exit status says not every variant trained
        print(f"llm-foundry ablate: {len(diverged)} of {len(report['rows'])} variants diverged "
              f"({'; '.join(diverged)}): see {out / 'results.md'}", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def given_flags(p: argparse.ArgumentParser, ns: argparse.Namespace, exclude: str) -> list[str]:
    """The options of ``p`` given values other than their defaults, as flags (but ``exclude``)."""
    return [
        a.option_strings[0]
        for a in p._actions
        if a.option_strings and a.dest not in (exclude, "help")
        and getattr(ns, a.dest, None) != a.default
    ]  # fmt: skip
