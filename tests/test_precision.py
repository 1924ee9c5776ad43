"""bf16 detection (llm_foundry.train.precision) and ``train.dtype auto``: the decision on
synthetic inputs, the real check on whatever CPU runs the tests (AVX2-only or AVX512-BF16/AMX:
only relations are asserted), and a tiny run that resolves, records and keeps its dtype."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import make_trainer

from llm_foundry.config import ConfigError
from llm_foundry.train import precision
from llm_foundry.train.config import DTYPES, TrainConfig
from llm_foundry.train.precision import FAST_RATIO, Bf16Support, bf16_support, decide_cpu

AVX2 = frozenset({"fpu", "sse4_2", "avx", "avx2", "fma"})
AMX = AVX2 | {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}


def test_bf16_flags_and_fast_matmul_choose_bf16():
    s = decide_cpu(AMX, "AVX512", t_fp32=3.1e-3, t_bf16=1e-3)
    assert s.fast and s.ratio == pytest.approx(3.1)
    assert "AVX512_BF16+AMX_BF16" in s.reason and "3.1x" in s.reason


def test_avx2_only_keeps_fp32_and_names_the_missing_flag():
    s = decide_cpu(AVX2, "AVX2", t_fp32=1e-3, t_bf16=0.1)
    assert not s.fast and s.ratio == pytest.approx(0.01)
    assert "AVX2" in s.reason and "avx512_bf16" in s.reason and "0.01x" in s.reason


def test_avx2_only_is_fp32_even_when_the_timing_is_fast():
    # the flags decide first: one lucky timing must not turn on a scalar bf16 fallback
    assert not decide_cpu(AVX2, "AVX2", t_fp32=2e-3, t_bf16=1e-3).fast


def test_bf16_flag_but_slow_matmul_keeps_fp32():
    s = decide_cpu(AMX, "AVX512", t_fp32=1e-3, t_bf16=2e-3)
    assert not s.fast and "but" in s.reason and "0.5x" in s.reason


def test_unreadable_flags_decide_on_the_measurement():
    assert decide_cpu(None, "DEFAULT", t_fp32=2e-3, t_bf16=1e-3).fast
    assert not decide_cpu(None, "DEFAULT", t_fp32=1e-3, t_bf16=5e-3).fast


def test_this_cpu_answer_is_consistent():
    s = bf16_support("cpu")
    assert isinstance(s, Bf16Support) and s.ratio is not None and s.ratio > 0
    assert "\n" not in s.reason and f"{s.ratio:.2g}x" in s.reason
    has_flag = any(f in (precision.cpu_flags() or {}) for f in precision.BF16_FLAGS)
    assert s.fast == ((has_flag or precision.cpu_flags() is None) and s.ratio >= FAST_RATIO)
    assert bf16_support(torch.device("cpu")) is s  # measured once per process


def test_mps_is_not_claimed_fast():
    assert not bf16_support("mps").fast


def test_resolve_keeps_explicit_dtypes_and_a_recorded_auto():
    for d in ("fp32", "bf16", "fp16"):
        assert precision.resolve_dtype(d, "cpu")[0] == d
    here = "bf16" if bf16_support("cpu").fast else "fp32"
    other = "fp32" if here == "bf16" else "bf16"
    assert precision.resolve_dtype("auto", "cpu")[0] == here
    kept, why = precision.resolve_dtype("auto", "cpu", recorded=other)
    assert kept == other and "kept" in why and f"would pick {here}" in why


def test_config_accepts_auto_and_lists_the_valid_dtypes():
    assert TrainConfig(dtype="auto").dtype == "auto"
    assert TrainConfig().dtype == "fp32"  # the default is unchanged
    with pytest.raises(ConfigError) as e:
        TrainConfig(dtype="bf32")
    assert "dtype='bf32'" in str(e.value) and ", ".join(DTYPES) in str(e.value)
    # resolved before the model is sharded, so FSDP2's mixed precision follows it
    assert TrainConfig(dtype="auto", parallel="fsdp").dtype == "auto"


def test_auto_run_resolves_records_and_keeps_its_dtype(char_data, tmp_path, monkeypatch, caplog):
    data, out = char_data(4000), tmp_path / "run"
    here = "bf16" if bf16_support("cpu").fast else "fp32"
    log = logging.getLogger("llm_foundry.train.trainer")
    log.addHandler(caplog.handler)  # the CLI's tests may have stopped propagation to the root
    try:
        with caplog.at_level("INFO", logger="llm_foundry.train.trainer"):
            t = make_trainer(data, out, dtype="auto", max_steps=2, eval_interval=2)
    finally:
        log.removeHandler(caplog.handler)
    assert t.dtype == here and t.amp_dtype == (torch.bfloat16 if here == "bf16" else None)
    assert f"dtype auto -> {here}" in caplog.text
    t.run()
    info = json.loads((out / "run.json").read_text())
    assert info["dtype"] == here and info["train"]["dtype"] == "auto"
    # the machine "changes": resuming still trains on the recorded path, and says so
    flipped = Bf16Support(here == "fp32", "pretend machine")
    monkeypatch.setattr(precision, "bf16_support", lambda device: flipped)
    t = make_trainer(data, out, resume=True, dtype="auto", max_steps=3, eval_interval=2)
    assert t.dtype == here and "kept from the run's start" in t.dtype_reason
    t.release()
    assert json.loads((out / "run.json").read_text())["dtype"] == here
