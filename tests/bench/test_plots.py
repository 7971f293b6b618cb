"""The loss plots of ``dips bench compare`` stay readable when a method diverges (issue 15).

A diverged method (a loss above its first evaluation, or not finite) is drawn but never sets
the y-range: the axes span every converging curve, exclude the diverged losses, and an
annotation at the diverged curve's last in-range point gives its final loss.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from matplotlib.text import Annotation

from dips.bench.plots import diverged, loss_figure, loss_range, plot_compare
from dips.emu.result import CurvePoint, MethodResult

pytestmark = pytest.mark.timeout(120)

INITIAL = 7.63
PNG = b"\x89PNG\r\n\x1a\n"


def _result(method: str, losses: list[float]) -> MethodResult:
    curve = [CurvePoint(time_s=70.0 * i, tokens=65_536 * i, eval_loss=v)
             for i, v in enumerate(losses)]
    return MethodResult(method=method, mode="virtual", time_s=curve[-1].time_s,
                        tokens=curve[-1].tokens, tokens_accepted=curve[-1].tokens, comm_s=1.0,
                        updates_pushed=10, updates_accepted=10, updates_rejected=0,
                        final_eval_loss=losses[-1], tokens_per_s=900.0, curve=curve)


CONVERGING = {
    "diloco": [INITIAL, 6.4, 5.9, 5.5, 5.2, 5.18],
    "di-ps": [INITIAL, 6.3, 5.7, 5.3, 5.0, 4.99],
    "dp": [INITIAL, 6.1, 5.4, 5.0, 4.7, 4.54],
}
NO_CLIP = [INITIAL, 6.5, 6.2, 6.9, 350.0, 1040.0, 11_719.0]  # the η = 100 blow-up


def _results() -> list[MethodResult]:
    return [*(_result(m, v) for m, v in CONVERGING.items()), _result("di-ps-no-clip", NO_CLIP)]


def _annotations(ax) -> list[Annotation]:
    return [t for t in ax.texts if isinstance(t, Annotation)]


def test_diverged_is_ending_above_the_first_evaluation_or_a_non_finite_loss():
    for losses in CONVERGING.values():
        assert not diverged(_result("m", losses))
    assert diverged(_result("m", NO_CLIP))
    assert diverged(_result("m", [INITIAL, 6.0, float("nan")]))
    assert diverged(_result("m", [INITIAL, 6.0, math.inf]))
    assert diverged(_result("m", [INITIAL, 6.0, INITIAL + 0.01]))  # ends above the start
    assert not diverged(_result("m", [INITIAL, INITIAL + 0.01, 5.0]))  # a spike it recovered from
    assert not diverged(_result("m", [INITIAL]))


@pytest.mark.parametrize("key", ["tokens", "time_s"])
def test_range_comes_from_the_converging_methods_and_the_diverged_one_is_annotated(key):
    fig = loss_figure(_results(), key, key, "eta100")
    try:
        ax = fig.axes[0]
        lo, hi = ax.get_ylim()
        converging = [v for losses in CONVERGING.values() for v in losses]
        assert lo <= min(converging) and hi >= max(converging)  # every converging curve shows
        assert hi < 350.0  # the diverged losses do not set the axis
        assert hi - lo < 2 * (max(converging) - min(converging))  # nor stretch it
        notes = _annotations(ax)
        assert len(notes) == 1
        note = notes[0]
        assert "di-ps-no-clip" in note.get_text() and "11,719" in note.get_text()
        last_in_range = 3  # 6.9: after it the curve never comes back
        point = _result("di-ps-no-clip", NO_CLIP).curve[last_in_range]
        assert note.xy == (getattr(point, key), NO_CLIP[last_in_range])
        labels = ax.get_legend_handles_labels()[1]
        assert "di-ps-no-clip (diverged)" in labels
        assert {"diloco", "di-ps", "dp"} <= set(labels)
    finally:
        plt.close(fig)


def test_a_non_finite_loss_is_annotated_and_ignored_by_the_range():
    results = [_result("di-ps", CONVERGING["di-ps"]),
               _result("di-ps-no-clip", [INITIAL, 6.8, float("nan")])]
    assert loss_range(results) == pytest.approx(
        (4.99 - 0.05 * (INITIAL - 4.99), INITIAL + 0.05 * (INITIAL - 4.99)))
    fig = loss_figure(results, "tokens", "tokens", "t")
    try:
        ax = fig.axes[0]
        assert ax.get_ylim() == pytest.approx(loss_range(results))
        (note,) = _annotations(ax)
        assert "nan" in note.get_text() and note.xy == (65_536, 6.8)
    finally:
        plt.close(fig)


def test_without_a_diverged_method_there_is_no_annotation():
    results = [_result(m, v) for m, v in CONVERGING.items()]
    fig = loss_figure(results, "tokens", "tokens", "t")
    try:
        assert _annotations(fig.axes[0]) == []
    finally:
        plt.close(fig)


def test_every_method_diverged_still_plots():
    results = [_result("a", NO_CLIP), _result("b", [INITIAL, float("inf")])]
    assert loss_range(results) is None
    fig = loss_figure(results, "time_s", "s", "t")
    try:
        assert len(_annotations(fig.axes[0])) == 2
    finally:
        plt.close(fig)


def test_plot_compare_writes_the_pngs(tmp_path: Path):
    names = plot_compare(_results(), tmp_path, "eta100")
    assert names == ["loss_vs_tokens.png", "loss_vs_time.png", "throughput.png"]
    for name in names:
        assert (tmp_path / name).read_bytes()[:8] == PNG
