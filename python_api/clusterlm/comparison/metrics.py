"""Task metrics in a comparison: per-problem scores, means with intervals, differences to random and full data,
and the verdicts on the metric ``--decide-by`` names.

Every unit that trained with ``--eval-task`` records its task metrics (``humaneval/pass@1``, ``mytask/acc``, ...)
and, per metric, a score per problem (:func:`item_scores`): the unbiased pass@k of that problem's samples for code
tasks (their mean is the task's pass@k), the sample's own value for lm-eval tasks. The interval of a difference is
the same two-level bootstrap as the held-out loss's (:func:`clusterlm.comparison.bootstrap.bootstrap_delta`: seeds,
paired when both methods ran the same ones, then problems), on the scores with a weight of one per problem.
A metric without per-problem scores (``humaneval/reference_loss``, or an lm-eval aggregate) resamples the seeds
only.

Higher is better for every metric but losses and perplexities (:func:`lower_is_better`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from clusterlm.comparison.bootstrap import Delta, bootstrap_delta, bootstrap_loss, interval_text
from clusterlm.tasks.passk import pass_at_k

__all__ = ["LOSS", "decided_metric", "item_scores", "lower_is_better", "metric_rows", "metric_verdicts",
           "task_metric_names"]

LOSS = "loss"  # --decide-by loss: the held-out answer-token loss (the default without tasks)
N_BOOT = 2000
_LOWER = ("loss", "perplexity", "ppl", "bits_per_byte", "bpb")


def lower_is_better(metric: str) -> bool:
    """Losses and perplexities: lower is better; every other metric (pass@k, acc, exact match, ...): higher."""
    last = metric.rsplit("/", 1)[-1].lower()
    return any(word in last for word in _LOWER)


def item_scores(task_records: dict[str, list[dict[str, Any]]], metrics: dict[str, float]) -> dict[str, list[float]]:
    """Per metric of ``metrics`` (``NAME/METRIC``) its score per problem, problems in ``task_id`` order; a metric
    whose per-problem scores cannot be told from the records is left out.

    Args:
        task_records: per task name, the records :func:`clusterlm.tasks.run_tasks` wrote (``task_id`` and, for
            code tasks, ``status`` per sample; for lm-eval tasks, the sample's metric values).
        metrics: the run's task metrics.
    """
    out: dict[str, list[float]] = {}
    for name in metrics:
        task, _, metric = name.partition("/")
        rows = task_records.get(task) or []
        if metric.startswith("pass@") and rows and "status" in rows[0]:
            k = int(metric.removeprefix("pass@"))
            n: dict[str, int] = {}
            c: dict[str, int] = {}
            for r in rows:
                n[r["task_id"]] = n.get(r["task_id"], 0) + 1
                c[r["task_id"]] = c.get(r["task_id"], 0) + (r["status"] == "passed")
            out[name] = [pass_at_k(n[p], c[p], k) for p in sorted(n)]
            continue
        sub, _, leaf = metric.rpartition("/")
        picked = [r for r in rows if leaf in r and (not sub or r.get("task") == sub)]
        values = [r[leaf] for r in sorted(picked, key=lambda r: str(r["task_id"]))]
        if values and all(isinstance(v, (int, float)) for v in values):  # (a bool is an int: acc as True/False)
            out[name] = [float(v) for v in values]
    return out


def task_metric_names(records: list[dict[str, Any]]) -> list[str]:
    """The task metrics of the units, in the order the first unit that has them lists them."""
    for r in records:
        if r.get("task_metrics"):
            return list(r["task_metrics"])
    return []


def decided_metric(decide_by: str | None, records: list[dict[str, Any]]) -> str:
    """What the verdicts decide on: ``decide_by`` when given, else the first task metric, else :data:`LOSS`.

    Raises:
        ValueError: ``decide_by`` names a metric no unit measured (the message lists those measured).
    """
    names = task_metric_names(records)
    if decide_by in (None, ""):
        return names[0] if names else LOSS
    if decide_by != LOSS and decide_by not in names:
        raise ValueError(f"compare: --decide-by {decide_by}: no unit measured that metric; the metrics are "
                         f"{', '.join([LOSS, *names])}.")
    return decide_by


def _per_problem(rs: list[dict[str, Any]], metric: str) -> bool:
    """Every unit of ``rs`` has per-problem scores of ``metric``, and all the same number of them."""
    per = [(r.get("task_scores") or {}).get(metric) for r in rs]
    return all(per) and len({len(p) for p in per}) == 1


def _scores(rs: list[dict[str, Any]], metric: str, per_problem: bool) -> np.ndarray:
    """(seeds, problems) scores, or (seeds, 1) of the units' metric when not ``per_problem``."""
    if per_problem:
        return np.asarray([r["task_scores"][metric] for r in rs], dtype=np.float64)
    return np.asarray([[r["task_metrics"][metric]] for r in rs], dtype=np.float64)


def _measured(rs: list[dict[str, Any]], metric: str) -> bool:
    return bool(rs) and all(isinstance((r.get("task_metrics") or {}).get(metric), (int, float))
                            and math.isfinite(r["task_metrics"][metric]) for r in rs)


def _delta(rs: list[dict[str, Any]], ref: list[dict[str, Any]], metric: str) -> tuple[Delta, bool] | None:
    if not _measured(rs, metric) or not _measured(ref, metric):
        return None
    per = _per_problem(rs + ref, metric)  # both sides on the same problems, else both by seed only
    a, b = _scores(rs, metric, per), _scores(ref, metric, per)
    d = bootstrap_delta(a, np.ones_like(a), b, np.ones_like(b), seeds_a=[r["seed"] for r in rs],
                        seeds_b=[r["seed"] for r in ref], n_boot=N_BOOT, seed=0)
    return d, per


def metric_rows(records: list[dict[str, Any]], methods: list[str], metric: str) -> dict[str, dict[str, Any]]:
    """Per method: the metric's mean over seeds with its 95 % interval, and its difference to random and to full
    data (``delta_vs_random``, ``ci95_vs_random``, ``paired_vs_random``, ``interval_vs_random``, ...)."""
    by_method = {m: [r for r in records if r["method"] == m] for m in methods}
    out: dict[str, dict[str, Any]] = {}
    for m, rs in by_method.items():
        if not _measured(rs, metric):
            continue
        per_problem = _per_problem(rs, metric)
        scores = _scores(rs, metric, per_problem)
        mean, low, high = bootstrap_loss(scores, np.ones_like(scores), n_boot=N_BOOT)
        values = [r["task_metrics"][metric] for r in rs]
        row: dict[str, Any] = {"mean": mean, "ci95": [low, high], "seeds": len(rs),
                               "std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
                               "problems": int(scores.shape[1]) if per_problem else None}
        for ref in ("random", "full"):
            found = _delta(rs, by_method.get(ref) or [], metric) if ref != m else None
            if found is None:
                continue
            d, per = found
            row.update({f"delta_vs_{ref}": d.delta, f"ci95_vs_{ref}": [d.low, d.high], f"paired_vs_{ref}": d.paired,
                        f"interval_vs_{ref}": "seeds x problems" if per else "seeds only"})
        out[m] = row
    return out


def metric_verdicts(rows: dict[str, dict[str, Any]], metric: str, *, tokens: dict[str, float] | None = None
                    ) -> list[str]:
    """One ``verdict:`` line per method on ``metric``: the difference to random and to full data with its 95 %
    interval, and whether that resolves it (which way is better follows :func:`lower_is_better`)."""
    lower = lower_is_better(metric)
    lines = []
    for m, row in rows.items():
        parts = []
        for ref in ("random", "full"):
            if ref == m or row.get(f"ci95_vs_{ref}") is None:
                continue
            lo, hi = row[f"ci95_vs_{ref}"]
            d = Delta(row[f"delta_vs_{ref}"], lo, hi, row[f"paired_vs_{ref}"], math.nan, math.nan, row["seeds"])
            if not d.distinguishable:
                how = f"not distinguishable at {row['seeds']} seed{'s' if row['seeds'] > 1 else ''}"
            else:
                better = (d.delta < 0) == lower
                how = f"{'better' if better else 'worse'} {metric} than {ref} ({'lower' if d.delta < 0 else 'higher'})"
            text = f"{m} vs {ref} on {metric}: {interval_text(d)}, {how} ({row[f'interval_vs_{ref}']})"
            if tokens and tokens.get(m) and tokens.get(ref):
                text += f"; {tokens[m] / tokens[ref]:.2f}x {ref}'s tokens"
            parts.append(text)
        if not parts:
            parts = [f"{m} on {metric}: {'the reference' if m in ('random', 'full') else 'no random or full run'}"]
        lines.append("verdict: " + "; ".join(parts) + ".")
    return lines
