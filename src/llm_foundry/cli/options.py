"""The flags every settings-taking command shares: ``--preset``, ``--config FILE`` (repeatable)
and one ``--model.FIELD`` / ``--train.FIELD`` per config field, handed to ``settings.resolve``.

A field flag has no default (argparse.SUPPRESS), so the namespace holds exactly the fields the
command line gave: that is what a preset or a resumed run is changed by, nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import re
from functools import cache

from llm_foundry.settings import SECTIONS, Settings, config_names, field_names, resolve, scalar


class SettingsParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors raise ``argparse.ArgumentError`` (the command line
    prints them on one line, with a suggestion for a mistyped field flag). Options are taken by
    their exact names: argparse's default completes a prefix (``--train.decay`` would set
    ``decay_frac``, ``--train.max_step`` ``max_steps``), so a typo could set another field."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise argparse.ArgumentError(None, message + self.option_hint(message))

    def option_hint(self, message: str) -> str:
        """' (did you mean --seq-lens?)' for an unrecognized plain option (a field flag's hint is
        ``flag_hint``'s): the options it begins, else the closest name."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        options = [o for o in self._option_string_actions if o.startswith("--")]
        # ablate's --set SECTION.FIELD=V, given to a command that takes --SECTION.FIELD V
        if (m := re.search(r"--set[= ]((?:model|train)\.\w+)=(\S*)", message)) and (
            f"--{m[1]}" in options
        ):
            return f" (did you mean --{m[1]} {m[2]}?)"
        for arg in message.partition(":")[2].split():
            flag = arg.partition("=")[0]
            if not flag.startswith("--") or re.match(r"--(model|train)\.", flag):
                continue
            near = [o for o in options if o.startswith(flag)]
            near = near or difflib.get_close_matches(flag, options, n=1)
            if near:
                return f" (did you mean {' or '.join(near[:3])}?)"
        return ""


@cache
def field_comments(cls: type) -> dict[str, str]:
    """Each field's help text in a config dataclass: the ``# comment`` after it, else the
    comment lines right above it (joined)."""
    comments, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        if m := re.match(r"\s+#\s?(.*)$", line):
            if not m.group(1).startswith("---"):  # a section's heading, not a field's help
                above.append(m.group(1).strip())
            continue
        if m := re.match(r"\s+(\w+): [^=]+=.*?(?:#\s*(.+))?$", line):
            text = m.group(2) or " ".join(above)
            if text:
                comments[m.group(1)] = text.strip()
        above = []
    return comments


def add_settings_arguments(
    p: argparse.ArgumentParser, sections: tuple[str, ...], preset_help: str | None = None
) -> None:
    """--preset (when ``preset_help``), --config and a flag per field of each of ``sections``."""
    if preset_help is not None:
        p.add_argument("--preset", default=None, help=preset_help)
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="YAML/JSON file with model: and train: sections, or a built-in one by name: "
        f"{', '.join(config_names())} (repeatable; later files win)",
    )
    for section in sections:
        cls = SECTIONS[section]
        group = p.add_argument_group(f"{section} settings (override the preset and --config)")
        comments = field_comments(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            shown = (
                "null"
                if default is None
                else str(default).lower()
                if default in (True, False)
                else default
            )
            group.add_argument(
                f"--{section}.{f.name}",
                type=flag_value,
                default=argparse.SUPPRESS,
                metavar="V",
                help=f"{comments.get(f.name, f.type)} (default {shown})".replace("%", "%%"),
            )


def flag_value(text: str):
    """A field flag's value typed as ``settings.scalar`` does; text that is not a value (invalid
    YAML such as '{') is a usage error argparse reports on one line naming the flag."""
    try:
        return scalar(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def at_least_one(text: str) -> int:
    """An argparse type: a whole number >= 1; argparse's message names the flag, this the value
    ("argument --seeds: 0 must be at least 1")."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} must be at least 1")
    return n


def given_overrides(ns: argparse.Namespace, sections: tuple[str, ...]) -> dict[str, dict]:
    """{section: {field: value}} for the field flags present on the command line."""
    out: dict[str, dict] = {s: {} for s in sections}
    for key, value in vars(ns).items():
        section, _, name = key.partition(".")
        if section in out and name:
            out[section][name] = value
    return out


def settings_from(
    ns: argparse.Namespace,
    sections: tuple[str, ...],
    base_model=None,
    base_train=None,
    default_preset: str | None = None,
    extra_keys: tuple[str, ...] = (),
) -> Settings:
    """Resolve ``ns`` (parsed with ``add_settings_arguments``). Top-level keys of a --config file
    that name one of ``extra_keys`` (e.g. out, data) fill those options when the command line
    left them unset; any other top-level key is an error naming the file."""
    settings = resolve(
        preset=getattr(ns, "preset", None),
        files=ns.config,
        overrides=given_overrides(ns, sections),
        base_model=base_model,
        base_train=base_train,
        default_preset=default_preset,
    )
    unknown = sorted(set(settings.extra) - set(extra_keys))
    if unknown:
        valid = ", ".join(["model", "train", "preset", *extra_keys])
        raise ValueError(
            f"--config {', '.join(ns.config)}: unknown top-level key(s) {', '.join(unknown)}; "
            f"valid: {valid}"
        )
    for key in extra_keys:
        if getattr(ns, key, None) in (None, False) and key in settings.extra:
            setattr(ns, key, settings.extra[key])
    return settings


def join_negative_values(argv: list[str]) -> list[str]:
    """``--train.lr -1e-3`` as ``--train.lr=-1e-3``: argparse takes a token starting with '-' for
    a flag unless it looks like a plain integer or decimal, so '-1e-3' would lose its flag."""
    out: list[str] = []
    for arg in argv:
        prev = out[-1] if out else ""
        if prev.startswith("--") and "=" not in prev and _is_negative_number(arg):
            out[-1] = f"{prev}={arg}"
        else:
            out.append(arg)
    return out


def _is_negative_number(text: str) -> bool:
    if not text.startswith("-") or text.startswith("--"):
        return False
    try:
        float(text)
    except ValueError:
        return False
    return True


def flag_hint(message: str) -> str:
    """' (did you mean --model.n_layers?)' for a mistyped --model.FIELD / --train.FIELD: the
    closest field name, and the fields it is a whole word of (--train.decay: decay_frac,
    weight_decay, muon_weight_decay), at most three."""
    m = re.search(r"--(model|train)\.(\w+)", message)
    if not m:
        return ""
    section, given = m.groups()
    names = field_names(section)
    near = difflib.get_close_matches(given, names, n=1)
    near += [n for n in names if given in n.split("_") and n not in near]
    near = [n for n in near if n != given][:3]
    if not near:
        return ""
    flags = [f"--{section}.{n}" for n in near]
    return f" (did you mean {', '.join(flags[:-1])}{' or ' * (len(flags) > 1)}{flags[-1]}?)"


def add_quantize_flags(p) -> None:
    """``--quantize int8|int4`` and ``--group-size``: quantize the loaded model's projections in
    memory (``llm-foundry quantize`` writes such a copy once)."""
    p.add_argument("--quantize", choices=["int8", "int4"], default=None,
                   help="weight-only quantization of the projections at load (CPU decoding)")  # fmt: skip
    p.add_argument("--group-size", type=int, choices=[32, 64, 128], default=None,
                   help="--quantize int4: inputs per scale and zero (default 64)")  # fmt: skip


def quantize_choice(scheme: str | None, group_size: int | None, flag: str = "--quantize"):
    """(scheme, int4 group size) of ``flag``/``--group-size``; a group size without int4 is
    refused rather than ignored."""
    if group_size is not None and scheme != "int4":
        raise ValueError(f"--group-size {group_size} applies to {flag} int4 only")
    return scheme, group_size or 64
