"""A plan as text: per rank (clusters, examples, tokens, weight), per cluster (n_c, s_c, weight), stage timings.

:class:`PlanSummary` gives :class:`clusterlm.plan.Plan` its :meth:`~PlanSummary.summary` and the per-rank and
per-cluster rows that plan.json also records.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["PlanSummary"]


class PlanSummary:
    """The text summary of a plan and its rows (a base of :class:`clusterlm.plan.Plan`)."""

    def _cluster_rows(self) -> list[tuple[int, int, int, float | None]]:
        n_clusters = len(self.cluster_sizes)
        selected = np.concatenate(self.rank_indices)
        sel_labels = self.cluster_labels[selected]
        ok = sel_labels >= 0
        chosen = np.bincount(sel_labels[ok], minlength=n_clusters)
        wsum = np.bincount(sel_labels[ok], weights=self.weights[selected][ok], minlength=n_clusters)
        rows = []
        for c in range(n_clusters):
            w = float(wsum[c] / chosen[c]) if chosen[c] else None
            rows.append((c, int(self.cluster_sizes[c]), int(chosen[c]), w))
        return rows

    def _rank_rows(self) -> list[dict[str, Any]]:
        rows = []
        for r, idx in enumerate(self.rank_indices):
            labels = self.cluster_labels[idx]
            ids, counts = np.unique(labels[labels >= 0], return_counts=True)
            w = self.weights[idx]
            rows.append(
                {
                    "rank": r,
                    "examples": len(idx),
                    "tokens": int(self.lengths[idx].sum()),
                    "clusters": {str(int(c)): int(k) for c, k in zip(ids, counts, strict=True)},
                    "weight_mean": float(w.mean()),
                    "weight_min": float(w.min()),
                    "weight_max": float(w.max()),
                }
            )
        return rows

    def _signals_line(self) -> str:
        """Mean loss and gradient norm of the selected examples against all (the plan's signals), or ""."""
        selected = np.concatenate(self.rank_indices)
        parts = [f"{label} {values[selected].mean():.4g} (all {values.mean():.4g})"
                 for label, values in (("loss", self.losses), ("gradient norm", self.grad_norms)) if values is not None]
        return "selected mean " + ", ".join(parts) if parts else ""

    def summary(self) -> str:
        """A plain-text report: per rank (clusters, examples, tokens, weight), per cluster (n_c, s_c,
        weight) and stage timings; the first line states a paper-preset shortfall against the request."""
        n, s = self.n_examples, self.n_selected
        share = f"{100.0 * s / max(n, 1):.1f} %"
        requested = self.stats.get("requested")
        if self.config.get("preset") == "paper" and isinstance(requested, (int, np.integer)) and s < requested:
            # The paper's count is smallest cluster * pct // 100 per cluster: often far below ratio * N.
            share = (f"{share} of N; {int(requested)} = {100.0 * int(requested) / max(n, 1):.1f} % requested: the "
                     "paper preset keeps smallest cluster x pct // 100 per cluster")
        lines = [
            f"plan: {s} of {n} examples selected ({share}), world size {self.world_size}, {self.per_rank} per rank",
            f"model: {self.model_id}   data: sha256 {str(self.fingerprint['sha256'])[:16]}..",
        ]
        scalars = {k: v for k, v in self.config.items() if not isinstance(v, (Mapping, list, tuple, np.ndarray))}
        if scalars:  # nested entries (feature configs, ...) are in plan.json; the summary stays one line
            lines.append("config: " + ", ".join(f"{k}={v}" for k, v in scalars.items()))
        clustering = self.stats.get("clustering")
        if isinstance(clustering, Mapping) and clustering.get("cap") is not None:
            bound = "bound" if clustering.get("cap_bound") else "did not bind"
            lines.append(f"clustering: {clustering.get('method')}; cap {clustering['cap']} per cluster ({bound})")
        lines += ["", f"{'rank':>4}  {'clusters':<20}  {'examples':>8}  {'tokens':>10}  {'weight':>8}"]
        for row in self._rank_rows():
            clusters = row["clusters"]
            text = ",".join(clusters) if len(clusters) <= 6 else f"{len(clusters)} clusters"
            text = text or "-"
            lines.append(
                f"{row['rank']:>4}  {text:<20}  {row['examples']:>8}  {row['tokens']:>10}  {row['weight_mean']:>8.4f}"
            )
        tokens = self.per_rank_tokens()
        if tokens.mean() > 0:
            lines.append(f"token imbalance (max/mean over ranks): {tokens.max() / tokens.mean():.3f}")
        signals = self._signals_line()
        if signals:
            lines.append(signals)
        budget = self.stats.get("token_budget")
        if isinstance(budget, Mapping):
            lines.append(f"token budget: {budget['selected_tokens']:,} of {budget['requested_tokens']:,} tokens "
                         f"requested ({100.0 * budget['relative_error']:+.2f} %)")
        cluster_rows = self._cluster_rows()
        lines.append("")
        if cluster_rows:
            lines.append(f"{'cluster':>7}  {'n_c':>8}  {'s_c':>8}  {'weight':>8}")
            shown = cluster_rows if len(cluster_rows) <= 64 else cluster_rows[:64]
            for c, n_c, s_c, w in shown:
                lines.append(f"{c:>7}  {n_c:>8}  {s_c:>8}  {(f'{w:.4f}' if w is not None else '-'):>8}")
            if len(shown) < len(cluster_rows):
                lines.append(f"... {len(cluster_rows) - len(shown)} more clusters")
        else:
            lines.append("no clustering")
        if self.timings:
            lines += ["", f"{'stage':<20}  {'seconds':>10}"]
            for stage, sec in self.timings.items():
                lines.append(f"{stage:<20}  {float(sec):>10.3f}")
        return "\n".join(lines)
