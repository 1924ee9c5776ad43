"""`bench attention --out` is a directory: its help says so, and a file name (.md, .json, .png)
is refused in one line before anything is measured, rather than made a directory of that name."""

from __future__ import annotations

import pytest

from llm_foundry.cli import main


@pytest.mark.parametrize("name", ["bench.md", "bench.json", "attention.png"])
def test_a_file_name_for_out_is_refused_in_one_line(name, tmp_path, capsys):
    out = tmp_path / name
    argv = ["bench", "attention", "--device", "cpu", "--seq-lens", "16", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"llm-foundry bench attention: error: --out {out} names a file; ")
    assert "attention_bench.md, attention_bench.json, attention_bench.png" in err
    assert str(out.with_suffix("")) in err  # the directory to give instead
    assert not out.exists()


def test_an_existing_directory_with_such_a_name_is_still_a_directory(tmp_path):
    """A directory the user made called results.md is theirs to name so: the options parse."""
    from llm_foundry.cli.bench import parse_args

    out = tmp_path / "results.md"
    out.mkdir()
    assert parse_args(["--device", "cpu", "--seq-lens", "16", "--out", str(out)]).out == out


def test_help_says_out_is_a_directory(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "attention", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--out DIR a directory (made if missing) to write attention_bench.md," in text
