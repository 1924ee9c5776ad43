"""A run that starts from a model (``train.init_from``, ``finetune --checkpoint``) trains on data
of that model's tokenizer: one whose ids mean other tokens is refused in one line even where the
vocabulary sizes match; the same tokenizer in another file form (the HF one ``convert --to-hf``
writes for a character model) and data prepared with ``--tokenizer-from`` an HF directory are
taken."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from conftest import cli_status

from llm_foundry.cli import main
from llm_foundry.data import prepare

MODEL = ["--model.dim=16", "--model.n_layers=1", "--model.n_heads=2", "--model.max_seq_len=32"]
QUIET = ["--train.block_size=16", "--train.batch_size=2", "--train.eval_batches=1",
         "--train.warmup_steps=1", "--train.sample_tokens=0", "--train.progress=false"]  # fmt: skip


def _char_data(root: Path, name: str, text: str) -> Path:
    (root / f"{name}.txt").write_text(text)
    prepare(root / name, text_files=[root / f"{name}.txt"], tokenizer="char", progress=False)
    return root / name


@pytest.fixture(scope="module")
def char_runs(tmp_path_factory):
    """(root, {name: data directory}, a 2-step run on "lower"): lower-case text; "upper", the
    same text in capitals (27 characters each, other ones); "shuffled", other text of lower's
    alphabet."""
    root = tmp_path_factory.mktemp("init-from-tokenizer")
    rng = random.Random(0)
    lower = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(6000))
    data = {
        "lower": _char_data(root, "lower", lower),
        "upper": _char_data(root, "upper", lower.upper().replace(" ", "_")),
        "shuffled": _char_data(root, "shuffled", "".join(rng.sample(lower, len(lower)))),
    }
    run = root / "base"
    argv = ["train", "--data", str(data["lower"]), "--out", str(run), *MODEL, *QUIET,
            "--train.max_steps=2"]  # fmt: skip
    assert main(argv) == 0
    return root, data, run


def test_a_model_of_another_tokenizer_of_the_same_size_is_refused(char_runs, tmp_path, capsys):
    root, data, base = char_runs
    ckpt_tok = base / "checkpoints" / "step_000002" / "tokenizer.json"
    assert json.loads((data["upper"] / "meta.json").read_text())["vocab_size"] == 27
    for argv in (
        ["finetune", "--checkpoint", str(base), "--data", str(data["upper"]), *QUIET],
        ["train", "--data", str(data["upper"]), *MODEL, *QUIET, "--train.init_from", str(base)],
    ):
        out = tmp_path / argv[0]
        rc, err = cli_status([*argv, "--out", str(out), "--train.max_steps=1"], capsys)
        assert rc == 2 and err.count("\n") == 1, err
        assert (f"train.init_from {base}: its tokenizer ({ckpt_tok}) is not the one "
                f"{data['upper']} was prepared with, though both have 27 ids") in err  # fmt: skip
        assert not (out / "checkpoints").exists()
    # the same alphabet in other text: the same ids, taken
    rc, err = cli_status(["finetune", "--checkpoint", str(base), "--data", str(data["shuffled"]),
                          "--out", str(tmp_path / "ok"), *QUIET, "--train.max_steps=1"], capsys)  # fmt: skip
    assert rc == 0, err


def test_a_character_model_exported_to_hf_takes_its_own_data(char_runs, tmp_path, capsys):
    """convert --to-hf writes the character tokenizer in HF's form (other bytes, the same ids)."""
    pytest.importorskip("transformers")
    _, data, base = char_runs
    hf = tmp_path / "hf"
    assert main(["convert", "--to-hf", str(base), "--out", str(hf)]) == 0
    ours = base / "checkpoints" / "step_000002" / "tokenizer.json"
    assert (hf / "tokenizer.json").read_bytes() != ours.read_bytes()
    argv = ["finetune", "--checkpoint", str(hf), "--data", str(data["lower"]), *QUIET,
            "--train.max_steps=1"]  # fmt: skip
    rc, err = cli_status([*argv, "--out", str(tmp_path / "ok")], capsys)
    assert rc == 0, err
    rc, err = cli_status(["finetune", "--checkpoint", str(hf), "--data", str(data["upper"]),
                          *QUIET, "--train.max_steps=1", "--out", str(tmp_path / "no")], capsys)  # fmt: skip
    assert rc == 2 and "is not the one" in err


def test_an_hf_model_takes_data_prepared_with_its_tokenizer_and_refuses_a_permuted_one(
    tmp_path, capsys
):
    """`prepare --input --tokenizer-from HF_DIR` keeps the model's tokenizer: taken. The same
    tokenizer with two ids swapped (the same size, the same tokens) is another: refused."""
    pytest.importorskip("transformers")
    from test_corpus import make_docs, write
    from test_tokenizer_files import _chatml_model

    hf, swapped = tmp_path / "hf", tmp_path / "swapped"
    _chatml_model(hf)
    shutil.copytree(hf, swapped)
    spec = json.loads((hf / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    docs = write(tmp_path / "docs.jsonl", make_docs(60, seed=1), "jsonl")
    for model in (hf, swapped):
        argv = ["prepare", "--input", str(docs), "--tokenizer-from", str(model), "--out",
                str(tmp_path / f"data-{model.name}")]  # fmt: skip
        assert main(argv) == 0, capsys.readouterr().err
    flags = ["--checkpoint", str(hf), *QUIET, "--train.max_steps=1"]
    rc, err = cli_status(["finetune", *flags, "--data", str(tmp_path / "data-hf"), "--out",
                          str(tmp_path / "ok")], capsys)  # fmt: skip
    assert rc == 0, err
    rc, err = cli_status(["finetune", *flags, "--data", str(tmp_path / "data-swapped"), "--out",
                          str(tmp_path / "no")], capsys)  # fmt: skip
    assert rc == 2 and err.count("\n") == 1, err
    assert f"its tokenizer ({hf / 'tokenizer.json'}) is not the one" in err
    assert f"--tokenizer-from {hf}" in err  # the model named in the command to run
