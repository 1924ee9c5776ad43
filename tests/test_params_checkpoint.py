"""``params`` of a model one has rather than a preset: ``--checkpoint DIR`` (a run, one of our
checkpoints, an HF directory) or ``--config DIR/config.json``, each read by the one reader of its
format; the totals equal transformers' count of the same HF model."""

from __future__ import annotations

import json

import pytest
from conftest import cli_status, tiny_hf_llama

transformers = pytest.importorskip("transformers")


def _report(argv, capsys) -> dict:
    from llm_foundry.cli import main

    capsys.readouterr()
    assert main(["params", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("tied", [False, True])
def test_an_hf_directory_and_its_conversion_count_what_transformers_counts(tmp_path, capsys, tied):
    from llm_foundry.export import convert_from_hf

    model = tiny_hf_llama(0, tie_word_embeddings=tied)
    model.save_pretrained(str(tmp_path / "hf"))
    convert_from_hf(tmp_path / "hf", tmp_path / "ck")
    hf_total = sum(p.numel() for p in model.parameters())  # a shared head counted once
    reports = {
        "--checkpoint HF": _report(["--checkpoint", str(tmp_path / "hf")], capsys),
        "--config HF/config.json": _report(
            ["--config", str(tmp_path / "hf" / "config.json")], capsys
        ),  # fmt: skip
        "--checkpoint CK": _report(["--checkpoint", str(tmp_path / "ck")], capsys),
        "--config CK/config.json": _report(
            ["--config", str(tmp_path / "ck" / "config.json")], capsys
        ),  # fmt: skip
    }
    totals = {how: rep["total"] for how, rep in reports.items()}
    print(f"transformers {hf_total:,}; ours {totals}")
    assert set(totals.values()) == {hf_total}
    assert len({json.dumps(rep, sort_keys=True) for rep in reports.values()}) == 1


def test_a_checkpoint_s_model_takes_field_flags_and_is_one_model(tmp_path, capsys):
    from llm_foundry.cli import main

    tiny_hf_llama(0).save_pretrained(str(tmp_path / "hf"))
    longer = _report(["--checkpoint", str(tmp_path / "hf"), "--model.max_seq_len", "128"], capsys)
    assert longer["config"]["max_seq_len"] == 128 and longer["config"]["dim"] == 48
    capsys.readouterr()
    assert main(["params", "--checkpoint", str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().out.startswith(f"model of {tmp_path / 'hf'}")
    rc, err = cli_status(["params", "--checkpoint", str(tmp_path / "hf"), "--preset", "gpt2"],
                         capsys)  # fmt: skip
    assert rc == 2 and "give one model" in err and err.count("\n") == 1
