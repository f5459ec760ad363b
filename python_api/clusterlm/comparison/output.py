"""The outputs of a comparison: :class:`CompareResult` (what compare.json holds), its markdown (compare.md) and the
assembly of both from the unit records.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clusterlm.comparison.evaluation import eval_set_tables, without_examples
from clusterlm.comparison.metrics import (
    LOSS,
    decided_metric,
    metric_rows,
    metric_verdicts,
    task_metric_names,
)
from clusterlm.comparison.statistics import TOKEN_MATCH, frontier, goals, per_token, summarize, verdicts
from clusterlm.config.comparison import CLUSTER_METHODS, parse_method

__all__ = ["FEATURES", "CompareResult", "budget_line", "build_result", "equal_tokens_lines", "markdown_table"]

FEATURES = "features"  # OUT/features/<key>: feature stores shared by the cluster units with the same feature settings


@dataclass(frozen=True)
class CompareResult:
    """A comparison's outcome: the content of compare.json, with its parts as attributes.

    Attributes:
        summary: per method at the first ratio: means and stds over seeds (selection / training / total seconds,
            held-out loss, tokens trained), the differences to random and to full data with their 95 % intervals.
        summary_by_ratio: the same per ratio (``"0.31"`` -> summary).
        frontier: cost and quality of every (ratio, method): tokens, seconds, held-out loss with its interval.
        verdicts: one ``verdict:`` line per method at the first ratio (plain words, as compare.md has them).
        settings / methods / seeds / ratios: what ran.
        records: every unit (method, seed, ratio) without its per-example losses (those are in eval_losses.json).
        data: the whole compare.json content.
    """

    data: dict[str, Any] = field(repr=False)

    @property
    def summary(self) -> dict[str, dict[str, Any]]:
        return self.data["summary"]

    @property
    def summary_by_ratio(self) -> dict[str, dict[str, dict[str, Any]]]:
        return self.data["summary_by_ratio"]

    @property
    def frontier(self) -> list[dict[str, Any]]:
        return self.data["frontier"]

    @property
    def verdicts(self) -> list[str]:
        return decision_verdicts(self.summary, self.data.get("decide_by", LOSS))

    @property
    def settings(self) -> dict[str, Any]:
        return self.data["settings"]

    @property
    def methods(self) -> list[str]:
        return list(self.data["methods"])

    @property
    def seeds(self) -> list[int]:
        return list(self.data["seeds"])

    @property
    def ratios(self) -> list[float]:
        return list(self.data["ratios"])

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.data["records"]

    def to_json(self) -> str:
        """compare.json's text."""
        return json.dumps(self.data, indent=2) + "\n"

    def markdown(self) -> str:
        """compare.md's text (:func:`markdown_table`)."""
        return markdown_table(self.data)

    def __repr__(self) -> str:
        return (f"CompareResult(methods={self.methods}, seeds={self.seeds}, ratios={self.ratios}, "
                f"verdicts={len(self.verdicts)})")


def build_result(methods: list[str], seeds: list[int], ratios: list[float], settings: dict[str, Any],
                 keys: dict[float, str], records: list[dict[str, Any]], eval_meta: list[dict[str, Any]] | None = None,
                 *, decide_by: str | None = None) -> dict[str, Any]:
    """``compare.json``: the settings, the evaluation sets, per ratio the per-method summary (task metrics under
    ``metrics``), the frontier, the metric the verdicts decide on (``decide_by``), the records (without their
    per-example losses: ``eval_losses.json``; with their per-problem task scores).

    Raises:
        ValueError: ``decide_by`` names a metric no unit measured.
    """
    first = records[0] if records else {}
    sets_of_first = first.get("eval_sets") or {}
    eval_meta = [{**m, "evaluated": first.get("n_eval") if m["primary"] else  # the primary: without LESS's tail
                  sets_of_first.get(m["name"], {}).get("n_eval")} for m in eval_meta or []]
    names = [m["name"] for m in eval_meta]
    full = [r for r in records if r["method"] == "full"]
    by_ratio = {}
    for ratio in ratios:
        at = [r for r in records if r["method"] != "full" and r["ratio"] == ratio] + full
        by_ratio[f"{ratio:g}"] = with_task_metrics(summarize(at, methods, names), at, methods)
    summary = by_ratio[f"{ratios[0]:g}"]
    metric = decided_metric(decide_by, records)
    points = frontier(records, methods, ratios)
    if metric != LOSS:
        for point in points:
            rs = [r for r in records if r["method"] == point["method"]
                  and (point["method"] == "full" or r["ratio"] == point["ratio"])]
            row = metric_rows(rs, [point["method"]], metric).get(point["method"])
            point.update({"metric": row["mean"], "metric_ci95": row["ci95"]} if row else {})
    reused = sum(1 for r in records if r.get("features_reused"))
    return {"settings": {**settings, "ratio": ratios[0], "ratios": ratios}, "key": keys[ratios[0]],
            "methods": methods, "seeds": seeds, "ratios": ratios, "summary": summary, "decide_by": metric,
            "summary_by_ratio": by_ratio, "frontier": points, "per_token": per_token(points, methods, ratios[0]),
            "features_note": _features_note(records, reused), "goals": goals(summary), "eval_sets": eval_meta,
            "records": [without_examples(r) for r in records]}


def with_task_metrics(summary: dict[str, dict[str, Any]], records: list[dict[str, Any]],
                      methods: list[str]) -> dict[str, dict[str, Any]]:
    """``summary`` with, per method, ``metrics`` (every task metric's row: :func:`metric_rows`) and
    ``task_eval_s`` (mean evaluation seconds, apart from selection and training), when the units measured tasks."""
    for name in task_metric_names(records):
        for m, row in metric_rows(records, methods, name).items():
            if m in summary:
                summary[m].setdefault("metrics", {})[name] = row
    for m, row in summary.items():
        seconds = [r["task_eval_s"] for r in records if r["method"] == m and r.get("task_eval_s") is not None]
        if seconds:
            row["task_eval_s"] = float(np.mean(seconds))
    return summary


def decision_verdicts(summary: dict[str, dict[str, Any]], metric: str) -> list[str]:
    """The ``verdict:`` lines on the metric the comparison decides by: held-out loss (:func:`verdicts`) or a task
    metric (:func:`clusterlm.comparison.metrics.metric_verdicts`)."""
    if metric == LOSS:
        return verdicts(summary)
    rows = {m: r["metrics"][metric] for m, r in summary.items() if metric in (r.get("metrics") or {})}
    return metric_verdicts(rows, metric, tokens={m: r.get("tokens") for m, r in summary.items()})


def _task_table(summary: dict[str, dict[str, Any]]) -> list[str]:
    """Task metrics per method: mean [95 % interval] over seeds and problems; the evaluation's seconds."""
    names = list(dict.fromkeys(n for r in summary.values() for n in (r.get("metrics") or {})))
    if not names:
        return []
    lines = ["| method | " + " | ".join(f"{n} [95 %]" for n in names) + " | task evaluation s |",
             "|---|" + "---:|" * (len(names) + 1)]
    for m, r in summary.items():
        cells = []
        for n in names:
            row = (r.get("metrics") or {}).get(n)
            cells.append("-" if row is None else f"{row['mean']:.4f} [{row['ci95'][0]:.4f}, {row['ci95'][1]:.4f}]")
        seconds = r.get("task_eval_s")
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {'-' if seconds is None else f'{seconds:.1f}'} |")
    return lines


def _features_note(records: list[dict[str, Any]], reused: int) -> str:
    n_cluster = sum(1 for r in records if parse_method(r["method"]).base in CLUSTER_METHODS)
    if not n_cluster:
        return ""
    return (f"features: computed once per model, data and feature settings (preset, features, window, seed) into "
            f"OUT/{FEATURES}/ and reused by every cluster method and ratio with those settings: {reused} of "
            f"{n_cluster} cluster unit(s) read stored features; their selection seconds still include the time the "
            f"features took when computed, so every unit is charged its full selection cost.")


def markdown_table(result: dict[str, Any]) -> str:
    """The comparison as markdown: per ratio a table (mean ± std over seeds) and one ``verdict:`` line per method;
    the frontier across ratios; the goals at the first ratio."""
    st = result["settings"]
    by_ratio = result.get("summary_by_ratio") or {f"{st['ratio']:g}": result["summary"]}
    lines = [f"Comparison at ratio(s) {', '.join(by_ratio)}, world size {st['world_size']}, model {st['model']}, "
             f"seeds {result['seeds']}.", "", budget_line(st, next(iter(by_ratio.values())))]
    for ratio, summary in by_ratio.items():
        if len(by_ratio) > 1:
            lines += ["", f"### ratio {ratio}"]
        tasks = _task_table(summary)
        lines += ["", *_summary_table(summary), *(["", *tasks] if tasks else []), "",
                  *decision_verdicts(summary, result.get("decide_by", LOSS))]
        if len(result.get("eval_sets") or []) > 1:
            lines += eval_set_tables(summary, result["eval_sets"])
    if len(by_ratio) > 1:
        lines += ["", f"### selection cost at ratio {next(iter(by_ratio))}"]
    lines += ["", *_cost_table(next(iter(by_ratio.values())))]
    if len(result.get("frontier") or []) > 1 and len(by_ratio) > 1:
        lines += ["", "### frontier (held-out loss against cost; 95 % interval over seeds and evaluation examples)", "",
                  "| ratio | method | tokens trained | selection s | training s | total s | held-out loss [95 %] |",
                  "|---:|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {p['ratio']:g} | {p['method']} | {p['tokens']:,.0f} | {p['selection_s']:.2f} | "
                  f"{p['train_s']:.1f} | {p['total_s']:.1f} | {p['eval_loss']:.4f} [{p['ci95'][0]:.4f}, "
                  f"{p['ci95'][1]:.4f}] |" for p in result["frontier"]]
    lines += equal_tokens_lines(result.get("per_token"))
    if result.get("features_note"):
        lines += ["", result["features_note"]]
    if result.get("goals"):
        lines += ["", "| ratio | value |", "|---|---:|"]
        lines += [f"| {k} | {v:.4f} |" for k, v in result["goals"].items()]
    return "\n".join(lines)


def budget_line(settings: dict[str, Any], summary: dict[str, dict[str, Any]]) -> str:
    """What the budget was, and how far apart the methods' selected tokens are (with ``--budget tokens``: the
    statement that they are token-matched, or not)."""
    budget = settings.get("budget", "examples")
    sel = {m: r["selected_tokens"] for m, r in summary.items() if r.get("selected_tokens") and m != "full"}
    spread = ""
    if len(sel) > 1:
        lo, hi = min(sel.values()), max(sel.values())
        spread = (f" Selected tokens (prompt + answer) range {lo:,.0f}-{hi:,.0f} "
                  f"({(hi - lo) / max(lo, 1):.1%} apart).")
    if budget == "tokens":
        gaps = [abs(r["selected_tokens"] - r["requested_tokens"]) for m, r in summary.items()
                if r.get("requested_tokens") and r.get("selected_tokens") and m != "full"]
        gap = f" Largest gap between a method's selected and requested tokens: {max(gaps):,.0f}." if gaps else ""
        return ("Budget: tokens. Every method is token-matched: its selected tokens meet ratio x the data's tokens up "
                "to one example per cluster or rank." + spread + gap)
    return ("Budget: examples (every method keeps ratio x the examples; tokens differ between methods: --budget tokens "
            "compares at equal tokens)." + spread)


def equal_tokens_lines(block: dict[str, Any] | None) -> list[str]:
    """The ``per_token`` block as markdown: every method's held-out loss at random's token count, and the best."""
    if not block or not any(v["eval_loss"] is not None for m, v in block["methods"].items() if m != "random"):
        return []
    lines = ["", f"### at equal tokens (random's {block['tokens']:,.0f} training tokens at ratio {block['ratio']:g}; "
             f"a method counts as token-matched within {TOKEN_MATCH:.0%})", "",
             "| method | held-out loss [95 %] | how |", "|---|---:|---|"]
    for m, v in block["methods"].items():
        loss = "-" if v["eval_loss"] is None else f"{v['eval_loss']:.4f} [{v['ci95'][0]:.4f}, {v['ci95'][1]:.4f}]"
        lines.append(f"| {m} | {loss} | {v['how']} |")
    if block.get("best"):
        best = block["methods"][block["best"]]
        lines += ["", f"best at equal tokens: {block['best']} ({best['eval_loss']:.4f}); its interval against the "
                  "others' says whether that is resolved."]
    return lines


def _cost_table(summary: dict[str, dict[str, Any]]) -> list[str]:
    """Selection cost in training units: tokens read vs trained, seconds by stage (means over seeds)."""
    rows = [(m, r) for m, r in summary.items() if "selection_split_s" in r]
    loads = [r["model_load_s"] for _, r in rows if r.get("model_load_s") is not None]
    lines = ["| method | tokens read by selection | tokens trained | read / trained | selection s by stage |",
             "|---|---:|---:|---:|---|"]
    for m, r in rows:
        read = r.get("selection_tokens")
        shown = "not counted" if read is None else f"{read:,.0f}"
        ratio = "" if read is None or not r["tokens"] else f"{read / r['tokens']:.2f}"
        stages = ", ".join(f"{k} {v:.2f}" for k, v in r["selection_split_s"].items()) or "-"
        lines.append(f"| {m} | {shown} | {r['tokens']:,.0f} | {ratio} | {stages} |")
    if loads:
        lines += ["", f"model load (once, shared by every method, not in selection s): {max(loads):.2f} s"]
    return lines


def _summary_table(summary: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| method | fraction | tokens trained | selection s | training s | total s | held-out loss |",
             "|---|---:|---:|---:|---:|---:|---:|"]

    def pm(row: dict[str, Any], f: str, digits: int) -> str:
        if row["seeds"] < 2:
            return f"{row[f]:.{digits}f}"  # one seed: no spread to show
        return f"{row[f]:.{digits}f} ± {row[f + '_std']:.{digits}f}"

    for m, row in summary.items():
        lines.append(f"| {m} | {row['fraction']:.3f} | {row['tokens']:,.0f} | {pm(row, 'selection_s', 2)} | "
                     f"{pm(row, 'train_s', 1)} | {pm(row, 'total_s', 1)} | {pm(row, 'eval_loss', 4)} |")
    return lines
