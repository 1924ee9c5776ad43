"""What ``pip install`` of this project gives: the distribution's name in ``--version`` and in
every install line of the docs, a wheel holding every file of the package (data files too), and
an installed ``llm-foundry`` that works from a fresh virtual environment that cannot see this
source tree.

The end-to-end test (``heavy``) installs the wheel into a new venv in ``tmp_path``. Its
dependencies (torch and the rest, ~1 GB) are installed once with ``pip install --target`` into
``~/.cache/llm-foundry/wheel-test-deps/KEY`` (KEY: the Python version and the wheel's
requirements, so changing them installs anew) and put on the new venv's path by a ``.pth`` file;
that directory holds no llm_foundry. The project's wheel itself is built and installed afresh
on every run.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from llm_foundry import __version__, package
from llm_foundry.cli import main

ROOT = Path(__file__).resolve().parents[1]
TORCH_PIN = "torch==2.13.0"  # as the Makefile: this exact torch, a CPU build where one is offered


# --- fast: the name the docs and messages give -------------------------------------------------


def test_version_names_the_distribution_and_its_version(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"llm-foundry {__version__} (llm-foundry-lab")
    assert "torch " in out


def test_the_distribution_name_is_the_one_pyproject_builds():
    name = re.search(r'^name = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert name and name.group(1) == package.DISTRIBUTION == "llm-foundry-lab"


def test_install_line_names_the_distribution_for_an_index_install(monkeypatch):
    monkeypatch.setattr(package, "source_dir", lambda: None)
    assert package.install_line("serve") == "pip install 'llm-foundry-lab[serve]'"


def test_install_line_names_the_directory_of_a_local_install(monkeypatch):
    monkeypatch.setattr(package, "source_dir", lambda: ("/src/llm-foundry", True))
    assert package.install_line("gguf") == "pip install -e '/src/llm-foundry[gguf]'"
    monkeypatch.setattr(package, "source_dir", lambda: ("/src/llm-foundry", False))
    assert package.install_line("gguf") == "pip install '/src/llm-foundry[gguf]'"


# `pip install llm-foundry` (any extra, any quoting) installs another project from PyPI
WRONG_NAME = re.compile(r"""pip install\s+(?:-\S+\s+)*['"]?llm-foundry(?![\w-])""")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def wrong_install_lines(text: str) -> list[str]:
    """The commands in ``text`` that would install PyPI's llm-foundry: every such line of a
    code block, and in prose every one with an extra (``llm-foundry[serve]``); prose may name
    the bare ``pip install llm-foundry`` to warn against it."""
    blocks = [line for block in FENCE.findall(text) for line in block.splitlines()]
    prose = FENCE.sub("", text).splitlines()
    return [line.strip() for line in blocks if WRONG_NAME.search(line)] + [
        line.strip()
        for line in prose
        if any(m.group().endswith("[") for m in re.finditer(WRONG_NAME.pattern + r"\[?", line))
    ]


def test_no_install_line_in_the_docs_names_the_other_project():
    docs = [ROOT / "README.md", ROOT / "README.zh-CN.md", ROOT / "LEARNING_PATH.md"]
    docs += sorted((ROOT / "docs").rglob("*.md"))
    found = {
        str(doc.relative_to(ROOT)): bad
        for doc in docs
        if doc.exists() and (bad := wrong_install_lines(doc.read_text(encoding="utf-8")))
    }
    assert not found, f"PyPI's llm-foundry is another project: {found}"


def test_the_docs_check_finds_the_other_projects_name():
    fenced = "```bash\npip install 'llm-foundry[serve]'\npip install -e '.[serve]'\n```\n"
    assert wrong_install_lines(fenced) == ["pip install 'llm-foundry[serve]'"]
    assert wrong_install_lines("```\npip install llm-foundry\n```\n") == ["pip install llm-foundry"]
    prose = "(the extra: `pip install 'llm-foundry[tensorboard]'`)"
    assert wrong_install_lines(prose) == [prose]
    assert not wrong_install_lines("`pip install llm-foundry` installs another project")
    assert not wrong_install_lines("```\npip install 'llm-foundry-lab[serve]'\n```\n")


# --- heavy: the wheel, and the command installed from it ---------------------------------------


def package_files() -> list[str]:
    """Every file under src/llm_foundry that git tracks or would track (new files not yet
    added, ignored ones left out), as paths inside the wheel (``llm_foundry/...``)."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("the files of the package are listed by git: not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "src/llm_foundry"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    files = [f for f in listed.split("\0") if f and (ROOT / f).is_file()]  # not deleted ones
    return sorted(f.removeprefix("src/") for f in files)


def _pip_failed(what: str, proc: subprocess.CompletedProcess) -> str:
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if "is ignored" not in x]
    return f"{what} failed ({proc.returncode}):\n" + "\n".join(lines[-40:])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``pip wheel`` builds from a copy of the checkout's files (as a clone has them):
    without build isolation where this environment has setuptools >= 77, else with it."""
    tree, files = tmp_path_factory.mktemp("tree"), package_files()
    top = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    top = [f for f in top.stdout.split("\0") if f and "/" not in f and (ROOT / f).is_file()]
    for f in top + [f"src/{f}" for f in files]:
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, tree / f)
    try:
        import setuptools

        isolation = int(setuptools.__version__.split(".")[0]) < 77
    except ImportError:
        isolation = True
    out = tree / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(tree)]
    proc = subprocess.run(cmd + ([] if isolation else ["--no-build-isolation"]), **_quiet())
    assert proc.returncode == 0, _pip_failed("pip wheel", proc)
    warned = re.findall(r"\w*(?:Deprecation|BuildBackend)Warning: .*", proc.stdout + proc.stderr)
    assert not warned, warned  # e.g. setuptools' on `project.license` as a table
    (whl,) = out.glob("llm_foundry_lab-*.whl")
    return whl


def _quiet() -> dict:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    for var in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"):
        env.pop(var, None)
    return dict(capture_output=True, text=True, env=env)


@pytest.mark.heavy
def test_the_wheel_holds_every_file_of_the_package(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    files = package_files()
    data = [f for f in files if not f.endswith(".py")]
    assert data, "the package has data files (recipes, tasks): the listing found none"
    missing = [f for f in files if f not in names]
    assert not missing, (
        "not in the wheel: add them to [tool.setuptools.package-data] in pyproject.toml: "
        + ", ".join(missing)
    )
    # pyproject says MIT, whose terms ask that the licence text travel with every copy
    licence = [n for n in names if re.fullmatch(r"[^/]+\.dist-info/licenses/LICENSE", n)]
    assert licence, "the wheel carries no LICENSE file (.dist-info/licenses/LICENSE)"


def _requirements(whl: Path) -> list[str]:
    """The wheel's Requires-Dist without extras."""
    with zipfile.ZipFile(whl) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA")))
    reqs = Parser().parsestr(meta.decode()).get_all("Requires-Dist") or []
    return sorted(r for r in reqs if "extra ==" not in r)


def _dependencies(whl: Path) -> Path:
    """A directory holding the wheel's dependencies (no llm_foundry), installed once per Python
    version and requirement list and shared between runs (and concurrent sessions: a lock)."""
    reqs = [TORCH_PIN, *_requirements(whl)]
    key = hashlib.sha256(json.dumps([sys.version_info[:2], reqs]).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = cache / "llm-foundry" / "wheel-test-deps"
    root.mkdir(parents=True, exist_ok=True)
    done = root / key
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_dir():
            partial = root / f"{key}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            pip = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(partial)]
            proc = subprocess.run(pip + reqs, **_quiet())
            assert proc.returncode == 0, _pip_failed(f"installing {reqs}", proc)
            partial.rename(done)
    assert not (done / "llm_foundry").exists()
    return done


def _run(venv: Path, cwd: Path, *args: str, timeout: float = 300) -> str:
    proc = subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]], cwd=cwd, timeout=timeout, **_quiet()
    )
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{proc.stderr}"
    return proc.stdout


def _corpus(n_chars: int) -> str:
    """A small text of its own (the tests never need the shared data): lines of words."""
    words = "the king and queen of a small town sing to their old horse at night".split()
    lines, i = [], 0
    while sum(map(len, lines)) < n_chars:
        lines.append(" ".join(words[(i * k) % len(words)] for k in range(1, 9)).capitalize())
        i += 1
    return "\n".join(lines) + "\n"


@pytest.mark.heavy
def test_the_installed_command_works_without_the_source_tree(wheel, tmp_path):
    started = time.monotonic()
    deps = _dependencies(wheel)
    venv = tmp_path / "venv"  # no pip, no setuptools of its own: only the wheel and its deps
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "_wheel_test_dependencies.pth").write_text(
        f"import site; site.addsitedir({str(deps)!r})\n"
    )
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    proc = subprocess.run(pip + ["install", "--no-deps", "--no-index", str(wheel)], **_quiet())
    assert proc.returncode == 0, _pip_failed("installing the wheel", proc)
    proc = subprocess.run(pip + ["check"], **_quiet())  # the dependencies the wheel asks for
    assert proc.returncode == 0, _pip_failed("pip check", proc)
    installed = time.monotonic() - started

    work = tmp_path / "work"  # the commands run here, away from the checkout
    work.mkdir()
    where = _run(
        venv, work, "python", "-c", "import sys, llm_foundry; print(llm_foundry.__file__, sys.path)"
    )
    assert where.startswith(str(site / "llm_foundry" / "__init__.py")), where
    assert str(ROOT) not in where, where  # neither this checkout's src nor its .venv

    out = _run(venv, work, "llm-foundry", "--version")
    assert out.startswith(f"llm-foundry {__version__} (llm-foundry-lab; torch "), out
    assert "usage: llm-foundry" in _run(venv, work, "llm-foundry", "--help")
    out = _run(venv, work, "llm-foundry", "params", "--preset", "llama-shakespeare-char")
    assert "804,224" in out, out

    # the data files, read where the wheel put them: the recipes (ablate), the tasks (eval)
    out = _run(venv, work, "llm-foundry", "ablate", "--list")
    recipes = [f for f in package_files() if f.startswith("llm_foundry/recipes/")]
    assert recipes and all(Path(r).stem in out for r in recipes), out
    check_tasks = (
        "import json, yaml; from llm_foundry.tasks import TASKS_DIR, LOCAL_TASKS\n"
        "for t in LOCAL_TASKS: yaml.load((TASKS_DIR / f'{t}.yaml').read_text(), yaml.BaseLoader)\n"
        "for f in sorted(TASKS_DIR.glob('*.jsonl')):\n"
        "    rows = [json.loads(x) for x in f.read_text().splitlines()]; print(f.name, len(rows))\n"
        "print(TASKS_DIR)"
    )
    out = _run(venv, work, "python", "-c", check_tasks)
    assert out.strip().endswith(str(site / "llm_foundry" / "tasks")), out
    assert "next_line.jsonl" in out and "passages.jsonl" in out, out

    (work / "corpus.txt").write_text(_corpus(30_000))
    _run(venv, work, "llm-foundry", "prepare", "--text", "corpus.txt", "--out", "data/mine")
    assert (work / "data/mine/meta.json").is_file()
    train = ["--preset", "llama-shakespeare-char", "--data", "data/mine", "--out", "runs/tiny"]
    train += ["--train.max_steps", "10", "--train.eval_interval", "5", "--train.eval_batches"]
    train += ["2", "--train.sample_tokens", "20", "--train.progress", "false"]
    out = _run(venv, work, "llm-foundry", "train", *train)
    assert "done: step 10" in out, out
    assert (work / "runs/tiny/loss.png").is_file()
    gen = ["--checkpoint", "runs/tiny", "--prompt", "The king", "--max-new-tokens", "20"]
    out = _run(venv, work, "llm-foundry", "generate", *gen, "--seed", "0")
    assert out.startswith("The king") and len(out) > len("The king"), out
    print(f"installed in {installed:.1f} s; everything in {time.monotonic() - started:.1f} s")
