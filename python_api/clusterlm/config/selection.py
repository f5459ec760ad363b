"""Every selection setting in one object: :class:`SelectConfig`, its presets as data, and :meth:`SelectConfig.resolve`.

The command line, ``compare``, the trainer integrations and the Python API build one ``SelectConfig``; the
selection reads it and nothing else. Settings are checked in one place, in two steps of the same code:

* :meth:`SelectConfig.check` before a model or data set is loaded (everything that needs no data);
* :meth:`SelectConfig.resolve` with the data's size and lengths, before any feature is computed: budgets,
  cluster-size bounds, the preset's defaults; it returns the :class:`ResolvedSelection` the later stages use.

A preset (:data:`PRESETS`) is data: its defaults (seed, clustering, features, feature window, restarts, token
balance) and the settings it fixes. ``"paper"`` reproduces the authors' code (:mod:`clusterlm.selection.paper`),
``"default"`` is this library's method (:mod:`clusterlm.select`'s docstring).

One name per concept, from the command line to the kernel (docs/architecture.md has the table):
``world_size`` ranks, ``n_clusters`` clusters (``world_size * clusters_per_rank``), ``min_cluster_size`` /
``max_cluster_size`` (the kernel's ``min_size`` / ``max_size``), ``feature_tokens`` (the feature window),
``features`` (which gradients: a preset name or module names), ``normalize``.
"""

from __future__ import annotations

import math
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

import numpy as np

from clusterlm.config.base import Config
from clusterlm.config.budget import check_int, cluster_size_bound, resolve_any_budget, resolve_budget
from clusterlm.config.defaults import (
    ALLOCATIONS,
    DEFAULT_BATCH_TOKENS,
    DEFAULT_FEATURE_TOKENS,
    DEFAULT_MAX_LENGTH,
    LAYER_PRESETS,
    PAPER_CAP,
    PAPER_N_INIT,
    PAPER_SEED,
    WITHIN_CLUSTER,
)
from clusterlm.config.files import check_keys, field_value, to_dict
from clusterlm.config.readers import (
    dim_arg,
    feature_tokens_arg,
    features_arg,
    fraction_arg,
    max_length_arg,
    non_negative_int_arg,
    on_off_arg,
    positive_int_arg,
    size_arg,
)

SELECT_CONFIG = "select_config.yaml"  # in OUT: the resolved job (clusterlm select --config reads it back)

__all__ = [
    "SELECT_CONFIG",
    "CLUSTERINGS",
    "DEFAULT_BATCH_TOKENS",
    "PRESETS",
    "TOKEN_BALANCE_SLACK",
    "Preset",
    "ResolvedSelection",
    "SelectConfig",
    "SelectJob",
    "paper_percentage",
    "resolve_feature_tokens",
    "resolve_seed",
]

CLUSTERINGS = ("authors", "exact")
# Token balancing may exchange up to this fraction of each cluster's pick (its last, least-far members)
# for the next candidates in pick order, so that every rank trains on about the same number of tokens.
TOKEN_BALANCE_SLACK = 0.1


def paper_percentage(ratio: float) -> int:
    """``ratio`` as the integer percentage their ``--ratio`` takes (0.31 -> 31).

    Raises:
        ValueError: ``ratio`` is not a whole percentage in [1, 100].
    """
    pct = round(float(ratio) * 100)
    if not 1 <= pct <= 100 or not math.isclose(pct, float(ratio) * 100, rel_tol=0, abs_tol=1e-6):
        raise ValueError(
            f"select: preset='paper' takes the ratio as a whole percentage in [1, 100] (the authors' --ratio is an "
            f"int), got ratio={ratio!r}; use e.g. ratio={max(1, min(100, pct)) / 100:g}, or preset='default'."
        )
    return int(pct)


@dataclass(frozen=True)
class Preset:
    """A preset's defaults and the settings it fixes.

    Attributes:
        name: ``"default"`` or ``"paper"``.
        seed / clustering / features / feature_tokens / n_init / token_balance: the defaults of those settings.
        fixed: settings the preset fixes to these values (any other value is refused).
        ratio_only: the budget must be given as ``ratio`` (the authors' whole-percentage ``--ratio``).
        whole_examples: the features look at whole examples (no feature window may be set).
        picks: ``"paper"`` (the authors' smallest-cluster rule) or ``"budget"`` (the requested count, exactly).
    """

    name: str
    seed: int
    clustering: str
    features: str
    feature_tokens: int | None
    n_init: int
    token_balance: bool
    fixed: Mapping[str, Any] = field(default_factory=dict)
    ratio_only: bool = False
    whole_examples: bool = False
    picks: str = "budget"

    def normalize(self, world_size: int) -> bool:
        """L2-normalise the features in the selection step (the authors do when ``world_size > 1``)."""
        return self.picks == "paper" and world_size > 1


PRESETS: dict[str, Preset] = {
    "default": Preset(name="default", seed=0, clustering="exact", features="lm_head",
                      feature_tokens=DEFAULT_FEATURE_TOKENS, n_init=3, token_balance=True),
    "paper": Preset(name="paper", seed=PAPER_SEED, clustering="authors", features="paper", feature_tokens=None,
                    n_init=PAPER_N_INIT, token_balance=False,
                    fixed={"max_cluster_size": "1.5x", "min_cluster_size": "budget", "within_cluster": "farthest",
                           "allocation": "cluster-per-rank", "clusters_per_rank": 1},
                    ratio_only=True, whole_examples=True, picks="paper"),
}


def _preset(name: Any) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"select: preset must be one of {tuple(PRESETS)}, got {name!r}.")
    return PRESETS[name]


def resolve_seed(preset: str, seed: int | None) -> int:
    """The seed a selection uses: ``seed``, or the preset's default (42 for ``"paper"``, as the authors', else 0).

    Raises:
        ValueError: ``seed`` is not None or an int >= 0.
    """
    if seed is None:
        return _preset(preset).seed
    return check_int(seed, "seed", 0)


def resolve_feature_tokens(preset: str, feature_tokens: int | str | None) -> int | None:
    """The featurizer's ``feature_tokens`` for ``feature_tokens`` under ``preset`` (None = whole examples).

    Raises:
        ValueError: ``feature_tokens`` is not None, ``"all"`` or an int >= 2; a window with the paper preset.
    """
    p = _preset(preset)
    if feature_tokens is None:
        return p.feature_tokens
    if feature_tokens == "all":
        return None
    if isinstance(feature_tokens, bool) or not isinstance(feature_tokens, int) or feature_tokens < 2:
        raise ValueError(
            f"select: feature_tokens must be None (the preset's default), 'all' (whole examples) or an int >= 2, "
            f"got {feature_tokens!r}."
        )
    if p.whole_examples:
        raise ValueError(
            f"select: preset='paper' featurizes whole examples (the authors' proxy), got feature_tokens="
            f"{feature_tokens}; use preset='default' for a feature window."
        )
    return feature_tokens


def _check_choices(allocation: str, within_cluster: str, token_balance_slack: float) -> None:
    if allocation not in ALLOCATIONS:
        raise ValueError(f"select: allocation must be one of {ALLOCATIONS}, got {allocation!r}.")
    if within_cluster not in WITHIN_CLUSTER:
        raise ValueError(f"select: within_cluster must be one of {WITHIN_CLUSTER}, got {within_cluster!r}.")
    if not 0 <= token_balance_slack <= 1:
        raise ValueError(f"select: token_balance_slack must be in [0, 1], got {token_balance_slack!r}.")


def _check_fixed(p: Preset, given: Mapping[str, Any]) -> None:
    """The preset fixes these settings to its values: refuse any other value."""
    for name, value in p.fixed.items():
        if given[name] != value:
            raise ValueError(
                f"select: preset='{p.name}' reproduces the authors' algorithm, which fixes {name}; got "
                f"{name}={given[name]!r}. Use preset='default' to change it."
            )


def _check_clustering(p: Preset, clustering: str | None) -> str:
    if clustering is None:
        return p.clustering
    if clustering not in CLUSTERINGS:
        raise ValueError(f"select: clustering must be one of {CLUSTERINGS}, got {clustering!r}.")
    if clustering == "authors" and p.picks != "paper":
        raise ValueError(
            "select: clustering='authors' (sklearn K-means + the authors' greedy cap) belongs to preset='paper'; "
            "the default preset clusters with exact capacities (clustering='exact')."
        )
    return clustering


def _resolve_features(p: Preset, features: Any) -> str | list[str]:
    """``features`` checked (a preset name or a non-empty list of module names), or the preset's default."""
    if features is None:
        return p.features
    if isinstance(features, str):
        if features not in LAYER_PRESETS:
            raise ValueError(
                f"select: features must be one of {LAYER_PRESETS} or a list of module names, got {features!r}; "
                "pass module names as a list (features=['model.layers.0.mlp.down_proj']; on the command line "
                "--features a,b)."
            )
    elif not isinstance(features, Sequence) or not features or not all(isinstance(f, str) and f for f in features):
        raise TypeError(
            f"select: features must be a preset name or a non-empty list of module names, got {features!r}."
        )
    elif len(set(features)) != len(features):
        raise ValueError(f"select: features lists a module twice: {list(features)}.")
    if p.whole_examples and features != p.features:
        raise ValueError(
            f"select: preset='{p.name}' uses the authors' gradient proxy (features='{p.features}'), got "
            f"features={features!r}; use preset='default' for other features."
        )
    return features if isinstance(features, str) else list(features)


def _check_fraction(value: Any, name: str, example: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1):
        raise ValueError(f"select: {name} must be in (0, 1], got {value!r}; e.g. {name}=0.31 keeps 31 % of {example}.")


def _check_bounds(lo: int | None, hi: int | None, n: int, n_clusters: int, min_cluster_size: Any,
                  max_cluster_size: Any) -> None:
    """Cluster-size bounds that some clustering of ``n`` examples into ``n_clusters`` clusters meets."""
    shown_lo = f"min_cluster_size={min_cluster_size!r}" + (f" (= {lo})" if str(lo) != str(min_cluster_size) else "")
    shown_hi = f"max_cluster_size={max_cluster_size!r}" + (f" (= {hi})" if str(hi) != str(max_cluster_size) else "")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"select: {shown_lo} is above {shown_hi}; lower min_cluster_size or raise max_cluster_size.")
    if hi is not None and hi * n_clusters < n:
        raise ValueError(
            f"select: {shown_hi} x {n_clusters} clusters holds {hi * n_clusters} of the {n} examples; raise "
            f"max_cluster_size to at least {math.ceil(n / n_clusters)} (or 'none')."
        )
    if lo is not None and lo * n_clusters > n:
        raise ValueError(
            f"select: {shown_lo} x {n_clusters} clusters needs {lo * n_clusters} examples, the data has {n}; lower "
            f"min_cluster_size to at most {n // n_clusters}."
        )


@dataclass(frozen=True)
class ResolvedSelection:
    """What a :class:`SelectConfig` resolves to for one data set, before any feature is computed."""

    preset: Preset
    n: int  # examples the settings were resolved for
    world_size: int
    clusters_per_rank: int
    n_clusters: int
    seed: int
    features: str | list[str]
    feature_tokens: int | None  # the featurizer's window (None = whole examples)
    requested: int  # examples requested (for a token budget: what it buys at the mean length)
    tokens: int | None  # the token budget, or None for an example budget
    ratio: float | None  # the paper preset's ratio (a budget is converted to one)
    min_cluster_size: int | None
    max_cluster_size: int | None
    n_init: int
    within_cluster: str
    allocation: str
    token_balance: bool
    token_balance_slack: float
    per_cluster: int  # the default preset's per-cluster pick (the paper preset's comes after clustering)
    normalize: bool  # L2-normalise the features before K-means (the paper preset with world_size > 1)
    clustering: str  # "authors" (sklearn K-means + their greedy soft cap) or "exact" (capacity K-means)
    percentage: int | None  # the paper preset's ratio as their integer --ratio (0.31 -> 31)

    @property
    def rebalance(self) -> bool:
        """Exchange picks for equal rank token totals (cluster-per-rank allocation only)."""
        return (self.token_balance and self.allocation == "cluster-per-rank" and self.world_size > 1
                and self.token_balance_slack > 0)

    def spare(self, per_cluster: int) -> int:
        """Candidates per cluster beyond the pick that token balancing may swap in."""
        return math.ceil(self.token_balance_slack * per_cluster) if self.rebalance else 0


@dataclass(frozen=True)
class SelectConfig(Config):
    """Every setting of a selection (:func:`clusterlm.select`), with the defaults of the ``"default"`` preset.

    Attributes:
        world_size: number of ranks (GPUs) K that will train (required).
        ratio / budget: fraction or number of examples to keep (exactly one of these four).
        token_ratio / token_budget: fraction or number of tokens (prompt + answer) to keep instead; every cluster
            gives the same count, chosen so that the selected tokens meet the budget up to one example per
            cluster (:func:`clusterlm.config.budget.count_for_tokens`). Default preset only.
        preset: ``"default"`` or ``"paper"`` (:data:`PRESETS`; the paper preset fixes ``max_cluster_size``,
            ``min_cluster_size``, ``within_cluster``, ``allocation``, ``clusters_per_rank``).
        features: gradient features (:class:`clusterlm.GradientFeaturizer` ``features``): ``"lm_head"``,
            ``"paper"``, ``"all-linear"``, ``"lora"`` or module names; None = the preset's.
        dim: projected feature size (int or ``(k_o, k_i)``; default ``(32, 32)``).
        feature_tokens: feature window in tokens per example; None = the preset's (64 for ``"default"``,
            whole examples for ``"paper"``); ``"all"`` = whole examples.
        seed: seeds projections, K-means, random picks and visit orders (None: 0; 42 for ``"paper"``).
        clustering: ``"authors"`` (paper preset default: their sklearn K-means and greedy soft cap) or
            ``"exact"`` (this library's capacity K-means; the only choice of the default preset).
        max_cluster_size / min_cluster_size: per-cluster bounds: an int, ``"<f>x"`` (times N / C),
            ``"budget"`` (the per-cluster pick) or None.
        within_cluster: which members of a cluster are kept (:mod:`clusterlm.selection.picking`, docs/selection.md):
            ``"farthest"`` from the centroid (the method's) | ``"nearest"`` | ``"random"`` | ``"kcenter"``; or on the
            per-example signals computed with the features: ``"grad-norm"`` / ``"loss"`` (largest first),
            ``"rank-farthest-loss"`` / ``"rank-farthest-grad-norm"`` (rank sum with the distance),
            ``"alternate-loss-farthest"`` (the hardest and the farthest in turn).
        allocation: ``"cluster-per-rank"`` | ``"stratified"``.
        token_balance: align per-step token counts across ranks (None: the preset's, on for ``"default"``).
        clusters_per_rank: clusters C / K per rank.
        token_balance_slack: fraction of each cluster's pick that token balancing may exchange (0 keeps the pure
            pick).
        n_init: k-means++ restarts (None: 3; 10 for ``"paper"``).
        max_iter: Lloyd iterations per restart.
        kmeans_backend: backend of :func:`cluster_kernels.capacity_kmeans`.
        batch_tokens: padded tokens per featurization forward (None: the default, 8192).
    """

    world_size: int | None = field(default=None, metadata={"parse": positive_int_arg})
    ratio: float | None = field(default=None, metadata={"parse": fraction_arg})
    budget: int | None = field(default=None, metadata={"parse": positive_int_arg})
    token_ratio: float | None = field(default=None, metadata={"parse": fraction_arg})
    token_budget: int | None = field(default=None, metadata={"parse": positive_int_arg})
    preset: str = field(default="default", metadata={"choices": ("default", "paper")})
    features: str | Sequence[str] | None = field(default=None, metadata={"parse": features_arg})
    dim: int | tuple[int, int] | None = field(default=None, metadata={"parse": dim_arg})
    feature_tokens: int | str | None = field(default=None, metadata={"parse": feature_tokens_arg})
    seed: int | None = field(default=None, metadata={"parse": non_negative_int_arg})
    clustering: str | None = field(default=None, metadata={"choices": CLUSTERINGS})
    max_cluster_size: int | str | None = field(default="1.5x", metadata={"parse": size_arg})
    min_cluster_size: int | str | None = field(default="budget", metadata={"parse": size_arg})
    within_cluster: str = field(default="farthest", metadata={"choices": WITHIN_CLUSTER})
    allocation: str = field(default="cluster-per-rank", metadata={"choices": ALLOCATIONS})
    token_balance: bool | None = field(default=None, metadata={"parse": on_off_arg, "metavar": "{on,off}"})
    clusters_per_rank: int = field(default=1, metadata={"parse": positive_int_arg})
    token_balance_slack: float = TOKEN_BALANCE_SLACK
    n_init: int | None = field(default=None, metadata={"parse": positive_int_arg})
    max_iter: int = field(default=100, metadata={"parse": positive_int_arg})
    kmeans_backend: str = field(default="auto", metadata={"choices": ("auto", "cpu", "cuda", "torch")})
    batch_tokens: int | None = field(default=None, metadata={"parse": positive_int_arg})

    OWNER: ClassVar[str] = "select"

    def check(self) -> None:
        """Every check that needs no data, before a model or data set is loaded.

        Raises:
            ValueError / TypeError: the first bad setting, named, with the fix.
        """
        self._check_data_free()

    def _check_data_free(self) -> dict[str, Any]:
        """Check what needs no data; the settings that resolve without data (the preset's defaults applied)."""
        p = _preset(self.preset)
        _check_choices(self.allocation, self.within_cluster, self.token_balance_slack)
        features = _resolve_features(p, self.features)
        if self.world_size is None:
            raise ValueError("select: world_size is required: the number of ranks (GPUs) that will train.")
        check_int(self.world_size, "world_size")
        check_int(self.clusters_per_rank, "clusters_per_rank")
        seed = resolve_seed(self.preset, self.seed)
        clustering = _check_clustering(p, self.clustering)
        self._check_budget_forms(p)
        for name in ("max_cluster_size", "min_cluster_size"):
            cluster_size_bound(getattr(self, name), name, 1, 1, 1)  # the form; the values are checked with the data
        _check_fixed(p, {name: getattr(self, name) for name in p.fixed})
        feature_tokens = resolve_feature_tokens(self.preset, self.feature_tokens)
        if self.batch_tokens is not None:
            check_int(self.batch_tokens, "batch_tokens")
        check_int(self.max_iter, "max_iter")
        if self.n_init is not None:
            check_int(self.n_init, "n_init")
        return {"preset": p, "seed": seed, "features": features, "feature_tokens": feature_tokens,
                "clustering": clustering}

    def _check_budget_forms(self, p: Preset) -> None:
        """One budget, in range as far as it can be told without the data (its size is checked later)."""
        given = {k: getattr(self, k) for k in ("ratio", "budget", "token_ratio", "token_budget")
                 if getattr(self, k) is not None}
        if len(given) != 1:
            raise ValueError(
                "select: give exactly one of ratio / budget (examples) or token_ratio / token_budget (tokens), got "
                + (", ".join(f"{k}={v!r}" for k, v in given.items()) or "none") + "."
            )
        _check_fraction(self.ratio, "ratio", "the examples")
        _check_fraction(self.token_ratio, "token_ratio", "the tokens")
        for name in ("budget", "token_budget"):
            if name in given:
                check_int(given[name], name)
        if p.ratio_only:
            if self.ratio is None:
                raise ValueError(
                    f"select: preset='{p.name}' takes ratio= (the authors' --ratio, a whole percentage), got "
                    f"{', '.join(f'{k}={v!r}' for k, v in given.items())}; pass ratio=, or use preset='default'."
                )
            paper_percentage(self.ratio)

    def resolve(self, n: int, lengths: Any = None) -> ResolvedSelection:
        """Check every setting against a data set of ``n`` examples and resolve the preset's defaults.

        Args:
            n: number of examples.
            lengths: (n,) tokens per example (for a token budget); default all ones.

        Returns:
            The :class:`ResolvedSelection`.

        Raises:
            ValueError / TypeError: the first bad setting, named, with the fix: a budget above the data, more
                clusters than examples, cluster-size bounds that no clustering can meet.
        """
        resolved = self._check_data_free()
        p = resolved["preset"]
        if n == 0:
            raise ValueError("select: the data set is empty.")
        lengths = check_lengths(lengths, n)
        world_size, clusters_per_rank = int(self.world_size), int(self.clusters_per_rank)
        n_clusters = world_size * clusters_per_rank
        if n < n_clusters:
            raise ValueError(
                f"select: {n} examples cannot fill {n_clusters} clusters (world_size={world_size} x "
                f"clusters_per_rank={clusters_per_rank}); use fewer ranks or more data."
            )
        tokens = resolve_any_budget(n, lengths, self.ratio, self.budget, self.token_ratio, self.token_budget,
                                    self.preset)
        if tokens is None:
            requested = resolve_budget(n, self.ratio, self.budget)
        else:
            # Examples the token budget buys at the mean length: the per-cluster lower bound for K-means.
            requested = min(n, max(n_clusters, round(tokens / max(float(lengths.mean()), 1.0))))
        common = {**resolved, "n": n, "world_size": world_size, "clusters_per_rank": clusters_per_rank,
                  "n_clusters": n_clusters, "requested": requested, "tokens": tokens,
                  "within_cluster": self.within_cluster, "allocation": self.allocation,
                  "token_balance_slack": float(self.token_balance_slack),
                  "n_init": p.n_init if self.n_init is None else int(self.n_init),
                  "token_balance": p.token_balance if self.token_balance is None else bool(self.token_balance),
                  "normalize": p.normalize(world_size)}
        if p.picks == "paper":
            return ResolvedSelection(**common, ratio=float(self.ratio), percentage=paper_percentage(self.ratio),
                                     min_cluster_size=None, max_cluster_size=math.ceil(PAPER_CAP * n / n_clusters),
                                     per_cluster=0)
        per_cluster = requested // n_clusters
        if per_cluster < 1:
            raise ValueError(
                f"select: a budget of {requested} examples gives less than one example to each of {n_clusters} "
                f"clusters; raise ratio/budget to at least {n_clusters} examples or use fewer clusters."
            )
        lo = cluster_size_bound(self.min_cluster_size, "min_cluster_size", n, n_clusters, per_cluster)
        hi = cluster_size_bound(self.max_cluster_size, "max_cluster_size", n, n_clusters, per_cluster)
        _check_bounds(lo, hi, n, n_clusters, self.min_cluster_size, self.max_cluster_size)
        return ResolvedSelection(**common, ratio=self.ratio, percentage=None, min_cluster_size=lo,
                                 max_cluster_size=hi, per_cluster=per_cluster)

    def record(self, r: ResolvedSelection, feature_dim: int) -> dict[str, Any]:
        """What a plan records of this selection (``Plan.config``)."""
        return {
            "method": "cluster",
            "preset": self.preset,
            "world_size": r.world_size,
            "ratio": None if r.ratio is None else float(r.ratio),
            "budget": None if self.budget is None else int(self.budget),
            "token_ratio": None if self.token_ratio is None else float(self.token_ratio),
            "token_budget": None if self.token_budget is None else int(self.token_budget),
            "seed": r.seed,
            "clustering": r.clustering,
            "max_cluster_size": self.max_cluster_size,
            "min_cluster_size": self.min_cluster_size,
            "within_cluster": self.within_cluster,
            "allocation": self.allocation,
            "token_balance": r.token_balance,
            "clusters_per_rank": r.clusters_per_rank,
            "token_balance_slack": float(self.token_balance_slack) if r.rebalance else 0.0,
            "n_init": r.n_init,
            "max_iter": int(self.max_iter),
            "feature_dim": int(feature_dim),
            "normalized_in_select": r.normalize,
        }


def check_lengths(lengths: Any, n: int) -> np.ndarray:
    """Tokens per example as an (n,) int64 array (all ones when None).

    Raises:
        ValueError: a shape other than (n,).
    """
    lengths = np.ones(n, dtype=np.int64) if lengths is None else np.asarray(lengths, dtype=np.int64)
    if lengths.shape != (n,):
        raise ValueError(f"select: lengths must have shape ({n},) like the features' rows, got {lengths.shape}.")
    return lengths


@dataclass(frozen=True)
class SelectJob(Config):
    """One selection run: inputs, outputs and the selection settings.

    Attributes:
        model: built-in name (tiny-llama, tiny-llama-pretrained, smollm2-135m-instruct), a .gguf file, a local
            Hugging Face directory or a cached hub id.
        data: the training data file (.jsonl / .json / .parquet with prompt/response, instruction/input/output or
            messages columns).
        out: directory for plan.json, plan.npz, report.png, select_config.yaml (and features/).
        config: the selection settings (their options are SelectConfig's fields).
        max_length: truncate examples to this many tokens.
        chat_template: render prompt/response data through the tokenizer's chat template (auto: when it has one).
        feature_store: keep the features there instead of OUT/features (resumable).
        progress: progress bars and stage lines (--no-progress: none).
        device: where the model and the features run: auto (CUDA when present, cuda:LOCAL_RANK under torchrun),
            cpu, cuda, cuda:N.
        dtype: the weights' dtype, loaded straight onto the device: auto (bfloat16 on a CUDA device that supports
            it, else float32), float32, bfloat16, float16.
        nproc: selection processes on this machine (torch.distributed.run; sharded features and distributed
            K-means; the plan is the same as with 1).
        max_restarts: with nproc > 1, restart every process after one fails, up to N times; the restarted run
            keeps the feature shards already stored and gives the same plan (torchrun's elastic agent).
        dist_timeout: seconds a collective may wait for the other processes before the run fails (default: torch's
            30 minutes).
        debug: the ranks of a spawned run print tracebacks too.
    """

    model: str | None = None
    data: str | None = None
    out: str | os.PathLike | None = field(default=None, metadata={"parse": str})
    config: SelectConfig = field(default_factory=SelectConfig, metadata={"cli": False})
    max_length: int = field(default=DEFAULT_MAX_LENGTH, metadata={"parse": max_length_arg})
    chat_template: Literal["auto", "on", "off"] = "auto"
    feature_store: str | None = None
    progress: bool = True
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    nproc: int = field(default=1, metadata={"parse": positive_int_arg})
    max_restarts: int = field(default=0, metadata={"parse": non_negative_int_arg})
    dist_timeout: float | None = None
    debug: bool = field(default=False, metadata={"cli": False})

    COMMAND: ClassVar[str] = "select"

    def to_dict(self) -> dict[str, Any]:
        """Plain data, flat: the job's fields and the selection settings side by side (what select_config.yaml
        holds; ``debug`` is left out)."""
        job = {k: v for k, v in to_dict(self).items() if k not in ("config", "debug")}
        return {**job, **to_dict(self.config)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "SelectJob") -> SelectJob:
        """The job of a flat mapping (job fields and SelectConfig fields; an unknown name is refused, naming the
        closest field)."""
        job_names = {f.name for f in fields(cls)} - {"config"}
        job = {k: v for k, v in data.items() if k in job_names}
        settings = {k: v for k, v in data.items() if k not in job_names}
        check_keys(settings, SelectConfig, where)
        hints = typing.get_type_hints(SelectConfig)
        settings = {k: field_value(hints[k], v) for k, v in settings.items()}
        return cls(**job, config=SelectConfig(**settings))

    def check(self) -> None:
        """The job's required fields and every selection setting (:meth:`SelectConfig.check`); no data needed.

        Raises:
            ValueError / TypeError: a missing --model/--data/--out, or a bad setting (named).
        """
        missing = [f"--{n}" for n in ("model", "data", "out") if getattr(self, n) is None]
        if missing:
            raise ValueError(f"select: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required (an "
                             "option, or a field of the --config file).")
        if not isinstance(self.config, SelectConfig):
            raise TypeError(f"select: config must be a SelectConfig, got {type(self.config).__name__}.")
        self.config.check()
