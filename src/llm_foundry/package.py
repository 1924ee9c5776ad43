"""What this installation is: the distribution's name (what ``pip install`` takes), its version,
and the one line that adds an optional part (an extra of pyproject.toml) to it."""

from __future__ import annotations

import json
from importlib import metadata
from urllib.parse import unquote, urlparse

from llm_foundry import __version__

# the name on PyPI; `llm-foundry` there is another project (the import package and command
# keep the name llm_foundry / llm-foundry)
DISTRIBUTION = "llm-foundry-lab"


def source_dir() -> tuple[str, bool] | None:
    """(the directory this installation was made from, whether editable) for a local install
    (``pip install -e .`` or ``pip install PATH``), from pip's direct_url.json; None for an
    index install or a source tree on the path that was never installed."""
    try:
        text = metadata.distribution(DISTRIBUTION).read_text("direct_url.json")
        info = json.loads(text or "{}")
    except (metadata.PackageNotFoundError, json.JSONDecodeError):
        return None
    url, dir_info = urlparse(info.get("url", "")), info.get("dir_info")
    if url.scheme != "file" or not isinstance(dir_info, dict):
        return None
    return unquote(url.path), bool(dir_info.get("editable"))


class MissingExtra(ImportError):
    """An optional part (an extra) this installation lacks. Its message names what needs it and
    the line that installs it: the command line prints it as one line and exits 2, where any
    other ImportError (a bug) keeps its traceback."""


def absent(e: ImportError, *modules: str) -> bool:
    """Whether ``e`` says one of ``modules`` (or a module inside one) is not installed, rather
    than installed and broken: only then is the extra's install line the fix; a broken package's
    own error (a missing name, an incompatible dependency) keeps its traceback."""
    name = getattr(e, "name", None) or ""
    return isinstance(e, ModuleNotFoundError) and any(
        name == m or name.startswith(m + ".") for m in modules
    )


def missing_extra(needs: str, extra: str, detail: str = "") -> MissingExtra:
    """``MissingExtra`` for ``needs`` (what lacks the package, e.g. "train.tensorboard=true needs
    TensorBoard") and the ``extra`` that installs it; ``detail`` (the import's own error) after."""
    return MissingExtra(f"{needs}: {install_line(extra)}" + (f" ({detail})" if detail else ""))


def install_line(extra: str) -> str:
    """The command that installs the optional part ``extra``: into the local directory this
    installation came from, else from the package index by the distribution's name."""
    local = source_dir()
    if local is None:
        return f"pip install '{DISTRIBUTION}[{extra}]'"
    path, editable = local
    return f"pip install {'-e ' if editable else ''}'{path}[{extra}]'"


def version_line() -> str:
    """``llm-foundry --version``: the version, the distribution it belongs to, where it was
    installed from when that was a local directory, and the torch in use."""
    import torch

    local = source_dir()
    origin = f", from {local[0]}" if local else ""
    return f"llm-foundry {__version__} ({DISTRIBUTION}{origin}; torch {torch.__version__})"
