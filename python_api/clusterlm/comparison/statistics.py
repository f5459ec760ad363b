"""The statistics of a comparison: per-method means over seeds, differences to random and to full data with their
95 % intervals (:mod:`clusterlm.comparison.bootstrap`' two-level bootstrap), the cost/quality frontier, and one verdict
per method.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from clusterlm.comparison.bootstrap import Delta, bootstrap_delta, bootstrap_loss, interval_text, seeds_to_resolve
from clusterlm.comparison.evaluation import on_set

__all__ = ["N_BOOT", "TOKEN_MATCH", "delta_between", "frontier", "goals", "mean_std", "per_token", "summarize",
           "token_note", "verdicts"]

N_BOOT = 2000  # bootstrap replicates of every interval
TOKEN_MATCH = 0.05  # training tokens within 5 % of the reference's count as token-matched


def mean_std(values: list[float]) -> tuple[float, float]:
    arr = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=np.float64)
    if not len(arr):
        return float("nan"), float("nan")
    return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else 0.0


def summarize(records: list[dict[str, Any]], methods: list[str],
              eval_sets: list[str] | tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Per method: mean and std over seeds of selection / training / total seconds, held-out loss, tokens trained;
    and the held-out loss difference to random and to full data with its 95 % interval (:func:`_vs_reference`).

    ``eval_sets``: the evaluation sets' names, the primary first (the one behind ``eval_loss``): each method's row
    gains ``eval_sets``, per set the held-out loss with its interval and the differences (:func:`_set_summary`).
    """
    out: dict[str, dict[str, Any]] = {}
    by_method = {m: [r for r in records if r["method"] == m] for m in methods}
    for m, rs in by_method.items():
        if not rs:
            continue
        row: dict[str, Any] = {"seeds": len(rs), "fraction": float(np.mean([r["fraction"] for r in rs]))}
        for field in ("selection_s", "train_s", "total_s", "eval_loss", "tokens"):
            row[field], row[f"{field}_std"] = mean_std([r[field] for r in rs])
        for key in ("selected_tokens", "requested_tokens"):  # (records of earlier versions lack them)
            if all(r.get(key) is not None for r in rs):
                row[key] = float(np.mean([r[key] for r in rs]))
        row.update(_selection_cost(rs))
        out[m] = row
    for m, row in out.items():
        for ref in ("random", "full"):
            if by_method.get(ref):
                row.update(_vs_reference(by_method[m], by_method[ref], ref))
        if eval_sets:  # the primary set's differences are the row's own: not bootstrapped twice
            vs_primary = {k: v for k, v in row.items() if "_vs_" in k}
            row["eval_sets"] = {name: _set_summary(by_method, m, name, eval_sets[0],
                                                   vs_primary if name == eval_sets[0] else None)
                                for name in eval_sets}
    return out


def _set_summary(by_method: dict[str, list[dict[str, Any]]], m: str, name: str, primary: str,
                 known_vs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Method ``m`` on evaluation set ``name``: held-out loss (mean, std over seeds) with its 95 % interval
    (:func:`clusterlm.comparison.bootstrap.bootstrap_loss`), the loss before training, the examples evaluated, and the
    difference to
    random and to full data on that set with its interval (:func:`_vs_reference`; ``known_vs``: those already
    computed, for the primary set)."""
    rs = on_set(by_method[m], name, primary)
    if not rs:
        return {"loss": None, "ci95": None}
    loss, std = mean_std([r["eval_loss"] for r in rs])
    interval = _loss_interval(rs)
    ci95 = None if interval is None else list(interval[1:])
    before = next((r["initial_eval_loss"] for rr in by_method.values() for r in on_set(rr, name, primary)
                   if r.get("initial_eval_loss") is not None), None)
    row = {"loss": loss, "loss_std": std, "ci95": ci95, "initial_loss": before, "n_eval": rs[0].get("n_eval")}
    if known_vs is not None:
        return row | known_vs
    for ref in ("random", "full"):
        ref_rs = on_set(by_method.get(ref) or [], name, primary)
        if ref_rs:
            row.update(_vs_reference(rs, ref_rs, ref))
    return row


def _selection_cost(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Selection cost in training units: tokens read by the selection (mean over seeds; None when not counted),
    its seconds split by stage (the plan's timings: features, kmeans, picks, ...; mean over seeds), and the
    selection model's load time (once per compare, shared by every method; not in ``selection_s``)."""
    tokens = [r.get("selection_tokens") for r in rs]
    split: dict[str, float] = {}
    for key in sorted({k for r in rs for k in (r.get("timings") or {}) if k != "total"}):
        split[key] = float(np.mean([float((r.get("timings") or {}).get(key, 0.0)) for r in rs]))
    loads = [r["model_load_s"] for r in rs if r.get("model_load_s") is not None]
    return {"selection_tokens": None if None in tokens else float(np.mean(tokens)), "selection_split_s": split,
            "model_load_s": float(np.mean(loads)) if loads else None}


def _loss_arrays(rs: list[dict[str, Any]], per_example: bool) -> tuple[np.ndarray, np.ndarray]:
    """(seeds, examples) summed token losses and answer tokens (one pseudo-example per run without them)."""
    if per_example:
        return (np.asarray([r["eval_examples"]["loss_sums"] for r in rs], dtype=np.float64),
                np.asarray([r["eval_examples"]["tokens"] for r in rs], dtype=np.float64))
    return np.asarray([[r["eval_loss"]] for r in rs], dtype=np.float64), np.ones((len(rs), 1))


def delta_between(rs: list[dict[str, Any]], ref: list[dict[str, Any]]) -> Delta | None:
    """Held-out loss of the units ``rs`` minus that of ``ref`` (compare records of two methods), with the
    two-level bootstrap interval (:func:`clusterlm.comparison.bootstrap.bootstrap_delta`: paired by seed when both ran
    the same
    seeds; over the evaluation examples when every record has its per-example losses, else over seeds only).
    None when a loss is missing."""
    both = rs + ref
    if not rs or not ref or any(r["eval_loss"] is None or not math.isfinite(r["eval_loss"]) for r in both):
        return None
    sizes = {len(r["eval_examples"]["tokens"]) if r.get("eval_examples") else 0 for r in both}
    per_example = 0 not in sizes and len(sizes) == 1
    return bootstrap_delta(*_loss_arrays(rs, per_example), *_loss_arrays(ref, per_example),
                           seeds_a=[r["seed"] for r in rs], seeds_b=[r["seed"] for r in ref], n_boot=N_BOOT, seed=0)


def _vs_reference(rs: list[dict[str, Any]], ref: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """``delta_vs_<name>``, ``ci95_vs_<name>``, whether the seeds were paired, the seeds that would resolve 1 %.

    The interval is :func:`clusterlm.comparison.bootstrap.bootstrap_delta`'s (seeds, then evaluation examples; paired by
    seed when
    both ran the same seeds); runs recorded without per-example losses resample the seeds only.
    """
    d = delta_between(rs, ref)
    if d is None:
        return {f"delta_vs_{name}": None, f"ci95_vs_{name}": None}
    per_example = all(r.get("eval_examples") for r in rs + ref) and d.n_examples > 1
    ref_loss = float(np.mean([r["eval_loss"] for r in ref]))
    return {f"delta_vs_{name}": d.delta, f"ci95_vs_{name}": [d.low, d.high], f"paired_vs_{name}": d.paired,
            f"interval_vs_{name}": "seeds x eval examples" if per_example else "seeds only",
            f"seeds_for_1pct_vs_{name}": seeds_to_resolve(d, ref_loss),
            f"eval_sd_vs_{name}": math.sqrt(d.eval_var),
            f"seed_sd_vs_{name}": None if math.isnan(d.seed_var) else math.sqrt(d.seed_var)}


def _loss_interval(rs: list[dict[str, Any]]) -> tuple[float, float, float] | None:
    """The held-out loss of runs ``rs`` (mean over seeds) with its 95 % interval (:func:`bootstrap_loss`: seeds, then
    evaluation examples when every run has the same per-example losses); None when a run has no finite loss."""
    if any(r["eval_loss"] is None or not math.isfinite(r["eval_loss"]) for r in rs):
        return None
    sizes = {len(r["eval_examples"]["tokens"]) if r.get("eval_examples") else 0 for r in rs}
    return bootstrap_loss(*_loss_arrays(rs, 0 not in sizes and len(sizes) == 1), n_boot=N_BOOT)


def frontier(records: list[dict[str, Any]], methods: list[str], ratios: list[float]) -> list[dict[str, Any]]:
    """Cost and quality of every (ratio, method): tokens trained, selection / training / total seconds and held-out
    loss (means over seeds) with the loss's 95 % interval (seeds, then evaluation examples); full data at ratio 1."""
    points = [(1.0, "full")] if "full" in methods else []
    points += [(r, m) for r in ratios for m in methods if m != "full"]
    out = []
    for ratio, m in points:
        rs = [r for r in records if r["method"] == m and (m == "full" or r["ratio"] == ratio)]
        interval = _loss_interval(rs) if rs else None
        if interval is None:
            continue
        loss, low, high = interval
        row = {"ratio": ratio, "method": m, "seeds": len(rs)}
        row.update({f: float(np.mean([r[f] for r in rs])) for f in ("tokens", "selection_s", "train_s", "total_s")})
        out.append({**row, "eval_loss": loss, "ci95": [low, high]})
    return out


def _verdict_part(m: str, row: dict[str, Any], ref: str, ref_row: dict[str, Any]) -> str:
    """``cluster vs random: -0.0005 [-0.0210, +0.0200], not distinguishable at 3 seeds; 1.39x random's time; ...``"""
    lo, hi = row[f"ci95_vs_{ref}"]
    d = Delta(row[f"delta_vs_{ref}"], lo, hi, row[f"paired_vs_{ref}"], math.nan, math.nan, row["seeds"])
    if not d.distinguishable:
        how = f"not distinguishable at {row['seeds']} seed{'s' if row['seeds'] > 1 else ''}"
    else:
        how = f"{'lower (better)' if d.delta < 0 else 'higher (worse)'} held-out loss than {ref}"
    text = f"{m} vs {ref}: {interval_text(d)}, {how}"
    if ref_row.get("total_s"):
        text += f"; {row['total_s'] / ref_row['total_s']:.2f}x {ref}'s time"
    text += token_note(row, ref, ref_row)
    n = row.get(f"seeds_for_1pct_vs_{ref}")
    if d.distinguishable:
        return text
    if n is not None:
        return text + f"; ~{n} seeds would resolve a 1 % difference"
    if row[f"seed_sd_vs_{ref}"] is None:
        return text + "; one seed: run >= 2 seeds to know how many would resolve 1 %"
    return text + "; the evaluation set alone is too small to resolve 1 % (add evaluation examples)"


def token_note(row: dict[str, Any], ref: str, ref_row: dict[str, Any]) -> str:
    """``; 1.26x random's tokens, not token-matched (rerun with --budget tokens)``: the method's training tokens as a
    ratio of the reference's, and a warning when they differ by more than :data:`TOKEN_MATCH` (the comparison then
    mixes the choice of examples with the extra training)."""
    if not row.get("tokens") or not ref_row.get("tokens"):
        return ""
    ratio = row["tokens"] / ref_row["tokens"]
    text = f"; {ratio:.2f}x {ref}'s tokens"
    if abs(ratio - 1) <= TOKEN_MATCH or ref == "full":
        return text
    how = f"not token-matched: {abs(ratio - 1):.0%} {'more' if ratio > 1 else 'fewer'}"
    sel, ref_sel = row.get("selected_tokens"), ref_row.get("selected_tokens")
    if sel and ref_sel and abs(sel / ref_sel - 1) <= TOKEN_MATCH:
        # equal selections, unequal training: a step cap trains a fixed number of examples, whatever their length
        return text + f" ({how}, although the selections are: the step cap (--max-steps) counts examples, not tokens)"
    return text + f" ({how}; rerun with --budget tokens to compare at equal tokens)"


def per_token(points: list[dict[str, Any]], methods: list[str], primary_ratio: float) -> dict[str, Any] | None:
    """Held-out loss of every method at random's token count (at the primary ratio): interpolated along the method's
    frontier (loss against tokens trained) when several ratios ran and bracket that count, or the method's own point
    when it trained within :data:`TOKEN_MATCH` of it; with the 95 % interval interpolated the same way (an
    approximation: the bounds of the two neighbouring points, weighted as the loss is). None without random.

    Returns:
        ``{"tokens": random's tokens, "methods": {m: {"eval_loss", "ci95", "how", "tokens"}}, "best": m}``; a method
        whose frontier does not reach random's count has ``eval_loss`` None and says why in ``how``.
    """
    ref = next((p for p in points if p["method"] == "random" and p["ratio"] == primary_ratio), None)
    if ref is None or not ref.get("tokens"):
        return None
    target = float(ref["tokens"])
    out: dict[str, Any] = {}
    for m in dict.fromkeys(p["method"] for p in points):
        ps = sorted((p for p in points if p["method"] == m), key=lambda p: p["tokens"])
        out[m] = _at_tokens(ps, target)
    ranked = [m for m, v in out.items() if v["eval_loss"] is not None and m != "full"]
    best = min(ranked, key=lambda m: out[m]["eval_loss"]) if ranked else None
    return {"tokens": target, "ratio": primary_ratio, "methods": out, "best": best}


def _at_tokens(ps: list[dict[str, Any]], target: float) -> dict[str, Any]:
    near = min(ps, key=lambda p: abs(p["tokens"] - target))
    if abs(near["tokens"] / target - 1) <= TOKEN_MATCH:
        return {"eval_loss": near["eval_loss"], "ci95": list(near["ci95"]), "tokens": near["tokens"],
                "how": f"trained {near['tokens'] / target:.2f}x random's tokens (ratio {near['ratio']:g})"}
    for a, b in zip(ps, ps[1:], strict=False):
        if a["tokens"] <= target <= b["tokens"] and b["tokens"] > a["tokens"]:
            w = (target - a["tokens"]) / (b["tokens"] - a["tokens"])
            pairs = zip([a["eval_loss"], *a["ci95"]], [b["eval_loss"], *b["ci95"]], strict=True)
            lerp = [(1 - w) * x + w * y for x, y in pairs]
            return {"eval_loss": lerp[0], "ci95": lerp[1:], "tokens": target,
                    "how": f"interpolated between ratios {a['ratio']:g} and {b['ratio']:g}"}
    span = f"{ps[0]['tokens']:,.0f}-{ps[-1]['tokens']:,.0f}" if len(ps) > 1 else f"{ps[0]['tokens']:,.0f}"
    return {"eval_loss": None, "ci95": None, "tokens": None,
            "how": f"its tokens ({span}) do not reach random's; run more --ratios or --budget tokens"}


def verdicts(summary: dict[str, dict[str, Any]]) -> list[str]:
    """One ``verdict:`` line per method in plain words: its difference to random and to full data, with the
    95 % interval, whether that resolves it, the time ratio and the seeds a 1 % difference would need."""
    lines = []
    for m, row in summary.items():
        parts = [_verdict_part(m, row, ref, summary[ref]) for ref in ("random", "full")
                 if ref in summary and ref != m and row.get(f"ci95_vs_{ref}") is not None]
        if not parts:
            alone = "the reference" if m in ("random", "full") else "no random or full run to compare with"
            parts = [f"{m}: {alone}"]
        lines.append("verdict: " + "; ".join(parts) + ".")
    return lines


def goals(summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets as measured ratios (those whose methods are present)."""
    g: dict[str, Any] = {}
    c = summary.get("cluster")
    if c is None:
        return g
    others = [summary[m]["selection_s"] for m in ("s2l", "ifd", "less") if m in summary]
    if others:
        g["cluster_selection_over_fastest_baseline"] = c["selection_s"] / min(others)
    if "full" in summary:
        g["cluster_total_over_full_train"] = c["total_s"] / summary["full"]["train_s"]
        g["cluster_loss_rel_to_full"] = c["eval_loss"] / summary["full"]["eval_loss"] - 1.0
    if "random" in summary:
        r = summary["random"]
        g["cluster_total_over_random_total"] = c["total_s"] / r["total_s"]
        g["cluster_loss_minus_random"] = c["eval_loss"] - r["eval_loss"]
        g["random_loss_std"] = r["eval_loss_std"]
    return g
