"""The ablation plots can be read: extrapolation.png labels its log perplexity axis across the
range the curves span, and val_loss.png shows every evaluation (a short run whole; a long run's
zoom marks the early points above it on its top edge)."""

from __future__ import annotations

import math

import pytest

from llm_foundry.ablation import report as R


def drawn_axes(monkeypatch) -> list:
    """The axes each plot function saves, captured after the figure is drawn (its labels set)."""
    axes = []
    finish = R._finish

    def keep(fig, ax, png):
        finish(fig, ax, png)
        axes.append(ax)

    monkeypatch.setattr(R, "_finish", keep)
    return axes


def study(**kw) -> dict:
    return dict(name="s", seeds=1, target_loss=None, **kw)


def test_log_ticks_label_a_narrow_range_between_its_ends():
    ticks = R.log_ticks(13.1, 29.6)
    assert 5 <= len(ticks) <= 6 and ticks == sorted(ticks)
    assert ticks[0] == 13 and ticks[-1] == 30
    assert sum(13 <= t <= 17 for t in ticks) >= 2  # where four of the five curves lay
    wide = R.log_ticks(5.8, 3000)
    assert wide[0] == 5.8 and wide[-1] == 3000
    ratios = [b / a for a, b in zip(wide, wide[1:], strict=False)]
    assert max(ratios) / min(ratios) < 1.3  # evenly spread in log
    assert R.log_ticks(20, 20) == [20]


def test_extrapolation_plot_labels_the_perplexities_and_contexts(tmp_path, monkeypatch):
    axes = drawn_axes(monkeypatch)
    ppl = {"a": [13.2, 13.1, 13.1, 13.0], "b": [14.3, 14.5, 14.8, 15.1], "c": [29.6] * 4}
    rows = [dict(variant=k, extrapolation=[dict(factor=2**i, context=64 * 2**i, loss=math.log(p),
                                                ppl=p) for i, p in enumerate(v)])
            for k, v in ppl.items()]  # fmt: skip
    rows.append(dict(variant="d", diverged=[], verdict="diverged at step 3"))  # left out
    R.plot_extrapolation(dict(study=study(), rows=rows), tmp_path / "e.png")
    ax = axes[0]
    low, high = ax.get_ylim()
    labels = {float(t.get_text()): t.get_position()[1] for t in ax.get_yticklabels()}
    inside = [v for v in labels if low <= v <= high]
    assert len(inside) >= 5 and any(13 < v < 17 for v in inside), labels
    assert [t.get_text() for t in ax.get_xticklabels()] == ["64", "128", "256", "512"]
    assert len(ax.get_lines()) == 4  # three curves and the training context


def curve(values, every=100):
    return [[every * (i + 1), v] for i, v in enumerate(values)]


def val_report(curves: dict) -> dict:
    runs = {k: [dict(val_curve=curve(v))] for k, v in curves.items()}
    rows = [dict(variant=k, val_loss=v[-1], best_val_loss=min(v)) for k, v in curves.items()]
    return dict(study=study(), runs=runs, rows=rows)


def test_a_short_runs_curves_are_shown_whole(tmp_path, monkeypatch):
    axes = drawn_axes(monkeypatch)
    R.plot_val_curves(val_report({"a": [3.83, 3.39, 2.93], "b": [3.8, 3.2, 2.83]}),
                      tmp_path / "v.png")  # fmt: skip
    low, high = axes[0].get_ylim()
    assert low < 2.83 and high > 3.83  # the first evaluations (the audit's 3.8) are in view


def test_a_long_runs_zoom_marks_the_points_above_it(tmp_path, monkeypatch):
    axes = drawn_axes(monkeypatch)
    a = [4.2, 2.9] + [2.2 - 0.02 * i for i in range(18)]
    b = [4.1, 2.8] + [2.1 - 0.02 * i for i in range(18)]
    R.plot_val_curves(val_report({"a": a, "b": b}), tmp_path / "v.png")
    ax = axes[0]
    low, high = ax.get_ylim()
    assert high == pytest.approx(a[-1] + 0.6) and low == pytest.approx(b[-1] - 0.1)
    marks = [ln for ln in ax.get_lines() if ln.get_marker() == "^" and len(ln.get_xdata())]
    marked = sorted((float(ln.get_xdata()[0]), float(ln.get_ydata()[0])) for ln in marks)
    # each point above the top (steps 100 and 200 of both: 4.2, 4.1, 2.9, 2.8) on the edge
    assert marked == [(100, high), (100, high), (200, high), (200, high)]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert f"above {high:.2f} (up to 4.20)" in legend


def test_zoom_leaves_the_whole_range_when_it_would_hide_many_points():
    assert R.zoom([3.8, 3.4, 2.9], [2.9]) is None  # 1 of 3 above 3.5
    assert R.zoom([4.0] + [2.0] * 9, [2.0]) == pytest.approx((1.9, 2.6))
    assert R.zoom([3.0, float("nan")], []) is None  # no final loss: every variant diverged
