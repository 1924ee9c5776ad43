"""Learning-rate schedules: warmup, end points, shapes."""

import pytest

from llm_foundry.config import ConfigError
from llm_foundry.train import schedule
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.schedule import SCHEDULES, lr_at


def cfg(**kw):
    return TrainConfig(**{**dict(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110), **kw})


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_warmup_is_linear_from_zero(schedule):
    c = cfg(schedule=schedule)
    assert lr_at(0, c) == pytest.approx(1e-4)
    assert lr_at(4, c) == pytest.approx(5e-4)
    assert lr_at(9, c) == pytest.approx(1e-3)


def test_cosine_end_points_and_midpoint():
    c = cfg(schedule="cosine")
    assert lr_at(10, c) == pytest.approx(1e-3)
    assert lr_at(60, c) == pytest.approx(1e-4 + 0.5 * 9e-4)
    assert lr_at(110, c) == pytest.approx(1e-4)
    assert lr_at(500, c) == pytest.approx(1e-4)  # past the end: stays at the floor
    lrs = [lr_at(s, c) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))  # monotone decay


def test_linear_and_constant():
    assert lr_at(60, cfg(schedule="linear")) == pytest.approx(5.5e-4)
    assert lr_at(100, cfg(schedule="constant")) == pytest.approx(1e-3)


def test_warmup_stable_decay():
    c = cfg(schedule="wsd", decay_frac=0.2)  # decay over the last 22 of 110 steps (88..109)
    assert lr_at(87, c) == pytest.approx(1e-3)
    assert lr_at(88, c) == pytest.approx(1e-3 + (1e-4 - 1e-3) / 22)  # the first already lower
    assert lr_at(98, c) == pytest.approx(1e-3 + 0.5 * (1e-4 - 1e-3))
    assert lr_at(109, c) == pytest.approx(1e-4)  # the last step trains at min_lr
    assert lr_at(110, c) == pytest.approx(1e-4)
    # a fraction under one step still decays (over one step): 0.1 of 9 steps (0..8)
    short = cfg(schedule="wsd", decay_frac=0.1, warmup_steps=0, max_steps=9)
    assert [lr_at(s, short) for s in (7, 8)] == pytest.approx([1e-3, 1e-4])


def test_no_warmup():
    assert lr_at(0, cfg(warmup_steps=0, schedule="cosine")) == pytest.approx(1e-3)
    assert lr_at(0, cfg(warmup_steps=0, max_steps=1)) == pytest.approx(1e-3)  # one step: peak


def test_invalid_train_config_messages():
    with pytest.raises(ConfigError) as e:
        TrainConfig(schedule="step", dtype="fp4", batch_size=0, min_lr=1.0)
    msg = str(e.value)
    assert "schedule='step' is not one of cosine, linear, constant, wsd" in msg
    assert "dtype='fp4' is not one of fp32, bf16, fp16, fp8, auto" in msg
    assert "batch_size=0 must be a positive integer" in msg
    assert "min_lr=1.0 must be a number in [0, lr=0.001]" in msg
    with pytest.raises(ConfigError, match="did you mean 'max_steps'"):
        TrainConfig.from_dict({"max_step": 3})


def test_the_config_accepts_exactly_the_registered_schedules(monkeypatch):
    """One list of schedule names, the registry: a schedule added to it is a valid setting and
    runs, with no edit to TrainConfig."""
    assert "step" not in SCHEDULES
    with pytest.raises(ConfigError, match=f"is not one of {', '.join(SCHEDULES)}"):
        cfg(schedule="step")
    monkeypatch.setitem(schedule.SCHEDULES, "step", lambda step, c: c.lr / 2)
    assert lr_at(50, cfg(schedule="step")) == pytest.approx(5e-4)
