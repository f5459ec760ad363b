"""``compare.png``: the picture of a ``clusterlm compare`` result (the content of compare.json).

:func:`compare_figure` draws it from the result dictionary alone, so a saved compare.json can be redrawn;
:func:`plot_compare` saves it. Four panels, at the first ratio unless said otherwise:

- *quality*: each method's held-out loss difference against random (and against full data when it ran) with its
  paired 95 % interval, as horizontal intervals around a line at 0, methods sorted by the difference, the better and
  worse sides labelled, the seeds behind every interval on its row and what the interval rests on (one seed: over
  the evaluation examples only, and the picture says so);
- *cost*: selection and training seconds stacked (bars from 0), the tokens trained written at the end of every bar;
- *frontier*: held-out loss with its 95 % interval against total seconds and against tokens trained, every method at
  every ratio.

No panel draws raw losses as bars: bars start at 0, and losses are points with intervals. Files written before the
differences or the frontier existed still draw (the differences without intervals, the frontier from the summary).
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from clusterlm.comparison.metrics import LOSS, lower_is_better

__all__ = ["compare_figure", "plot_compare"]

REFERENCES = ("random", "full")
_REF_STYLE = {"random": {"color": "tab:blue", "marker": "o"}, "full": {"color": "tab:red", "marker": "s"}}
BETTER = "\u2190 better (lower loss)"
WORSE = "worse (higher loss) \u2192"
ONE_SEED = "one seed: interval over evaluation examples only"


def plot_compare(result: dict[str, Any], path: Path) -> Path | None:
    """Save ``compare.png`` (:func:`compare_figure`) at ``path``; None when the result has no method."""
    fig = compare_figure(result)
    if fig is None:
        return None
    fig.savefig(path, dpi=110)
    return Path(path)


def compare_figure(result: dict[str, Any]) -> Any:
    """The ``compare.png`` figure (a matplotlib ``Figure``, made without pyplot: no backend or global state is
    touched; None when the summary is empty).

    Axes carry labels for tests and tools: ``quality``, ``cost``, ``frontier_seconds``, ``frontier_tokens``; every
    interval of the quality panel is a line with gid ``interval:<reference>:<method>``.
    """
    summary = result.get("summary") or {}
    if not summary:
        return None
    from matplotlib.figure import Figure

    order = _order(summary)
    n = len(order)
    top = max(3.6, 0.55 * n + 1.6)
    fig = Figure(figsize=(17, top + 5.6))
    grid = fig.add_gridspec(2, 2, height_ratios=[top, 5.0], width_ratios=[1.15, 1.0])
    ax_q, ax_c = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    ax_fs, ax_ft = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    for ax, label in ((ax_q, "quality"), (ax_c, "cost"), (ax_fs, "frontier_seconds"), (ax_ft, "frontier_tokens")):
        ax.set_label(label)
    n_eval = _n_eval(result)
    ratio = _ratio(result)
    view, what = decision_view(result)
    _quality_panel(ax_q, view, _order(view), n_eval, ratio, what)
    _cost_panel(ax_c, summary, order, ratio)
    points = _frontier_points(result)
    _frontier_panel(ax_fs, points, "total_s", "total seconds (selection + training, mean over seeds)",
                    "held-out loss vs time", legend=False)
    _frontier_panel(ax_ft, points, "tokens", "tokens trained (mean over seeds)",
                    "held-out loss vs tokens trained")
    fig.suptitle(_headline(result), fontsize=12)
    fig.text(0.5, 0.004, textwrap.fill(_footnote(result, summary, n_eval), 190), ha="center", va="bottom",
             fontsize=8.5)
    fig.tight_layout(rect=(0, 0.035, 1, 0.97))
    return fig


# --- reading the result -----------------------------------------------------------------------------------------


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _ratio(result: dict[str, Any]) -> float | None:
    r = (result.get("settings") or {}).get("ratio")
    return float(r) if _finite(r) else None


def _n_eval(result: dict[str, Any]) -> int | None:
    """Evaluation examples behind the primary loss: a method's ``n_eval``, its primary set's, the evaluation sets'
    ``evaluated``, or a record's (older files may hold none of them)."""
    for row in (result.get("summary") or {}).values():
        if _finite(row.get("n_eval")):
            return int(row["n_eval"])
        sets = row.get("eval_sets") or {}
        first = next(iter(sets.values()), None) if isinstance(sets, dict) else None
        if first and _finite(first.get("n_eval")):
            return int(first["n_eval"])
    metas = result.get("eval_sets") or []
    if metas and isinstance(metas[0], dict) and _finite(metas[0].get("evaluated")):
        return int(metas[0]["evaluated"])
    for rec in result.get("records") or []:
        if _finite(rec.get("n_eval")):
            return int(rec["n_eval"])
    return None


def _delta(summary: dict[str, Any], m: str, ref: str) -> tuple[float | None, list[float] | None, bool]:
    """``(difference, interval, recorded)`` of ``m`` against ``ref``: recorded False when the file predates the
    differences (then the difference of the mean losses, without an interval)."""
    row = summary[m]
    if f"delta_vs_{ref}" in row:
        d, ci = row.get(f"delta_vs_{ref}"), row.get(f"ci95_vs_{ref}")
        return (float(d) if _finite(d) else None), (list(ci) if ci and all(_finite(v) for v in ci) else None), True
    a, b = row.get("eval_loss"), summary[ref].get("eval_loss")
    return (float(a) - float(b) if _finite(a) and _finite(b) else None), None, False


def _order(summary: dict[str, Any]) -> list[str]:
    """Methods, best first: by the difference against random (else against full data), those without one last."""
    refs = [r for r in REFERENCES if r in summary]

    def key(m: str) -> tuple[int, float]:
        for ref in refs:
            d = 0.0 if m == ref else _delta(summary, m, ref)[0]
            if d is not None:
                return 0, d
        return 1, 0.0

    return sorted(summary, key=key)


def _seeds(row: dict[str, Any]) -> int:
    s = row.get("seeds")
    return int(s) if _finite(s) else 0


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _row_note(summary: dict[str, Any], m: str, refs: list[str]) -> str:
    """What the row's interval rests on: one seed (evaluation examples only), seeds only, or both."""
    row = summary[m]
    compared = [r for r in refs if r != m]
    if not compared:
        return "reference"
    kinds = {row.get(f"interval_vs_{r}") for r in compared} - {None}
    ref_seeds = {_seeds(summary[r]) for r in compared}
    if not kinds:
        return "no interval in this compare.json"
    if "seeds only" in kinds:
        return ("interval over seeds only (no per-example losses)" if _seeds(row) > 1
                else "one seed, no per-example losses: no interval")
    if _seeds(row) == 1 and ref_seeds == {1}:
        return ONE_SEED
    paired = all(row.get(f"paired_vs_{r}") for r in compared)
    if _seeds(row) == 1:
        refs_seeds = ", ".join(f"{r} {_seeds(summary[r])}" for r in compared)
        return f"one seed (reference seeds: {refs_seeds})"
    return "interval over seeds \u00d7 evaluation examples" + (", paired by seed" if paired else "")


# --- panels -----------------------------------------------------------------------------------------------------


def decision_view(result: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The summary the quality panel draws, and what it measures: the held-out loss, or the task metric the
    comparison decides by (``decide_by``), its differences turned so that left is better (reference - method for a
    metric where higher is better)."""
    summary, metric = result.get("summary") or {}, result.get("decide_by") or LOSS
    if metric == LOSS:
        return summary, "held-out loss"
    sign = 1.0 if lower_is_better(metric) else -1.0
    view = {}
    for m, row in summary.items():
        mrow = (row.get("metrics") or {}).get(metric) or {}
        new = {k: v for k, v in row.items() if "_vs_" not in k}
        new["eval_loss"] = None  # no loss fallback: a method without the metric shows none
        for ref in REFERENCES:
            if mrow.get(f"ci95_vs_{ref}") is not None:
                lo, hi = mrow[f"ci95_vs_{ref}"]
                new.update({f"delta_vs_{ref}": sign * mrow[f"delta_vs_{ref}"],
                            f"ci95_vs_{ref}": sorted([sign * lo, sign * hi]),
                            f"paired_vs_{ref}": mrow[f"paired_vs_{ref}"],
                            f"interval_vs_{ref}": mrow[f"interval_vs_{ref}"]})
        view[m] = new
    return view, metric if sign > 0 else f"{metric} (reference \u2212 method: higher is better)"


def _quality_panel(ax: Any, summary: dict[str, Any], order: list[str], n_eval: int | None,
                   ratio: float | None, what: str = "held-out loss") -> None:
    """Differences against random / full with their 95 % intervals, a line at 0, one row per method (``what``: the
    held-out loss or a task metric, :func:`decision_view`)."""
    from matplotlib.lines import Line2D
    from matplotlib.transforms import offset_copy

    refs = [r for r in REFERENCES if r in summary]
    y = np.arange(len(order))
    offsets = {r: (0.0 if len(refs) < 2 else (-0.16 if r == "random" else 0.16)) for r in refs}
    values, drawn = [0.0], []
    for i, m in enumerate(order):
        for ref in refs:
            if m == ref:
                continue
            d, ci, _recorded = _delta(summary, m, ref)
            yy = i + offsets[ref]
            style = _REF_STYLE[ref]
            if d is None:
                ax.text(0, yy, f"  no {what.split(' (')[0]}", va="center", fontsize=8, color="grey",
                        gid=f"missing:{ref}:{m}")
                continue
            drawn += [ref] if ref not in drawn else []
            values.append(d)
            if ci is not None:
                values += ci
                ax.plot(ci, [yy, yy], color=style["color"], lw=2.2, marker="|", markersize=10,
                        solid_capstyle="butt", gid=f"interval:{ref}:{m}")
            excludes_zero = ci is not None and (ci[0] > 0 or ci[1] < 0)
            ax.plot([d], [yy], linestyle="none", marker=style["marker"], markersize=7, color=style["color"],
                    markerfacecolor=style["color"] if excludes_zero else "white", gid=f"delta:{ref}:{m}")
        if m in refs and not [r for r in refs if r != m]:
            ax.plot([0], [i], linestyle="none", marker="D", color="black", markersize=6, gid=f"reference:{m}")
            ax.annotate("reference", (0, i), textcoords="offset points", xytext=(6, 0), va="center", fontsize=8)
    lo, hi = min(values), max(values)
    pad = max(hi - lo, 1e-4) * 0.1
    ax.set_xlim(lo - pad, hi + pad)
    ax.axvline(0, color="black", lw=1, gid="zero")
    ax.axvspan(lo - pad, 0, color="tab:green", alpha=0.05, lw=0)
    ax.axvspan(0, hi + pad, color="tab:red", alpha=0.05, lw=0)
    ax.set_yticks(y, [f"{m}\n{_plural(_seeds(summary[m]), 'seed')}" for m in order], fontsize=8.5)
    ax.set_ylim(len(order) - 0.5, -0.5)  # best on top
    notes = [_row_note(summary, m, refs) for m in order]
    common = set(notes) - {"reference"}
    one_note = len(common) == 1
    recorded = any(f"delta_vs_{r}" in row for row in summary.values() for r in refs)
    xlabel = (f"{what} difference: method \u2212 reference" if what == "held-out loss" else f"{what} difference") + (
        " (95 % interval)" if recorded else "")
    if one_note:  # one note for every row: said once, under the axis
        xlabel += f"\n{common.pop()}"
    else:
        right = ax.secondary_yaxis("right")
        right.set_yticks(y, ["" if n == "reference" else n for n in notes], fontsize=7.5, color="dimgrey")
        right.tick_params(length=0)
    ax.set_xlabel(xlabel)
    ax.text(0.0, 1.005, BETTER, transform=ax.transAxes, ha="left", va="bottom", fontsize=9, color="darkgreen")
    ax.text(1.0, 1.005, WORSE, transform=ax.transAxes, ha="right", va="bottom", fontsize=9, color="darkred")
    at = f" at ratio {ratio:g}" if ratio is not None else ""
    on = f", {n_eval} evaluation examples" if n_eval else ""
    ax.set_title(f"{what.split(' (')[0]} vs {' and vs '.join(refs) or 'a reference'}{at}{on}", pad=18, fontsize=10.5)
    ax.grid(axis="x", alpha=0.3)
    if drawn:
        handles = [Line2D([], [], linestyle="none", label=f"vs {r}", **_REF_STYLE[r]) for r in drawn]
        handles.append(Line2D([], [], linestyle="none", marker="o", color="grey", markerfacecolor="white",
                              label="hollow: interval includes 0 (or none)"))
        below = offset_copy(ax.transAxes, fig=ax.figure, y=-(30 if not one_note else 42), units="points")
        ax.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0.0), bbox_transform=below,
                  ncol=len(handles), frameon=False, borderaxespad=0, handletextpad=0.2, columnspacing=1.0)
    if not refs:
        ax.text(0.5, 0.5, "no random or full run to compare with", transform=ax.transAxes, ha="center")


def _cost_panel(ax: Any, summary: dict[str, Any], order: list[str], ratio: float | None) -> None:
    """Selection and training seconds stacked horizontally from 0, tokens trained written at every bar's end."""
    y = np.arange(len(order))
    sel = np.array([_num(summary[m].get("selection_s")) for m in order])
    tr = np.array([_num(summary[m].get("train_s")) for m in order])
    ax.barh(y, sel, color="tab:orange", label="selection", height=0.6)
    ax.barh(y, tr, left=sel, color="tab:blue", label="training", height=0.6)
    total = sel + tr
    for i, m in enumerate(order):
        tokens = summary[m].get("tokens")
        text = f" {total[i]:.1f} s" + (f" \u00b7 {_tokens(tokens)} tokens" if _finite(tokens) else "")
        ax.text(total[i], i, text, va="center", fontsize=8, gid=f"cost:{m}")
    top = float(total.max()) if len(total) and total.max() > 0 else 1.0
    ax.set_xlim(0, top * 1.45)
    ax.set_yticks(y, order, fontsize=8.5)
    ax.set_ylim(len(order) - 0.5, -0.5)
    ax.set_xlabel("seconds (mean over seeds); label: total seconds \u00b7 tokens trained")
    at = f" at ratio {ratio:g}" if ratio is not None else ""
    ax.set_title(f"cost{at}: selection + training time, tokens trained", pad=18, fontsize=10.5)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False, borderaxespad=0.1)
    ax.grid(axis="x", alpha=0.3)


def _frontier_points(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The result's frontier; for older files, one point per method and ratio from the summaries (the loss's
    interval from the primary evaluation set where recorded)."""
    if result.get("frontier"):
        return list(result["frontier"])
    by_ratio = result.get("summary_by_ratio") or {}
    if not by_ratio:
        by_ratio = {f"{_ratio(result) or float('nan'):g}": result.get("summary") or {}}
    points, full_done = [], False
    for key, summary in by_ratio.items():
        for m, row in summary.items():
            if m == "full" and full_done:
                continue
            full_done |= m == "full"
            sets = row.get("eval_sets") or {}
            first = next(iter(sets.values()), {}) if isinstance(sets, dict) else {}
            try:
                ratio = 1.0 if m == "full" else float(key)
            except ValueError:
                ratio = float("nan")
            points.append({"ratio": ratio, "method": m, "seeds": row.get("seeds"), "tokens": row.get("tokens"),
                           "total_s": row.get("total_s"), "eval_loss": row.get("eval_loss"),
                           "ci95": first.get("ci95")})
    return points


def _frontier_panel(ax: Any, points: list[dict[str, Any]], x_key: str, xlabel: str, title: str,
                    legend: bool = True) -> None:
    """Held-out loss (95 % interval) against ``x_key``, one line per method over its ratios, full data a star."""
    methods = list(dict.fromkeys(p["method"] for p in points))
    ratios = sorted({p["ratio"] for p in points if _finite(p.get("ratio")) and p["method"] != "full"})
    any_ci, xs = False, []
    for i, m in enumerate(methods):
        ps = sorted((p for p in points if p["method"] == m and _finite(p.get(x_key)) and _finite(p.get("eval_loss"))),
                    key=lambda p: p["ratio"] if _finite(p.get("ratio")) else 0.0)
        if not ps:
            continue
        x = np.array([float(p[x_key]) for p in ps])
        xs += x.tolist()
        yv = np.array([float(p["eval_loss"]) for p in ps])
        err = np.array([[max(p["eval_loss"] - p["ci95"][0], 0.0), max(p["ci95"][1] - p["eval_loss"], 0.0)]
                        if p.get("ci95") and all(_finite(v) for v in p["ci95"]) else [np.nan, np.nan] for p in ps]).T
        has_ci = bool(np.isfinite(err).any())  # no zero-length bars where no interval was recorded
        any_ci |= has_ci
        seeds = sorted({int(p["seeds"]) for p in ps if _finite(p.get("seeds"))})
        label = m + (f" ({_seed_range(seeds)})" if seeds else "")
        style = ({"marker": "*", "markersize": 14, "color": "black"} if m == "full"
                 else {"marker": "o", "markersize": 5, "color": f"C{i % 10}"})
        bars = ax.errorbar(x, yv, yerr=err if has_ci else None, capsize=3, label=label,
                           linestyle="-" if len(ps) > 1 else "none", **style)
        bars.lines[0].set_gid(f"frontier:{m}")
        if m != "full" and len(ratios) > 1:
            for p, xi, yi in zip(ps, x, yv, strict=True):
                ax.annotate(f"{p['ratio']:g}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    log = _x_scale(ax, xs, x_key)
    ax.set_xlabel(xlabel + (", log scale" if log else ""))
    ax.set_ylabel("held-out answer loss (lower is better)")
    per = f" at ratios {', '.join(f'{r:g}' for r in ratios)}" if len(ratios) > 1 else ""
    ax.set_title(f"{title}{per}" + (" (95 % intervals)" if any_ci else " (no intervals recorded)"), fontsize=10.5)
    ax.grid(alpha=0.3)
    if points and legend:  # one legend, outside, for both frontier panels (same colours)
        ax.legend(fontsize=7.5, title="method (seeds)" + ("\npoint labels: ratio" if per else ""), title_fontsize=7.5,
                  loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    if not points:
        ax.text(0.5, 0.5, "no frontier in this compare.json", transform=ax.transAxes, ha="center")


# --- text -------------------------------------------------------------------------------------------------------


def _headline(result: dict[str, Any]) -> str:
    st = result.get("settings") or {}
    seeds = result.get("seeds")
    n_seeds = len(seeds) if isinstance(seeds, (list, tuple)) else seeds
    ratios = st.get("ratios") or result.get("ratios") or ([st["ratio"]] if "ratio" in st else [])
    parts = [f"model {st['model']}" if st.get("model") else "",
             f"ratio{'s' if len(ratios) > 1 else ''} {', '.join(f'{r:g}' for r in ratios)}" if ratios else "",
             f"world size {st['world_size']}" if st.get("world_size") else "",
             _plural(int(n_seeds), "seed") if _finite(n_seeds) else ""]
    return "clusterlm compare: " + ", ".join(p for p in parts if p)


def _footnote(result: dict[str, Any], summary: dict[str, Any], n_eval: int | None) -> str:
    """How the intervals were made, with the seeds and evaluation examples behind them."""
    seeds = sorted({_seeds(r) for r in summary.values()})
    on = f"{n_eval} evaluation examples" if n_eval else "the evaluation examples"
    if not any("delta_vs_random" in r or "delta_vs_full" in r for r in summary.values()):
        return (f"This compare.json predates the intervals: differences are of the mean losses over "
                f"{_seed_range(seeds)} per method, without intervals.")
    text = (f"95 % intervals: bootstrap over seeds ({_seed_range(seeds)} per method) and {on}, paired by seed where "
            "methods ran the same seeds.")
    text += (" The bottom panels' intervals are each loss's own: they hold the evaluation sample's chance, which "
             "cancels in the paired differences (top left), so overlapping there does not mean indistinguishable.")
    if 1 in seeds:
        text += (" With one seed (on both sides) an interval is over the evaluation examples only: the training seed's "
                 "chance is not in it; run --seeds 2 or more.")
    return text


def _seed_range(seeds: list[int]) -> str:
    if not seeds:
        return "seeds unknown"
    if len(seeds) == 1:
        return _plural(seeds[0], "seed")
    return f"{seeds[0]}-{seeds[-1]} seeds"


def _num(x: Any) -> float:
    return float(x) if _finite(x) else 0.0


def _tokens(n: float) -> str:
    """``699115`` -> ``699k``; ``2096438`` -> ``2.10M``."""
    if abs(n) >= 1e6:
        return f"{n / 1e6:.2f}M"
    if abs(n) >= 1e4:
        return f"{n / 1e3:.0f}k"
    if abs(n) >= 1e3:
        return f"{n / 1e3:.1f}k"
    return f"{n:.0f}"


def _x_scale(ax: Any, xs: list[float], x_key: str) -> bool:
    """A log axis when the costs span more than 4x (full data beside small subsets), ticks as plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fmt = FuncFormatter(lambda v, _pos: _tokens(v) if x_key == "tokens" else f"{v:g}")
    positive = [x for x in xs if x > 0]
    if positive and max(positive) > 4 * min(positive):
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.xaxis.set_major_formatter(fmt)
    return ax.get_xscale() == "log"
