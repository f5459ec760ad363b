"""compare.png: the drawn content, read back from matplotlib's objects (not just that a file exists).

The fixture ``fixtures/compare_fixture.json`` is a compare.json made by
:func:`clusterlm.comparison.statistics.summarize` and
:func:`clusterlm.comparison.statistics.frontier` from synthetic records (5 methods with full data, ratios 0.2 and 0.31,
3 seeds,
40 evaluation examples).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from matplotlib.patches import Rectangle
from matplotlib.text import Text

from clusterlm.comparison.plot import BETTER, ONE_SEED, WORSE, compare_figure, plot_compare

FIXTURE = Path(__file__).parent / "fixtures" / "compare_fixture.json"


@pytest.fixture
def result() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


def _axes(fig: Any) -> dict[str, Any]:
    return {ax.get_label(): ax for ax in fig.axes if ax.get_label()}


def _texts(fig: Any) -> list[str]:
    """Every string drawn on the figure (titles, labels, tick labels, annotations, legends)."""
    fig.draw_without_rendering()
    return [t.get_text() for t in fig.findobj(Text) if t.get_text()]


def _gids(ax: Any, prefix: str) -> list[str]:
    return [a.get_gid() for a in ax.get_children() if (a.get_gid() or "").startswith(prefix)]


def _frontier(ax: Any) -> dict[str, Any]:
    """The error-bar containers of a frontier panel by method (their data line's gid ``frontier:<method>``)."""
    return {c.lines[0].get_gid().removeprefix("frontier:"): c for c in ax.containers}


def _bars(ax: Any) -> list[Rectangle]:
    """The bar patches of an axes (axvspan bands excluded: they carry no bar gid and span the whole height)."""
    return [p for p in ax.patches if isinstance(p, Rectangle) and p.get_gid() is None and p.get_height() < 1.0]


def test_quality_panel_draws_one_interval_per_method_against_each_reference(result: dict[str, Any]) -> None:
    fig = compare_figure(result)
    ax = _axes(fig)["quality"]
    summary = result["summary"]
    others = [m for m in summary if m != "random"]
    assert sorted(_gids(ax, "interval:random:")) == sorted(f"interval:random:{m}" for m in others)
    assert sorted(_gids(ax, "interval:full:")) == sorted(f"interval:full:{m}" for m in summary if m != "full")
    lo, hi = ax.get_xlim()
    for m in others:  # every interval inside the axis, and 0 too
        line = next(a for a in ax.lines if a.get_gid() == f"interval:random:{m}")
        assert list(line.get_xdata()) == pytest.approx(summary[m]["ci95_vs_random"])
        assert lo <= min(line.get_xdata()) and max(line.get_xdata()) <= hi
    assert lo < 0 < hi
    zero = next(a for a in ax.lines if a.get_gid() == "zero")
    assert list(zero.get_xdata()) == [0, 0]
    texts = _texts(fig)
    assert BETTER in texts and WORSE in texts


def test_methods_sorted_by_difference_with_seeds_on_the_rows(result: dict[str, Any]) -> None:
    fig = compare_figure(result)
    fig.draw_without_rendering()
    ax = _axes(fig)["quality"]
    rows = [t.get_text().split("\n") for t in ax.get_yticklabels()]
    names = [r[0] for r in rows]
    deltas = [result["summary"][m]["delta_vs_random"] for m in names]
    assert deltas == sorted(deltas) and set(names) == set(result["summary"])
    assert all(r[1] == "3 seeds" for r in rows)
    assert any("40 evaluation examples" in t for t in _texts(fig))  # n_eval from the evaluation sets' meta
    assert any("paired by seed" in t for t in _texts(fig))


def test_no_bar_axis_starts_above_zero(result: dict[str, Any]) -> None:
    fig = compare_figure(result)
    for name, ax in _axes(fig).items():
        for bar in _bars(ax):
            assert ax.get_xlim()[0] <= min(bar.get_x(), bar.get_x() + bar.get_width()), name
    cost = _axes(fig)["cost"]
    assert cost.get_xlim()[0] == 0
    assert len(_bars(cost)) == 2 * len(result["summary"])  # selection and training stacked, per method
    assert not _bars(_axes(fig)["quality"])  # the losses are intervals, never bars


def test_cost_panel_writes_seconds_and_tokens_per_method(result: dict[str, Any]) -> None:
    fig = compare_figure(result)
    ax = _axes(fig)["cost"]
    labels = {t.get_gid(): t.get_text() for t in ax.texts if t.get_gid()}
    assert set(labels) == {f"cost:{m}" for m in result["summary"]}
    assert "40k tokens" in labels["cost:full"] and " s " in labels["cost:full"]


def test_frontier_panels_every_method_and_ratio_with_intervals(result: dict[str, Any]) -> None:
    fig = compare_figure(result)
    axes = _axes(fig)
    methods = list(dict.fromkeys(p["method"] for p in result["frontier"]))
    for name, key in (("frontier_seconds", "total_s"), ("frontier_tokens", "tokens")):
        ax = axes[name]
        assert sorted(_frontier(ax)) == sorted(methods)
        random = _frontier(ax)["random"]
        line = random.lines[0]
        points = sorted((p for p in result["frontier"] if p["method"] == "random"), key=lambda p: p["ratio"])
        assert list(line.get_xdata()) == pytest.approx([p[key] for p in points])
        assert list(line.get_ydata()) == pytest.approx([p["eval_loss"] for p in points])
        assert random.has_yerr
        assert {"0.2", "0.31"} <= {t.get_text() for t in ax.texts}  # the ratio of every point
    assert "held-out loss vs tokens trained" in axes["frontier_tokens"].get_title()


def test_one_seed_says_the_interval_is_over_evaluation_examples_only(result: dict[str, Any]) -> None:
    one = copy.deepcopy(result)
    for row in one["summary"].values():
        row["seeds"] = 1
    fig = compare_figure(one)
    texts = _texts(fig)
    assert any(ONE_SEED in t for t in texts)
    ax = _axes(fig)["quality"]
    assert all(t.get_text().endswith("1 seed") for t in ax.get_yticklabels())
    assert len(_gids(ax, "interval:random:")) == len(one["summary"]) - 1


def test_without_full_and_a_method_without_interval(result: dict[str, Any]) -> None:
    res = copy.deepcopy(result)
    summary = {m: row for m, row in res["summary"].items() if m != "full"}
    for row in summary.values():
        for k in [k for k in row if k.endswith("_vs_full")]:
            del row[k]
    summary["ifd"].update(delta_vs_random=None, ci95_vs_random=None)  # a run without a finite loss
    summary["longest"]["ci95_vs_random"] = None  # a difference without its interval
    res["summary"] = summary
    res["frontier"] = [p for p in res["frontier"] if p["method"] != "full"]
    fig = compare_figure(res)
    ax = _axes(fig)["quality"]
    assert sorted(_gids(ax, "interval:")) == ["interval:random:cluster"]
    assert _gids(ax, "delta:random:longest") and not _gids(ax, "delta:random:ifd")
    assert _gids(ax, "missing:random:ifd") and _gids(ax, "reference:random")
    assert "vs full" not in ax.get_title()
    assert "full" not in _frontier(_axes(fig)["frontier_tokens"])


def test_old_compare_json_without_differences_or_frontier() -> None:
    row = {"seeds": 3, "fraction": 0.31, "selection_s": 1.0, "train_s": 100.0, "total_s": 101.0, "eval_loss": 4.7,
           "eval_loss_std": 0.01, "tokens": 7e5}
    old = {"settings": {"model": "m", "ratio": 0.31, "world_size": 2}, "seeds": [0, 1, 2],
           "summary": {"random": row, "cluster": {**row, "eval_loss": 4.69, "selection_s": 8.0},
                       "full": {**row, "eval_loss": 4.2, "tokens": 2.1e6, "train_s": 478.0}}}
    fig = compare_figure(old)
    axes = _axes(fig)
    assert not _gids(axes["quality"], "interval:")  # nothing to draw an interval from
    delta = next(a for a in axes["quality"].lines if a.get_gid() == "delta:random:cluster")
    assert list(delta.get_xdata()) == pytest.approx([-0.01])
    assert any("predates the intervals" in t for t in _texts(fig))
    assert sorted(_frontier(axes["frontier_tokens"])) == ["cluster", "full", "random"]  # from the summary
    assert not any(c.has_yerr for c in _frontier(axes["frontier_tokens"]).values())  # no zero-length error bars
    assert "no intervals recorded" in axes["frontier_tokens"].get_title()


def test_plot_compare_writes_png(result: dict[str, Any], tmp_path: Path) -> None:
    out = plot_compare(result, tmp_path / "compare.png")
    assert out == tmp_path / "compare.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_compare({"summary": {}, "settings": {}}, tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
