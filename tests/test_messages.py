"""How values appear in errors: ``shown`` cuts a long value to its start and its size, and the
command line caps whatever error it prints, so no value is echoed back whole."""

from __future__ import annotations

from llm_foundry.cli import main
from llm_foundry.messages import MAX_ERROR, capped, one_line, shown


def test_shown_keeps_short_values_and_names_the_size_of_long_ones():
    assert shown(3) == "3" and shown("ab") == "'ab'"
    assert shown(list(range(10_000))).endswith("... (10,000 items)")
    assert shown("x" * 500).endswith("... (500 characters)") and len(shown("x" * 500)) < 90
    assert shown(b"y" * 500).endswith("(500 bytes)")


def test_one_line_joins_whitespace_and_cuts():
    assert one_line("a\n  b\tc") == "a b c"
    assert one_line("x" * 500, limit=10) == "x" * 10 + "..."


def test_capped_keeps_both_ends():
    text = "start " + "x" * 10_000 + " end"
    out = capped(text)
    assert out.startswith("start ") and out.endswith(" end") and len(out) < MAX_ERROR + 60
    assert f"({len(text) - MAX_ERROR:,} characters cut)" in out
    assert capped("short") == "short"


def test_the_command_line_never_prints_a_whole_long_value(tmp_path, capsys):
    long = "d" * 20_000
    assert main(["generate", "--checkpoint", str(tmp_path / long), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llm-foundry generate: error: ") and len(err) < MAX_ERROR + 100, len(err)
    assert main([long]) == 2
    assert len(capsys.readouterr().err) < 2_000
