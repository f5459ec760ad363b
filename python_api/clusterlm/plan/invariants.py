"""The invariants of a plan, checked on construction, before a save and after a load (:class:`PlanInvariants`).

Equal per-rank lists of distinct indices in range, arrays whose shapes agree, finite non-negative weights that are 0
outside the selection and have mean 1 over it, cluster labels and sizes that agree, and records (config, timings,
stats) that JSON can store (:func:`jsonable`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from clusterlm.plan.fileformat import PLAN_VERSION, READABLE_VERSIONS, SIGNAL_ARRAYS

__all__ = ["PlanInvariants", "jsonable"]

# Mean weight over the selection must be 1; float64 sums of up to millions of weights stay far inside this.
_MEAN_RTOL = 1e-9


def jsonable(obj: Any, where: str) -> Any:
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
            out[k] = jsonable(v, f"{where}[{k!r}]")
        return out
    if isinstance(obj, (list, tuple)):
        return [jsonable(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    raise TypeError(
        f"Plan.{where}: {type(obj).__name__} cannot be stored in plan.json; use numbers, strings, lists and dicts."
    )


class PlanInvariants:
    """:meth:`validate` and its parts (a base of :class:`clusterlm.plan.Plan`, whose fields they check)."""

    def validate(self) -> None:
        """Check every internal invariant of the plan.

        Raises:
            ValueError: wrong world size or version, unequal or non-1-D per-rank lists, indices out of
                range or repeated (within or across ranks), arrays whose shapes disagree (the optional gradient
                norms and losses too; non-finite ones, negative norms), negative or
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
        if isinstance(self.version, bool) or self.version not in READABLE_VERSIONS:
            raise ValueError(
                f"Plan.version: this clusterlm handles plan format versions {READABLE_VERSIONS} (it writes "
                f"{PLAN_VERSION}), got {self.version!r}."
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
        for name in SIGNAL_ARRAYS:  # optional: the per-example signals of the features
            values = getattr(self, name, None)
            if values is None:
                continue
            if values.shape != (n,):
                raise ValueError(f"Plan.{name}: expected shape ({n},) like weights, or None, got {values.shape}.")
            if not np.isfinite(values).all() or (name == "grad_norms" and (values < 0).any()):
                raise ValueError(f"Plan.{name}: must be finite{' and >= 0' if name == 'grad_norms' else ''}.")
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
                "compute weights with clusterlm.selection.allocation.selection_weights."
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
                jsonable(value, name)
            except TypeError as e:
                raise ValueError(str(e)) from None
