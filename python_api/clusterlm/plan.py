"""Plan: which examples every rank trains on, in which order, with which weights — and its file format.

A plan is what selection produces and what any trainer consumes. It holds, for a data set of N examples
and a world of K ranks, K equally long index lists (rank ``r`` visits ``rank_indices[r]`` in that order),
a per-example weight (0 for unselected examples), the cluster of every example and its squared distance
to its centroid, the original cluster sizes, the token length of every example, and the fingerprint of
the data set it was made for, so a trainer can refuse a plan made for other data.

Weights. For example ``i`` of cluster ``c``: ``w_i = (n_c / N) * (S / s_c)`` with ``n_c`` the size of
cluster ``c``, ``S`` the number of selected examples and ``s_c`` the number selected from ``c``
(:func:`selection_weights`). With one cluster per rank this is the method's rank weight ``K n_k / N``;
in general the weights have mean 1 over the selection, and ``mean_i(w_i * grad_i)`` over the selection
is an unbiased-by-cluster estimate of the full-data mean gradient ``sum_c (n_c / N) * g_c``.

Files (``Plan.save(dir)``)::

    plan.json   format, version, model id, world size, data fingerprint, selection config, timings,
                stats, cluster sizes, a per-cluster and per-rank summary of weights and tokens, and the
                sha256 of plan.npz (so a json/npz pair from two different saves is refused)
    plan.npz    rank_indices (K, m) int64, weights (N,) float64, cluster_labels (N,) int64,
                distances (N,) float64, lengths (N,) int64, cluster_sizes (C,) int64

Both are written to temporary files and renamed into place (npz first); nothing is pickled and the
arrays are read back with ``allow_pickle=False``.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from clusterlm._io import atomic_write_bytes
from clusterlm.data import fingerprint

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "Plan", "selection_weights"]

PLAN_FORMAT = "clusterlm.plan"
PLAN_VERSION = 1
_JSON = "plan.json"
_NPZ = "plan.npz"
_ARRAYS = ("rank_indices", "weights", "cluster_labels", "distances", "lengths", "cluster_sizes")
# Mean weight over the selection must be 1; float64 sums of up to millions of weights stay far inside this.
_MEAN_RTOL = 1e-9


def selection_weights(
    labels: np.ndarray | Sequence[int], selected: np.ndarray | Sequence[int], n_clusters: int
) -> np.ndarray:
    """Per-example weights ``w_i = (n_c / N') * (S / s_c)`` of a selection drawn from clusters.

    ``n_c`` is the size of cluster ``c``, ``s_c`` the number of examples selected from it, ``S = sum s_c``.
    ``N'`` is the total size of the clusters that have at least one selected example; it equals ``N``
    whenever every cluster is represented (the method's case). A cluster with nothing selected cannot be
    represented, so it gets no weight and the others are renormalised over ``N'``, which keeps the mean
    weight over the selection exactly 1 (the plan invariant).

    Args:
        labels: (N,) integer cluster of every example, each in ``[0, n_clusters)``. For a selection
            without clustering pass zeros and ``n_clusters=1`` (every selected weight is then 1).
        selected: a boolean mask of shape (N,) or the integer indices of the selected examples (unique).
        n_clusters: number of clusters C (clusters may be empty).

    Returns:
        (N,) float64: the weight of every selected example, 0 elsewhere; mean over the selection is 1.

    Raises:
        ValueError: labels out of range or not 1-D, a mask of the wrong length, indices out of range
            or repeated, an empty selection.
    """
    if isinstance(n_clusters, bool) or not isinstance(n_clusters, (int, np.integer)) or n_clusters < 1:
        raise ValueError(f"selection_weights: n_clusters must be a positive int, got {n_clusters!r}.")
    labels = np.asarray(labels)
    if labels.ndim != 1 or not (np.issubdtype(labels.dtype, np.integer) or labels.size == 0):
        raise ValueError(
            f"selection_weights: labels must be a 1-D integer array, got shape {labels.shape} dtype {labels.dtype}."
        )
    labels = labels.astype(np.int64)
    n = len(labels)
    if n and (labels.min() < 0 or labels.max() >= n_clusters):
        raise ValueError(
            f"selection_weights: labels must lie in [0, {n_clusters}), got values in [{labels.min()}, "
            f"{labels.max()}]; for a selection without clustering pass zeros and n_clusters=1."
        )
    mask = _selection_mask(selected, n, "selection_weights: selected")
    if not mask.any():
        raise ValueError("selection_weights: the selection is empty; select at least one example.")
    sizes = np.bincount(labels, minlength=n_clusters).astype(np.float64)
    chosen = np.bincount(labels[mask], minlength=n_clusters).astype(np.float64)
    represented = chosen > 0
    total = float(chosen.sum())
    per_cluster = np.zeros(n_clusters, dtype=np.float64)
    per_cluster[represented] = (sizes[represented] / sizes[represented].sum()) * (total / chosen[represented])
    weights = np.zeros(n, dtype=np.float64)
    weights[mask] = per_cluster[labels[mask]]
    return weights


def _selection_mask(selected: Any, n: int, what: str) -> np.ndarray:
    sel = np.asarray(selected)
    if sel.dtype == np.bool_:
        if sel.shape != (n,):
            raise ValueError(f"{what}: a boolean mask must have shape ({n},), got {sel.shape}.")
        return sel.copy()
    if sel.ndim != 1 or not (np.issubdtype(sel.dtype, np.integer) or sel.size == 0):
        raise ValueError(f"{what}: expected a boolean mask or 1-D integer indices, got shape {sel.shape} {sel.dtype}.")
    sel = sel.astype(np.int64)
    if sel.size and (sel.min() < 0 or sel.max() >= n):
        raise ValueError(f"{what}: indices must lie in [0, {n}), got values in [{sel.min()}, {sel.max()}].")
    mask = np.zeros(n, dtype=bool)
    mask[sel] = True
    if int(mask.sum()) != sel.size:
        raise ValueError(f"{what}: indices must be unique, got {sel.size - int(mask.sum())} repeated.")
    return mask


def _jsonable(obj: Any, where: str) -> Any:
    """Plain JSON types from config/stats values that may hold numpy scalars, arrays, tuples or paths."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, float)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"Plan.{where}: keys must be strings to be stored in plan.json, got {k!r}.")
            out[k] = _jsonable(v, f"{where}[{k!r}]")
        return out
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    raise TypeError(
        f"Plan.{where}: {type(obj).__name__} cannot be stored in plan.json; use numbers, strings, lists and dicts."
    )


def _as_int64(value: Any, name: str) -> np.ndarray:
    arr = np.asarray(value)
    if not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise ValueError(f"Plan.{name}: expected an integer array, got dtype {arr.dtype}.")
    return arr.astype(np.int64, copy=False)


def _as_float64(value: Any, name: str) -> np.ndarray:
    arr = np.asarray(value)
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise ValueError(f"Plan.{name}: expected a float array, got dtype {arr.dtype}.")
    return arr.astype(np.float64, copy=False)


@dataclass(eq=False)
class Plan:
    """Per-rank example lists, weights and provenance of one selection (see the module docstring).

    Attributes:
        world_size: number of ranks K.
        rank_indices: K int64 arrays of equal length m; rank ``r`` visits ``rank_indices[r]`` in order.
        weights: (N,) float64, 0 for unselected examples, mean 1 over the selected ones.
        cluster_labels: (N,) int64 cluster of every example, -1 when there is no clustering.
        distances: (N,) float64 squared distance to the own centroid (nan when there is none).
        cluster_sizes: (C,) int64 original cluster sizes ``n_c`` (C = 0 without clustering).
        lengths: (N,) int64 tokens per example.
        fingerprint: ``{"size": N, "sha256": ...}`` of the data set (:func:`clusterlm.data.fingerprint`).
        model_id: the model the features came from.
        config: JSON-serialisable selection config.
        timings: stage -> seconds.
        stats: JSON-serialisable statistics.
        version: file format version.

    Raises:
        ValueError: (from :meth:`validate`, run on construction) any broken invariant.
    """

    world_size: int
    rank_indices: list[np.ndarray]
    weights: np.ndarray
    cluster_labels: np.ndarray
    distances: np.ndarray
    cluster_sizes: np.ndarray
    lengths: np.ndarray
    fingerprint: dict
    model_id: str
    config: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        if isinstance(self.rank_indices, np.ndarray) and self.rank_indices.ndim == 2:
            self.rank_indices = list(self.rank_indices)
        if not isinstance(self.rank_indices, (list, tuple)):
            raise ValueError(
                "Plan.rank_indices: expected a list of world_size int64 arrays, got "
                f"{type(self.rank_indices).__name__}."
            )
        self.rank_indices = [_as_int64(r, f"rank_indices[{i}]") for i, r in enumerate(self.rank_indices)]
        self.weights = _as_float64(self.weights, "weights")
        self.cluster_labels = _as_int64(self.cluster_labels, "cluster_labels")
        self.distances = _as_float64(self.distances, "distances")
        self.cluster_sizes = _as_int64(self.cluster_sizes, "cluster_sizes")
        self.lengths = _as_int64(self.lengths, "lengths")
        self.validate()

    # ---- invariants -------------------------------------------------------------------------------

    def validate(self) -> None:
        """Check every internal invariant of the plan.

        Raises:
            ValueError: wrong world size or version, unequal or non-1-D per-rank lists, indices out of
                range or repeated (within or across ranks), arrays whose shapes disagree, negative or
                non-finite weights, weight outside the selection, mean selected weight not 1, cluster
                labels out of range or cluster sizes that disagree with them, negative lengths, a
                fingerprint whose size is not N, or config/timings/stats that cannot be stored as JSON.
        """
        n = self._validate_shapes()
        selected = self._validate_selection(n)
        self._validate_weights(selected)
        self._validate_clusters(n)
        self._validate_records()

    def _validate_shapes(self) -> int:
        """Version, world size, per-rank list shapes and counts, array shapes, fingerprint; returns N."""
        if self.version != PLAN_VERSION:
            raise ValueError(
                f"Plan.version: this clusterlm handles plan format version {PLAN_VERSION}, got {self.version!r}."
            )
        ws = self.world_size
        if isinstance(ws, bool) or not isinstance(ws, (int, np.integer)) or ws < 1:
            raise ValueError(f"Plan.world_size: expected a positive int, got {ws!r}.")
        if len(self.rank_indices) != ws:
            raise ValueError(
                f"Plan.rank_indices: expected {ws} per-rank arrays (world_size), got {len(self.rank_indices)}."
            )
        for r, idx in enumerate(self.rank_indices):
            if idx.ndim != 1:
                raise ValueError(f"Plan.rank_indices[{r}]: expected a 1-D array, got shape {idx.shape}.")
        counts = [len(idx) for idx in self.rank_indices]
        if len(set(counts)) != 1:
            raise ValueError(
                f"Plan.rank_indices: every rank must get the same number of examples (DDP steps in lock-step), "
                f"got {counts}."
            )
        if counts[0] == 0:
            raise ValueError("Plan.rank_indices: the plan selects no examples; every rank needs at least one.")
        n = self.weights.shape[0] if self.weights.ndim == 1 else -1
        if n < 0:
            raise ValueError(f"Plan.weights: expected shape (N,), got {self.weights.shape}.")
        for name in ("cluster_labels", "distances", "lengths"):
            shape = getattr(self, name).shape
            if shape != (n,):
                raise ValueError(f"Plan.{name}: expected shape ({n},) like weights, got {shape}.")
        if self.cluster_sizes.ndim != 1:
            raise ValueError(f"Plan.cluster_sizes: expected shape (C,), got {self.cluster_sizes.shape}.")
        fp = self.fingerprint
        if not isinstance(fp, Mapping) or "size" not in fp or "sha256" not in fp:
            raise ValueError(f"Plan.fingerprint: expected {{'size': N, 'sha256': hex}}, got {self.fingerprint!r}.")
        if int(self.fingerprint["size"]) != n:
            raise ValueError(
                f"Plan.fingerprint: size {self.fingerprint['size']} differs from the {n} examples of the arrays."
            )
        if not isinstance(self.model_id, str):
            raise ValueError(f"Plan.model_id: expected a str, got {type(self.model_id).__name__}.")
        return n

    def _validate_selection(self, n: int) -> np.ndarray:
        """Indices in range and each at most once over all ranks; returns them concatenated."""
        selected = np.concatenate(self.rank_indices)
        if selected.min() < 0 or selected.max() >= n:
            raise ValueError(
                f"Plan.rank_indices: indices must lie in [0, {n}), got values in [{selected.min()}, {selected.max()}]."
            )
        mask = np.zeros(n, dtype=bool)
        mask[selected] = True
        if int(mask.sum()) != selected.size:
            seen = np.bincount(selected, minlength=n)
            dup = np.flatnonzero(seen > 1)
            raise ValueError(
                f"Plan.rank_indices: every example may appear once in the plan; {dup.size} appear more than once "
                f"(first: {dup[:5].tolist()})."
            )
        return selected

    def _validate_weights(self, selected: np.ndarray) -> None:
        """Finite, non-negative, zero outside the selection, mean 1 over it."""
        mask = np.zeros(len(self.weights), dtype=bool)
        mask[selected] = True
        w = self.weights
        if not np.isfinite(w).all():
            raise ValueError(f"Plan.weights: must be finite, got {int((~np.isfinite(w)).sum())} non-finite values.")
        if (w < 0).any():
            raise ValueError(f"Plan.weights: must be >= 0, got minimum {w.min()!r}.")
        outside = np.flatnonzero((w != 0) & ~mask)
        if outside.size:
            raise ValueError(
                f"Plan.weights: unselected examples must have weight 0; {outside.size} have not (first: "
                f"{outside[:5].tolist()})."
            )
        mean = float(w[selected].mean())
        if not math.isclose(mean, 1.0, rel_tol=_MEAN_RTOL, abs_tol=0.0):
            raise ValueError(
                f"Plan.weights: the mean weight over the {selected.size} selected examples must be 1, got {mean!r}; "
                "compute weights with clusterlm.plan.selection_weights."
            )

    def _validate_clusters(self, n: int) -> None:
        """Labels in range, sizes that count them, lengths >= 0."""
        labels = self.cluster_labels
        n_clusters = len(self.cluster_sizes)
        if n and (labels.min() < -1 or labels.max() >= n_clusters):
            raise ValueError(
                f"Plan.cluster_labels: must lie in [-1, {n_clusters}) (C = len(cluster_sizes)), got values in "
                f"[{labels.min()}, {labels.max()}]."
            )
        counted = np.bincount(labels[labels >= 0], minlength=n_clusters)
        if not np.array_equal(counted, self.cluster_sizes):
            raise ValueError(
                "Plan.cluster_sizes: must equal the number of examples per label, got "
                f"{self.cluster_sizes[:8].tolist()} "
                f"but the labels count {counted[:8].tolist()}."
            )
        if n and self.lengths.min() < 0:
            raise ValueError(f"Plan.lengths: must be >= 0, got minimum {self.lengths.min()}.")

    def _validate_records(self) -> None:
        """config / timings / stats: dicts that JSON can store, timings in seconds."""
        for stage, sec in self.timings.items() if isinstance(self.timings, Mapping) else ():
            if isinstance(sec, bool) or not isinstance(sec, (int, float, np.integer, np.floating)):
                raise ValueError(f"Plan.timings: stage {stage!r} must map to seconds (a number), got {sec!r}.")
        for name in ("config", "timings", "stats"):
            value = getattr(self, name)
            if not isinstance(value, Mapping):
                raise ValueError(f"Plan.{name}: expected a dict, got {type(value).__name__}.")
            try:
                _jsonable(value, name)
            except TypeError as e:
                raise ValueError(str(e)) from None

    # ---- accessors --------------------------------------------------------------------------------

    @property
    def n_examples(self) -> int:
        """N, the size of the data set the plan was made for."""
        return int(self.weights.shape[0])

    @property
    def n_selected(self) -> int:
        """S, the number of selected examples over all ranks (world_size * per_rank)."""
        return self.world_size * self.per_rank

    @property
    def per_rank(self) -> int:
        """m, the number of examples every rank visits per epoch."""
        return len(self.rank_indices[0])

    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}) for this plan (world size), got {rank!r}.")
        return int(rank)

    def indices(self, rank: int) -> np.ndarray:
        """(m,) int64 data set indices of ``rank`` in visit order (a read-only view).

        Raises:
            ValueError: rank outside ``[0, world_size)``.
        """
        view = self.rank_indices[self._check_rank(rank)].view()
        view.flags.writeable = False
        return view

    def rank_weights(self, rank: int) -> np.ndarray:
        """(m,) float64 weights of ``rank``'s examples in visit order (``weights[indices(rank)]``).

        Raises:
            ValueError: rank outside ``[0, world_size)``.
        """
        return self.weights[self.indices(rank)]

    def per_rank_tokens(self) -> np.ndarray:
        """(world_size,) int64 total tokens per rank and epoch."""
        return np.array([int(self.lengths[idx].sum()) for idx in self.rank_indices], dtype=np.int64)

    def step_token_ratio(self, batch_size: int) -> np.ndarray:
        """Per-step token imbalance across ranks when every rank takes ``batch_size`` examples per step.

        Step ``j`` covers positions ``[j * batch_size, (j + 1) * batch_size)`` of every rank's list (plan
        order; the last step may be shorter). Its ratio is ``max_r tokens_r / mean_r tokens_r``: 1 is
        perfect balance, and the slowest rank's step takes about that factor longer than the average.

        Args:
            batch_size: examples per rank and step (per-device batch size x gradient accumulation for
                optimizer steps).

        Returns:
            (ceil(m / batch_size),) float64 ratios, each >= 1 (1 where a step has no tokens at all).

        Raises:
            ValueError: batch_size not a positive int.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"step_token_ratio: batch_size must be a positive int, got {batch_size!r}.")
        tokens = self.lengths[np.stack(self.rank_indices)]  # (K, m)
        n_steps = -(-self.per_rank // batch_size)
        padded = np.zeros((self.world_size, n_steps * batch_size), dtype=np.int64)
        padded[:, : self.per_rank] = tokens
        per_step = padded.reshape(self.world_size, n_steps, batch_size).sum(axis=2).astype(np.float64)
        mean = per_step.mean(axis=0)
        ratio = np.ones(n_steps, dtype=np.float64)
        nz = mean > 0
        ratio[nz] = per_step.max(axis=0)[nz] / mean[nz]
        return ratio

    # ---- verification -----------------------------------------------------------------------------

    def verify(self, dataset: Any, world_size: int | None = None) -> None:
        """Refuse to train on data (or a world) the plan was not made for.

        Args:
            dataset: an object with ``.fingerprint() -> {"size", "sha256"}`` (e.g.
                :class:`clusterlm.data.SFTDataset`) or a sequence of example dicts, fingerprinted with
                :func:`clusterlm.data.fingerprint`.
            world_size: number of processes of this run; not checked when None.

        Raises:
            ValueError: naming every difference: data set size, content hash, world size.
        """
        data_fp = fingerprint(dataset)
        problems = []
        plan_size, data_size = int(self.fingerprint["size"]), int(data_fp["size"])
        if plan_size != data_size:
            problems.append(f"plan was made for {plan_size} examples, the data set has {data_size}")
        elif self.fingerprint["sha256"] != data_fp["sha256"]:
            problems.append(
                f"content hash differs: plan {str(self.fingerprint['sha256'])[:12]}.., data "
                f"{str(data_fp['sha256'])[:12]}.. — the data changed or is in another order"
            )
        if world_size is not None and int(world_size) != self.world_size:
            problems.append(f"plan is for world size {self.world_size}, this run has {int(world_size)} processes")
        if problems:
            raise ValueError(
                "Plan.verify: " + "; ".join(problems) + ". Make a new plan for this data and world size "
                "(clusterlm select) or use the data the plan was made for."
            )

    # ---- text summary -----------------------------------------------------------------------------

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

    # ---- files ------------------------------------------------------------------------------------

    def _npz_bytes(self) -> bytes:
        buf = io.BytesIO()
        np.savez(
            buf,
            rank_indices=np.stack(self.rank_indices).astype(np.int64),
            weights=self.weights,
            cluster_labels=self.cluster_labels,
            distances=self.distances,
            lengths=self.lengths,
            cluster_sizes=self.cluster_sizes,
        )
        return buf.getvalue()

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``plan.json`` and ``plan.npz`` into ``directory`` (created if needed), atomically.

        Args:
            directory: target directory; existing plan files there are replaced.

        Returns:
            The directory.

        Raises:
            ValueError: the plan breaks an invariant (see :meth:`validate`).
        """
        self.validate()
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        npz = self._npz_bytes()
        meta = {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "model_id": self.model_id,
            "world_size": int(self.world_size),
            "n_examples": self.n_examples,
            "n_selected": self.n_selected,
            "per_rank": self.per_rank,
            "fingerprint": _jsonable(self.fingerprint, "fingerprint"),
            "config": _jsonable(self.config, "config"),
            "timings": _jsonable(self.timings, "timings"),
            "stats": _jsonable(self.stats, "stats"),
            "cluster_sizes": self.cluster_sizes.tolist(),
            "clusters": [
                {"cluster": c, "size": n_c, "selected": s_c, "weight": w} for c, n_c, s_c, w in self._cluster_rows()
            ],
            "ranks": self._rank_rows(),
            "arrays": {"file": _NPZ, "sha256": hashlib.sha256(npz).hexdigest()},
        }
        text = json.dumps(meta, indent=2) + "\n"
        # npz first: a crash between the two renames leaves an old json whose checksum refuses the new npz.
        atomic_write_bytes(path / _NPZ, npz)
        atomic_write_bytes(path / _JSON, text.encode("utf-8"))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """Read a plan written by :meth:`save`.

        Args:
            path: the plan directory or its ``plan.json``.

        Returns:
            The validated plan.

        Raises:
            FileNotFoundError: plan.json or plan.npz missing.
            ValueError: not a plan file, an unsupported format version, arrays that do not belong to
                this plan.json, or a plan that breaks an invariant.
        """
        path = Path(path)
        directory = path.parent if path.suffix == ".json" and not path.is_dir() else path
        json_path = path if directory is not path else directory / _JSON
        if not json_path.is_file():
            raise FileNotFoundError(
                f"Plan.load: no plan at {json_path}; pass the directory written by Plan.save (it holds {_JSON} "
                f"and {_NPZ})."
            )
        try:
            meta = json.loads(json_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"Plan.load: {json_path} is not valid JSON ({e}).") from None
        if not isinstance(meta, dict) or meta.get("format") != PLAN_FORMAT:
            raise ValueError(f"Plan.load: {json_path} is not a clusterlm plan (format {PLAN_FORMAT!r} expected).")
        version = meta.get("version")
        if version != PLAN_VERSION:
            raise ValueError(
                f"Plan.load: {json_path} has plan format version {version!r}; this clusterlm reads version "
                f"{PLAN_VERSION}. Make the plan again with this clusterlm, or use the clusterlm that wrote it."
            )
        arrays = meta.get("arrays") or {}
        npz_path = directory / arrays.get("file", _NPZ)
        if not npz_path.is_file():
            raise FileNotFoundError(f"Plan.load: {npz_path} is missing; plan.json alone is not a plan. Save it again.")
        raw = npz_path.read_bytes()
        if arrays.get("sha256") and hashlib.sha256(raw).hexdigest() != arrays["sha256"]:
            raise ValueError(
                f"Plan.load: {npz_path} does not belong to {json_path} (sha256 differs): the directory holds parts "
                "of two different saves. Save the plan again."
            )
        with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
            missing = [k for k in _ARRAYS if k not in npz.files]
            if missing:
                raise ValueError(f"Plan.load: {npz_path} lacks the arrays {missing}. Save the plan again.")
            data = {k: npz[k] for k in _ARRAYS}
        rank_indices = data["rank_indices"]
        if rank_indices.ndim != 2 or rank_indices.shape[0] != meta.get("world_size"):
            raise ValueError(
                f"Plan.load: rank_indices has shape {rank_indices.shape}, expected "
                f"(world_size={meta.get('world_size')}, m)."
            )
        return cls(
            world_size=int(meta["world_size"]),
            rank_indices=list(rank_indices),
            weights=data["weights"],
            cluster_labels=data["cluster_labels"],
            distances=data["distances"],
            cluster_sizes=data["cluster_sizes"],
            lengths=data["lengths"],
            fingerprint=dict(meta["fingerprint"]),
            model_id=meta["model_id"],
            config=meta.get("config") or {},
            timings=meta.get("timings") or {},
            stats=meta.get("stats") or {},
            version=version,
        )
