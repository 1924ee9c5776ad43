"""benchmarks/gpu_check.py runs where the project is not installed (a lent GPU machine has torch
but not this venv): it measures the checkout it sits in. Its section budgets are the user's to
set, and a misspelt one is refused in one line."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def bare_python_env() -> dict:
    """An environment whose Python has torch and the other packages but not llm_foundry: with
    -S no .pth file runs, so the editable install's finder is not there; PYTHONPATH gives the
    site-packages folder alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join(site.getsitepackages())
    return env


def test_the_bare_python_really_lacks_the_project():
    """The premise of the test below: without the script's own path, llm_foundry is not found."""
    r = subprocess.run([sys.executable, "-S", "-c", "import torch, llm_foundry"],
                       env=bare_python_env(), capture_output=True, text=True, cwd="/")  # fmt: skip
    assert r.returncode == 1
    assert "No module named 'llm_foundry'" in r.stderr


def test_gpu_check_measures_its_own_checkout_without_an_install(tmp_path):
    out = tmp_path / "gc.json"
    cmd = [sys.executable, "-S", str(SCRIPT), "--device", "cpu", "--tiny", "--quick",
           "--sections", "matmul,loader", "--budget", "120", "--out", str(out)]  # fmt: skip
    r = subprocess.run(cmd, env=bare_python_env(), capture_output=True, text=True, cwd=tmp_path,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert {n: s["status"] for n, s in sections.items()} == {"matmul": "ok", "loader": "ok"}
    # the loader section prepared data and timed steps through the Loader of the checkout: the
    # only llm_foundry this Python can reach
    assert sections["loader"]["train_tokens"] > 0 and sections["loader"]["wait_fraction"] >= 0


def test_a_section_budget_names_a_section_and_seconds():
    r = subprocess.run([sys.executable, str(SCRIPT), "--section-budget", "decoder=60"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last == ("gpu_check.py: error: --section-budget 'decoder=60': expected NAME=SECONDS, "
                    "NAME one of matmul, train, loader, decode, serve, train32")  # fmt: skip
