"""An optional part (an extra of pyproject.toml) not installed: the command says which line
installs it, in one line, and exits 2 before it has done anything; any other ImportError is a
bug and keeps its traceback. Each missing package is simulated by ``sys.modules[name] = None``
(what importing it then raises is the ImportError a fresh environment raises)."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys

import pytest

from llm_foundry.cli import main
from llm_foundry.package import MissingExtra, install_line, missing_extra


def _missing(monkeypatch, *packages: str) -> None:
    """Importing ``packages`` (and their submodules) fails from now on, as without them."""
    for name in list(sys.modules):
        if any(name == p or name.startswith(p + ".") for p in packages):
            monkeypatch.setitem(sys.modules, name, None)
    for p in packages:
        monkeypatch.setitem(sys.modules, p, None)


def _forget(monkeypatch, prefix: str) -> None:
    """Our modules under ``prefix`` imported again (their import of the missing package runs)."""
    for name in [m for m in sys.modules if m == prefix or m.startswith(prefix + ".")]:
        monkeypatch.delitem(sys.modules, name)


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"llm-foundry {command}: error: "), err
    assert "Traceback" not in err
    return err


def test_missing_extra_is_an_import_error_naming_the_install_line():
    e = missing_extra("x needs the y package", "hf", "No module named 'y'")
    assert isinstance(e, ImportError)
    assert str(e) == f"x needs the y package: {install_line('hf')} (No module named 'y')"


def test_train_without_tensorboard_says_so_before_the_run_directory_exists(
    char_data, tmp_path, monkeypatch, capsys
):
    _missing(monkeypatch, "torch.utils.tensorboard", "tensorboard")
    out = tmp_path / "run"
    argv = ["train", "--data", str(char_data(3000)), "--out", str(out), "--model.dim", "16",
            "--model.n_layers", "1", "--model.n_heads", "2", "--train.max_steps", "2",
            "--train.tensorboard", "true"]  # fmt: skip
    assert main(argv) == 2
    err = _one_line_error(capsys, "train")
    assert "train.tensorboard=true needs TensorBoard" in err
    assert install_line("tensorboard") in err
    assert not out.exists()  # no run.json, no metrics.jsonl, no lock left to take over


def test_an_hf_directory_without_transformers_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "text.txt").write_text("some text")
    _missing(monkeypatch, "transformers")
    _forget(monkeypatch, "llm_foundry.interop.hf")
    argv = ["eval", "--checkpoint", str(tmp_path / "hf"), "--text", str(tmp_path / "text.txt")]
    assert main(argv) == 2
    err = _one_line_error(capsys, "eval")
    assert "needs the transformers package" in err and install_line("hf") in err


def test_the_gguf_writer_without_gguf_raises_missing_extra(monkeypatch):
    _missing(monkeypatch, "gguf")
    _forget(monkeypatch, "llm_foundry.interop.gguf")
    with pytest.raises(MissingExtra, match=r"needs the gguf package: .*\[gguf\]"):
        import llm_foundry.interop.gguf  # noqa: F401


def test_the_harness_module_without_lm_eval_is_one_line(monkeypatch, capsys):
    """``python -m llm_foundry.harness --help`` (what runpy does for -m) without the [eval]
    extra: one line and exit 2, no traceback."""
    _missing(monkeypatch, "lm_eval")
    monkeypatch.setattr(sys, "argv", ["harness", "--help"])
    with pytest.raises(SystemExit) as ended:
        runpy.run_module("llm_foundry.harness", run_name="__main__")
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m llm_foundry.harness: error: "), err
    assert install_line("eval") in err


def test_importing_the_harness_without_lm_eval_raises_missing_extra(monkeypatch):
    _missing(monkeypatch, "lm_eval")
    _forget(monkeypatch, "llm_foundry.harness")
    with pytest.raises(MissingExtra, match="evaluation harness"):
        import llm_foundry.harness  # noqa: F401


def test_any_other_import_error_keeps_its_traceback(monkeypatch):
    """A module of ours that fails to import is a bug: not turned into a one-line message."""
    _forget(monkeypatch, "llm_foundry.cli.params")
    monkeypatch.setitem(sys.modules, "llm_foundry.cli.params", None)
    with pytest.raises(ImportError) as raised:
        main(["params", "--preset", "gpt2-small"])
    assert not isinstance(raised.value, MissingExtra)


@pytest.mark.parametrize(
    "package, argv",
    [("transformers", ["convert", "--from-hf", "hf", "--out", "out"]),
     ("gguf", ["convert", "--to-gguf", "ckpt", "--out", "x.gguf"])],
)  # fmt: skip
def test_an_installed_but_broken_extra_keeps_its_own_error(tmp_path, package, argv):
    """A package that is there but fails to import (a name its dependency lacks) is not
    'not installed': reinstalling the extra would not help, so its own error is shown."""
    broken = tmp_path / "site" / package
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(
        "raise ImportError(\"cannot import name 'Gone' from 'tokenizers' (a broken install)\")\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), *sys.path])}
    proc = subprocess.run([sys.executable, "-m", "llm_foundry", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0 and "cannot import name 'Gone'" in proc.stderr, proc.stderr
    assert "pip install" not in proc.stderr
