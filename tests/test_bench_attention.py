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
    assert main(["--heads", "12", "--kv-heads", "12,5", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no usage block
    assert "--kv-heads 5" in err and "valid values: 1, 2, 3, 4, 6, 12" in err


def test_budget_and_out_are_checked_before_measuring(tmp_path, capsys):
    from llm_foundry.cli import main as cli_main

    (tmp_path / "file.txt").write_text("x")
    for args, message in (
        (["--max-mem-gib", "-1"], "--max-mem-gib must be > 0, got -1.0"),
        (["--out", str(tmp_path / "file.txt")], "file.txt is a file; give a directory"),
    ):
        assert cli_main(["bench", "attention", "--device", "cpu", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("llm-foundry bench attention: error: ") and message in err
        assert err.count("\n") == 1, err
    assert cli_main(["bench", "--help"]) == 0
    assert "llm-foundry bench attention -h" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, names",
    [
        (["attention", "--device", "tpu"], ["'tpu'", "'auto', 'cpu', 'cuda'"]),
        (["attention", "--dtype", "fp64"], ["'fp64'", "'fp32', 'bf16', 'fp16'"]),
        (["attention", "--impls", "manual,flashy"], ["flashy", "manual, sdpa, sdpa:flash"]),
        (["attention", "--seq-lens", "1k"], ["--seq-lens", "'1k'", "integers"]),
        (["attention", "--warmup", "0"], ["argument --warmup: 0 must be at least 1"]),
        (["attention", "--head-dim", "2.5"], ["argument --head-dim: '2.5' is not a whole number"]),
        (["attention", "--bogus"], ["--bogus"]),
        (["foo"], ["unknown benchmark 'foo'", "valid: attention"]),
        ([], ["no benchmark given", "valid: attention"]),
    ],
)
def test_misuse_is_one_line_naming_the_value_and_the_choices(argv, names, capsys):
    """`bench` errors as every other command gives them: one line naming what was wrong and
    what is valid, no usage block, exit 2."""
    from llm_foundry.cli import main as cli_main

    assert cli_main(["bench", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("llm-foundry bench"), captured.err
    assert "usage:" not in captured.err
    for name in names:
        assert name in captured.err, (name, captured.err)


# Ctrl-C at a terminal signals the whole process group: the benchmark, its fork server and the
# worker measuring a row. Here the worker of the third row sends it (then takes its time, as a
# long row would), so the signal lands while a worker is running.
INTERRUPTING = """
import os, signal, sys, time
import llm_foundry.bench.attention as A
from llm_foundry.bench.memory import run_isolated
from llm_foundry.cli import main


def interrupting_measure(spec, what):
    if (spec["kv_heads"], spec["seq_len"], spec["impl"]) == (2, 32, "manual"):
        sig = signal.Signals[os.environ["BENCH_SIGNAL"]]
        if os.environ["BENCH_TARGET"] == "group":  # Ctrl-C at a terminal, `timeout`
            os.killpg(0, sig)
        else:  # `kill PID`: the benchmark's process alone
            os.kill(int(os.environ["BENCH_PID"]), sig)
        time.sleep(60)  # a worker still running after the benchmark ended would keep sleeping
    return A.measure(spec, what)


def memory_isolated(spec):
    return run_isolated(interrupting_measure, spec, "memory", preload="llm_foundry.bench.attention")


if __name__ == "__main__":
    os.environ["BENCH_PID"] = str(os.getpid())
    A.memory_isolated = memory_isolated
    sys.exit(main(sys.argv[1:]))
"""


def _group_gone(pgid: int, seconds: float) -> bool:
    import os
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize(
    "name, target, status",
    [("SIGINT", "group", 130), ("SIGTERM", "group", 143), ("SIGTERM", "process", 143)],
)
def test_ctrl_c_or_sigterm_is_one_line_and_keeps_the_rows_measured(tmp_path, name, target, status):
    """SIGINT (Ctrl-C) or SIGTERM (a scheduler, `timeout`: to the process group; `kill`: to the
    benchmark alone) mid-run: exit 128 + the signal, one line on stderr besides the progress
    bar (no worker traceback), the two finished rows written to --out marked partial, and no
    process of the run left behind."""
    import os
    import subprocess

    script = tmp_path / "interrupting.py"
    script.write_text(INTERRUPTING)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, str(script), "bench", "attention", *TINY, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell gives a command
        env=dict(os.environ, BENCH_SIGNAL=name, BENCH_TARGET=target),
    )
    stdout, stderr = proc.communicate(timeout=120)
    assert _group_gone(proc.pid, 10), "a process of the run outlived it"
    lines = [x for x in stderr.replace("\r", "\n").splitlines() if x.strip()]
    said = [x for x in lines if not x.startswith("attention:")]  # the tqdm bar's redraws
    want = (
        f"llm-foundry bench attention: stopped by {name}: 2 of 8 rows measured; "
        f"written to {out} (marked partial)"
    )
    assert said == [want], stderr
    assert proc.returncode == status and stdout == ""
    report = json.loads((out / "attention_bench.json").read_text())
    assert report["stopped_by"] == name and report["rows_planned"] == 8
    # the command as it was run (the subcommand here; the script in test_a_whole_run...)
    assert report["command"] == " ".join(["llm-foundry bench attention", *TINY, "--out", str(out)])
    assert [(r["seq_len"], r["impl"], r["status"]) for r in report["rows"]] == [
        (16, "manual", "ok"),
        (16, "sdpa", "ok"),
    ]
    assert report["rows"][1]["max_abs_diff_out"] < 1e-5  # the finished T was compared
    table = (out / "attention_bench.md").read_text()
    assert f"partial: stopped by {name} after 2 of 8 rows" in table.splitlines()[0]
    assert (out / "attention_bench.png").exists()


def test_a_whole_run_is_not_marked_partial(bench):
    out, report = bench
    assert report["command"] == " ".join(["python benchmarks/bench_attention.py", *TINY, "--out",
                                          str(out)])  # fmt: skip
    assert report["stopped_by"] is None and report["rows_planned"] == len(report["rows"])
    assert "partial" not in (out / "attention_bench.md").read_text().splitlines()[0]
