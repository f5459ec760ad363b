"""Per-example signals that come free with the gradient features: the gradient norm and the loss.

The featurizer's forward pass computes each example's ``p_t(y_t)`` for its feature, so it has the example's answer-token
loss, and the feature before its L2 normalisation has a size: the norm of the example's projected gradient (how far
one step on that example would move the model; GraNd, Paul et al. 2021, ranks examples by it). Both are kept
(:class:`ExampleSignals`): in the feature store beside the features (:meth:`clusterlm.FeatureStore.signals`), in the
plan (``Plan.grad_norms``, ``Plan.losses``: why an example was picked), and for the within-cluster picks that use them
(:mod:`clusterlm.selection.picking`). The features K-means sees are unchanged.

- ``grad_norm``: the L2 norm of the example's feature before normalisation (for the projected features, the norm of
  ``P_out^T G P_in``, which preserves the norm of the chosen layers' gradient ``G`` in expectation; for the paper
  preset, the norm of the authors' proxy);
- ``loss``: the mean cross-entropy over the example's answer tokens inside its feature window (all of them without a
  window), from the same forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["SIGNAL_NAMES", "ExampleSignals"]

SIGNAL_NAMES = ("grad_norm", "loss")  # the columns of a signals array, in order


@dataclass(frozen=True, eq=False)
class ExampleSignals:
    """The free per-example signals of N examples (see the module docstring).

    Attributes:
        grad_norm: (N,) float64, the norm of each example's feature before normalisation.
        loss: (N,) float64, each example's mean answer-token loss in its feature window.

    Raises:
        ValueError: arrays that are not 1-D of one length, or hold NaN or infinite values, or negative norms.
    """

    grad_norm: np.ndarray
    loss: np.ndarray

    def __post_init__(self) -> None:
        norms = np.asarray(self.grad_norm, dtype=np.float64).reshape(-1)
        losses = np.asarray(self.loss, dtype=np.float64).reshape(-1)
        if np.ndim(self.grad_norm) != 1 or np.ndim(self.loss) != 1 or len(norms) != len(losses):
            raise ValueError(f"ExampleSignals: grad_norm and loss must be 1-D arrays of one length, got shapes "
                             f"{np.shape(self.grad_norm)} and {np.shape(self.loss)}.")
        if not (np.isfinite(norms).all() and np.isfinite(losses).all()) or (norms < 0).any():
            raise ValueError("ExampleSignals: grad_norm must be finite and >= 0 and loss finite for every example.")
        object.__setattr__(self, "grad_norm", norms)
        object.__setattr__(self, "loss", losses)

    def __len__(self) -> int:
        return len(self.loss)

    def __repr__(self) -> str:
        return f"ExampleSignals({len(self)} examples)"

    def as_array(self) -> np.ndarray:
        """(N, 2) float64, the columns in :data:`SIGNAL_NAMES` order (what the feature store keeps)."""
        return np.stack([self.grad_norm, self.loss], axis=1) if len(self) else np.zeros((0, 2), dtype=np.float64)

    @classmethod
    def from_array(cls, array: Any) -> ExampleSignals:
        """From an (N, 2) array whose columns are :data:`SIGNAL_NAMES`.

        Raises:
            ValueError: another shape (or the checks of the class).
        """
        arr = np.asarray(array, dtype=np.float64)
        if arr.ndim != 2 or arr.shape[1] != len(SIGNAL_NAMES):
            raise ValueError(f"ExampleSignals: expected an (N, {len(SIGNAL_NAMES)}) array of {SIGNAL_NAMES}, got "
                             f"shape {arr.shape}.")
        return cls(arr[:, 0].copy(), arr[:, 1].copy())

    @classmethod
    def concat(cls, parts: Sequence[ExampleSignals]) -> ExampleSignals:
        """The signals of consecutive row blocks, in order (none: zero examples)."""
        if not parts:
            return cls(np.zeros(0), np.zeros(0))
        return cls(np.concatenate([p.grad_norm for p in parts]), np.concatenate([p.loss for p in parts]))

    def take(self, rows: Any) -> ExampleSignals:
        """The signals of ``rows`` (indices or a slice), as a new object."""
        return ExampleSignals(self.grad_norm[rows], self.loss[rows])

    def column(self, name: str) -> np.ndarray:
        """The (N,) array of the signal ``name`` (one of :data:`SIGNAL_NAMES`).

        Raises:
            ValueError: an unknown name.
        """
        if name not in SIGNAL_NAMES:
            raise ValueError(f"ExampleSignals: unknown signal {name!r}; choose from {SIGNAL_NAMES}.")
        return getattr(self, name)
