"""The documentation stays true: every runnable command runs, every code reference exists.

Conventions (docs/architecture/README.md and LEARNING_PATH.md follow them):
- a fenced block whose info string is ``bash runnable`` holds commands a reader can type; each
  line (``\\`` continuations joined, ``#`` comments skipped) is executed here, from a scratch copy
  of the repository, with training shortened: ``--train.max_steps N`` and
  ``--set train.max_steps=N`` become 3, and ``train`` / ``ablate`` commands without a step limit
  get one;
- inline code ```path/file.py::Symbol``` (or ``::Class.method``) names a symbol that must exist;
- relative markdown links and inline ```path``` references to repository files must exist.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
TOP = [ROOT / "README.md", ROOT / "LEARNING_PATH.md", ROOT / "README.zh-CN.md"]
DOCS = sorted([p for p in TOP if p.exists()] + list((ROOT / "docs").rglob("*.md")))
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
SYMBOL_REF = re.compile(r"`([\w./-]+\.py)::([\w.]+)`")
FILE_REF = re.compile(r"`((?:src|tests|benchmarks|tutorials|docs)/[\w./-]+)`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def runnable_commands(text: str) -> list[str]:
    out = []
    for info, body in FENCE.findall(text):
        if info.strip() != "bash runnable":
            continue
        joined = re.sub(r"\\\n\s*", " ", body)
        out += [
            c.strip() for c in joined.splitlines() if c.strip() and not c.strip().startswith("#")
        ]
    return out


def shorten(cmd: str) -> str:
    """The same command with training cut to 3 steps (the docs show the real sizes)."""
    cmd = re.sub(r"(--train\.max_steps[ =])\d+", r"\g<1>3", cmd)
    cmd = re.sub(r"(--set[ =]train\.max_steps=)\d+", r"\g<1>3", cmd)
    words = shlex.split(cmd)
    if words[:2] == ["llm-foundry", "train"] and "max_steps" not in cmd:
        cmd += " --train.max_steps 3 --train.eval_batches 2 --train.sample_tokens 20"
    if words[:2] == ["llm-foundry", "ablate"] and "max_steps" not in cmd and "--list" not in cmd:
        if "--report" not in cmd:
            cmd += " --set train.max_steps=3 --set train.eval_batches=2"
    return cmd


# commands whose output does not depend on the machine or on training: the docs show it verbatim
DETERMINISTIC = ("llm-foundry params ", "llm-foundry ablate --list", "llm-foundry --help")
SHOWN = re.compile(r"^```bash runnable\n([^\n]*)\n```\n\s*\n```(?:text)?\n(.*?)^```", re.S | re.M)


def shown_outputs(text: str) -> dict[str, str]:
    """{command: the output block printed right after it} for one-command deterministic blocks."""
    return {c: out for c, out in SHOWN.findall(text) if c.startswith(DETERMINISTIC)}


def all_commands() -> list[tuple[str, str]]:
    return [(d.name, c) for d in DOCS for c in runnable_commands(d.read_text())]


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip("\n").splitlines()]


@pytest.mark.heavy
def test_deterministic_outputs_in_the_docs_are_what_the_commands_print():
    """`params`, `ablate --list` and `--help` print the same on any machine: the output the docs
    show under such a command must be exactly what it prints now."""
    checked = 0
    for doc in DOCS:
        for cmd, shown in shown_outputs(doc.read_text()).items():
            r = subprocess.run(
                [sys.executable, "-m", "llm_foundry", *shlex.split(cmd)[1:]],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert r.returncode == 0, r.stderr
            assert _lines(r.stdout) == _lines(shown), f"{doc.name}: output of `{cmd}` changed"
            checked += 1
    assert checked >= 3  # LEARNING_PATH and docs/architecture show several such outputs


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, char_data) -> Path:
    """A copy of the repository made of links (runs/ and data/ fresh), the corpus prepared."""
    base = tmp_path_factory.mktemp("docs")
    repo = base / "repo"
    repo.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in ("runs", "data", ".git", ".venv"):
            (repo / entry.name).symlink_to(entry)
    if SHARED.exists():
        (base / "shared").symlink_to(SHARED)
    shutil.copytree(char_data(200_000), repo / "data" / "shakespeare_char")
    return repo


def test_the_docs_have_runnable_commands():
    docs = {name for name, _ in all_commands()}
    assert {"LEARNING_PATH.md"} <= docs or not (ROOT / "LEARNING_PATH.md").exists()


@pytest.mark.heavy
@pytest.mark.parametrize("doc, cmd", all_commands(), ids=lambda v: v[:60])
def test_runnable_command(doc, cmd, scratch):
    env = dict(os.environ, MPLBACKEND="Agg")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    r = subprocess.run(
        shorten(cmd), shell=True, cwd=scratch, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, f"{doc}: `{cmd}` failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"


def _symbol_exists(path: Path, dotted: str) -> bool:
    tree = ast.parse(path.read_text())
    scope: list[ast.stmt] = tree.body
    for part in dotted.split("."):
        found = None
        for node in scope:
            names = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            if part in names:
                found = node
                break
        if found is None:
            return False
        scope = found.body if isinstance(found, ast.ClassDef) else []
    return True


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_references_exist(doc):
    text = doc.read_text()
    missing = []
    for path, symbol in SYMBOL_REF.findall(text):
        file = ROOT / path
        if not file.exists() or not _symbol_exists(file, symbol):
            missing.append(f"{path}::{symbol}")
    for path in FILE_REF.findall(text):
        if not (ROOT / path.rstrip("/")).exists() and "*" not in path:
            missing.append(path)
    for target in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (doc.parent / target).exists():
            missing.append(f"link {target}")
    assert not missing, f"{doc.relative_to(ROOT)} refers to what does not exist: {missing}"


def test_the_checker_catches_a_missing_symbol(tmp_path):
    file = tmp_path / "m.py"
    file.write_text("class A:\n    def f(self):\n        pass\n\nX = 1\n")
    assert _symbol_exists(file, "A.f") and _symbol_exists(file, "X")
    assert not _symbol_exists(file, "A.g") and not _symbol_exists(file, "B")
    assert shorten("llm-foundry train --out runs/a --train.max_steps 2000").endswith("max_steps 3")
    assert "--train.max_steps 3" in shorten("llm-foundry train --out runs/a")
    text = "```bash runnable\nllm-foundry params \\\n  --preset gpt2  # x\n# c\n```\n"
    assert runnable_commands(text) == ["llm-foundry params  --preset gpt2  # x"]
