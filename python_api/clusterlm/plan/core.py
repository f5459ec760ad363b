"""The Plan: its fields, their per-rank views, the checks against data and model, and its files.

The invariants are :class:`~clusterlm.plan.invariants.PlanInvariants`', the text summary
:class:`~clusterlm.plan.summary.PlanSummary`'s, the file format :mod:`clusterlm.plan.fileformat`'s; the
:mod:`clusterlm.plan`
docstring describes the weights.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from clusterlm.plan.fileformat import PLAN_VERSION, SIGNAL_ARRAYS, read_plan_files, write_plan_files
from clusterlm.plan.invariants import PlanInvariants, jsonable
from clusterlm.plan.summary import PlanSummary

__all__ = ["Plan", "same_model"]

_MODEL_HASH = re.compile(r"[0-9a-f]{12}")


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


def same_model(a: str, b: str) -> bool:
    """Two model ids name the same model: their weights hashes agree (``label@hash``), else the ids are equal."""
    ha, hb = a.rpartition("@")[2], b.rpartition("@")[2]
    if _MODEL_HASH.fullmatch(ha) and _MODEL_HASH.fullmatch(hb):
        return ha == hb
    return a == b


@dataclass(eq=False)
class Plan(PlanInvariants, PlanSummary):
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
        version: format version of the files it was read from (:data:`clusterlm.plan.fileformat.PLAN_VERSION` for a
            new plan, and what :meth:`save` always writes).
        grad_norms: (N,) float64 norm of every example's gradient feature before normalisation, or None (a plan
            made without features, or saved before they were kept): with :attr:`losses`, why an example was picked.
        losses: (N,) float64 mean answer-token loss of every example in its feature window (from the featurizer's
            forward pass), or None.

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
    grad_norms: np.ndarray | None = None
    losses: np.ndarray | None = None

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
        for name in SIGNAL_ARRAYS:
            if getattr(self, name) is not None:
                setattr(self, name, _as_float64(getattr(self, name), name))
        self.validate()

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
        from clusterlm.data import fingerprint  # torch: not imported by a process that only reads plans

        data_fp = fingerprint(dataset)
        problems = []
        plan_size, data_size = int(self.fingerprint["size"]), int(data_fp["size"])
        if plan_size != data_size:
            problems.append(f"plan was made for {plan_size} examples, the data set has {data_size}")
        elif self.fingerprint["sha256"] != data_fp["sha256"]:
            problems.append(self._tokenisation_hint(dataset) or (
                f"content hash differs: plan {str(self.fingerprint['sha256'])[:12]}.., data "
                f"{str(data_fp['sha256'])[:12]}.. — the data changed or is in another order"
            ))
        if world_size is not None and int(world_size) != self.world_size:
            problems.append(f"plan is for world size {self.world_size}, this run has {int(world_size)} processes")
        if problems:
            raise ValueError(
                "Plan.verify: " + "; ".join(problems) + ". Make a new plan for this data and world size "
                "(clusterlm select) or use the data the plan was made for."
            )

    def _tokenisation_hint(self, dataset: Any) -> str | None:
        """Why the tokens differ, when the plan's recorded tokenisation is not this data's (else None)."""
        recorded = self.config.get("data") if isinstance(self.config, Mapping) else None
        if not isinstance(recorded, Mapping):
            return None
        used, rendering = getattr(dataset, "max_length", None), getattr(dataset, "rendering", None)
        if "max_length" in recorded and recorded["max_length"] != used:
            return (f"the plan was selected on data tokenised with --max-length {recorded['max_length']}, this data "
                    f"with {used}: pass --max-length {recorded['max_length']} (train's default is the plan's)")
        if recorded.get("rendering") and rendering and recorded["rendering"] != rendering:
            return (f"the plan's data was rendered {recorded['rendering']!r}, this data {rendering!r}: pass the "
                    "--chat-template the plan was made with")
        return None

    def check_model(self, model_id: str, *, allow_other_model: bool = False) -> bool:
        """Refuse to use the plan with a model other than the one its features came from.

        Ids compare by their weights hash (``label@hash``, :func:`clusterlm.models.compute_model_id`) when both
        carry one (the label is informative only), else as strings.

        Args:
            model_id: the id of the model about to be trained.
            allow_other_model: use the plan anyway: a warning instead of the error.

        Returns:
            True when the ids agree; False when they could not be compared (the plan has no model id: an old
            plan or one made without a model; a warning says so) or differ and ``allow_other_model`` is set.

        Raises:
            ValueError: the plan was made with another model and ``allow_other_model`` is False.
        """
        mine, theirs = self.model_id or "", model_id or ""
        if not mine or not theirs:
            missing = "this plan has no model id (an old plan, or one made without a model)" if not mine else (
                "no model id given")
            warnings.warn(
                f"Plan.check_model: {missing}; cannot check that the plan was made with model {theirs or '?'}.",
                UserWarning,
                stacklevel=2,
            )
            return False
        if same_model(mine, theirs):
            return True
        if not allow_other_model:
            raise ValueError(
                f"Plan.check_model: the plan was made with model {mine}, this is model {theirs}: another model's "
                "features select other examples. Make a plan with this model (clusterlm select), or pass "
                "--allow-other-model / allow_other_model=True to use it anyway."
            )
        warnings.warn(
            f"Plan.check_model: the plan was made with model {mine}, this is model {theirs}; using it anyway "
            "(allow_other_model=True).",
            UserWarning,
            stacklevel=2,
        )
        return False

    # ---- files ------------------------------------------------------------------------------------

    def _arrays(self) -> dict[str, np.ndarray]:
        return {
            "rank_indices": np.stack(self.rank_indices).astype(np.int64),
            "weights": self.weights,
            "cluster_labels": self.cluster_labels,
            "distances": self.distances,
            "lengths": self.lengths,
            "cluster_sizes": self.cluster_sizes,
        } | {name: getattr(self, name) for name in SIGNAL_ARRAYS if getattr(self, name) is not None}

    def _summary_fields(self) -> dict[str, Any]:
        """plan.json's summaries of the arrays (:data:`clusterlm.plan.fileformat.SUMMARY_FIELDS`), as JSON values."""
        return {
            "n_examples": self.n_examples,
            "n_selected": self.n_selected,
            "per_rank": self.per_rank,
            "cluster_sizes": self.cluster_sizes.tolist(),
            "clusters": [
                {"cluster": c, "size": n_c, "selected": s_c, "weight": w} for c, n_c, s_c, w in self._cluster_rows()
            ],
            "ranks": self._rank_rows(),
        }

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``plan.json`` and ``plan.npz`` into ``directory`` (created if needed), atomically and with
        checksums (:func:`clusterlm.plan.fileformat.write_plan_files`; always the current format version).

        Args:
            directory: target directory; existing plan files there are replaced.

        Returns:
            The directory.

        Raises:
            ValueError: the plan breaks an invariant (see :meth:`validate`).
        """
        self.validate()
        summary = self._summary_fields()
        fields = {
            "model_id": self.model_id,
            "world_size": int(self.world_size),
            "n_examples": summary["n_examples"],
            "n_selected": summary["n_selected"],
            "per_rank": summary["per_rank"],
            "fingerprint": jsonable(self.fingerprint, "fingerprint"),
            "config": jsonable(self.config, "config"),
            "timings": jsonable(self.timings, "timings"),
            "stats": jsonable(self.stats, "stats"),
            "cluster_sizes": summary["cluster_sizes"],
            "clusters": summary["clusters"],
            "ranks": summary["ranks"],
        }
        return write_plan_files(directory, fields, self._arrays())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """Read a plan written by :meth:`save`, checking that its two files are the ones saved together.

        Every check of the files (:func:`clusterlm.plan.fileformat.read_plan_files`) runs before any field is used; then
        the plan's invariants (:meth:`validate`) and plan.json's summaries against the arrays.

        Args:
            path: the plan directory or its ``plan.json``.

        Returns:
            The validated plan.

        Raises:
            FileNotFoundError: plan.json or plan.npz missing, or ``path`` is plan.npz (pass its directory).
            ValueError: not a plan file or a truncated one, an unsupported format version, a field missing or
                of the wrong type, a field edited after the save (its checksum differs, or a summary disagrees
                with plan.npz), arrays that do not belong to this plan.json, or a plan that breaks an
                invariant. Each message names the file and the field.

        Warns:
            UserWarning: a version-1 plan without checksums (edits cannot always be detected); arrays in plan.npz
                that are not a plan's (named; they are ignored).
        """
        files = read_plan_files(path, stacklevel=2)
        meta, data = files.meta, files.arrays
        plan = cls(
            world_size=int(meta["world_size"]),
            rank_indices=list(data["rank_indices"]),
            weights=data["weights"],
            cluster_labels=data["cluster_labels"],
            distances=data["distances"],
            cluster_sizes=data["cluster_sizes"],
            lengths=data["lengths"],
            fingerprint=dict(meta["fingerprint"]),
            model_id=meta.get("model_id", ""),
            config=meta.get("config") or {},
            timings=meta.get("timings") or {},
            stats=meta.get("stats") or {},
            version=meta["version"],
            **{name: data.get(name) for name in SIGNAL_ARRAYS},
        )
        files.check_summaries(plan._summary_fields())
        return plan
