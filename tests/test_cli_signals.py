"""Ctrl-C at any moment of a command is one line and exit 130: also while its modules (torch)
load, where a KeyboardInterrupt would leave torch half-imported (cli/signals.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # a subprocess that imports torch

# SIGINT to itself in the middle of importing torch (when torch.nn.functional starts loading)
MID_IMPORT = """
import importlib.abc, os, signal, sys


class Interrupting(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch.nn.functional":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None  # the import itself goes on as usual


sys.meta_path.insert(0, Interrupting())
from llm_foundry.cli import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [["params", "--preset", "gpt2"], ["prepare", "--help"]])
def test_ctrl_c_while_torch_loads_is_one_line(argv, tmp_path):
    script = tmp_path / "interrupting.py"
    script.write_text(textwrap.dedent(MID_IMPORT))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    done = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert done.returncode == 130, done.stderr[-3000:]
    assert done.stderr == f"llm-foundry {argv[0]}: stopped by SIGINT: before it finished\n"
    assert done.stdout == ""
