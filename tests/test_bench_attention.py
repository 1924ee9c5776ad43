"""The attention benchmark on tiny sizes: every row measured, manual and SDPA agree, the table,
JSON and plot are written, sizes that cannot run are recorded, bad options are refused."""

from __future__ import annotations

import json
import sys

import matplotlib.image
import pytest

from llm_foundry.cli.bench import attention_main as main

pytestmark = pytest.mark.heavy  # subprocesses: left out of `make test-fast`

TINY = ["--seq-lens", "16,32", "--heads", "2", "--head-dim", "8", "--device", "cpu"]
TINY += ["--kv-heads", "2,1", "--repeats", "2"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("attention")
    assert main([*TINY, "--out", out]) == 0
    return out, json.loads((out / "attention_bench.json").read_text())


def test_every_row_is_measured_and_the_impls_agree(bench):
    _, report = bench
    rows = report["rows"]
    expected = [
        (kind, kv, T, impl)
        for kind, kv in (("MHA", 2), ("MQA", 1))
        for T in (16, 32)
        for impl in ("manual", "sdpa")
    ]
    assert [(r["attention"], r["kv_heads"], r["seq_len"], r["impl"]) for r in rows] == expected
    for r in rows:
        assert r["status"] == "ok", r
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
        for key in ("peak_fwd_bytes", "peak_fwd_bwd_bytes"):
            if sys.platform == "linux":  # elsewhere no honest CPU peak exists: None
                assert isinstance(r[key], int) and r[key] >= 0, (key, r)
        assert set(r["manual_over_this"]) == {
            "fwd_ms",
            "fwd_bwd_ms",
            "peak_fwd_bytes",
            "peak_fwd_bwd_bytes",
        }
        if r["impl"] == "sdpa":
            assert r["max_abs_diff_out"] < 1e-5 and r["max_abs_diff_grad"] < 1e-5, r
    assert report["settings"]["dtype"] == "fp32"
    assert "VmHWM" in report["memory_method"]


def test_table_and_plot_are_written(bench):
    out, report = bench
    table = (out / "attention_bench.md").read_text()
    body = [line for line in table.splitlines() if line.startswith(("| MHA |", "| MQA |"))]
    assert len(body) == len(report["rows"]) == 8
    assert "peak fwd+bwd MiB" in table and "manual/this fwd+bwd" in table
    image = matplotlib.image.imread(out / "attention_bench.png")
    assert image.shape[0] == 500 and image.shape[1] == 1300  # 13 x 5 inches at 100 dpi
    assert image[..., :3].std() > 0.05  # not blank


def test_rows_that_cannot_run_are_recorded(tmp_path):
    argv = ["--seq-lens", "16", "--heads", "2", "--head-dim", "8", "--kv-heads", "2"]
    argv += ["--device", "cpu", "--repeats", "1", "--impls", "manual,sdpa:efficient"]
    assert main([*argv, "--out", tmp_path]) == 0
    rows = json.loads((tmp_path / "attention_bench.json").read_text())["rows"]
    assert [r["status"] for r in rows][0] == "ok"
    assert rows[1]["status"].startswith("n/a: ")  # no memory-efficient kernel on CPU
    assert main([*argv, "--max-mem-gib", "1e-9", "--out", tmp_path]) == 0  # nothing fits
    rows = json.loads((tmp_path / "attention_bench.json").read_text())["rows"]
    assert all(r["status"].startswith("skipped: would need ~") for r in rows)
    assert all(r["fwd_ms"] is None for r in rows)


def test_kv_heads_must_divide_heads(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--heads", "12", "--kv-heads", "12,5", "--device", "cpu"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-heads 5" in err and "valid values: 1, 2, 3, 4, 6, 12" in err


def test_budget_and_out_are_checked_before_measuring(tmp_path, capsys):
    from llm_foundry.cli import main as cli_main

    (tmp_path / "file.txt").write_text("x")
    for args, message in (
        (["--max-mem-gib", "-1"], "--max-mem-gib must be > 0, got -1.0"),
        (["--out", str(tmp_path / "file.txt")], "file.txt is a file; give a directory"),
    ):
        with pytest.raises(SystemExit) as exc:
            cli_main(["bench", "attention", "--device", "cpu", *args])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: llm-foundry bench attention") and message in err
    assert cli_main(["bench", "--help"]) == 0
    assert "llm-foundry bench attention -h" in capsys.readouterr().out
