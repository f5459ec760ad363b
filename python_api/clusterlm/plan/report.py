"""The selection report: a text summary and ``report.png`` for a saved plan.

``report.png`` has four panels: original cluster sizes next to the selected counts, the loss weight of
every cluster, a 2-D PCA map of the features coloured by cluster with the selected points marked,
and the cumulative tokens of every rank along its visit order (with the per-step max/mean ratio).
The PCA coordinates are computed once at selection time and stored beside the plan (``report_data.npz``: at most
``MAX_MAP_POINTS`` points, a seeded subsample), so ``clusterlm report DIR`` redraws without the model
or the features.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from clusterlm.fileio import atomic_write
from clusterlm.plan import Plan

__all__ = ["MAX_MAP_POINTS", "draw_report", "pca_2d", "save_report_data", "show_report"]

MAX_MAP_POINTS = 20_000
REPORT_DATA = "report_data.npz"
REPORT_PNG = "report.png"


def pca_2d(features: Any, *, max_points: int = MAX_MAP_POINTS, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """First two principal components of (a seeded subsample of) the features.

    Args:
        features: (N, d) array or memmap.
        max_points: subsample size cap.
        seed: seed of the subsample.

    Returns:
        ``(index, coords)``: (M,) int64 data-set indices and their (M, 2) float32 coordinates.
    """
    x = np.asarray(features)
    n = x.shape[0]
    rng = np.random.default_rng(seed)
    index = np.arange(n) if n <= max_points else np.sort(rng.choice(n, size=max_points, replace=False))
    sub = np.asarray(x[index], dtype=np.float64)
    sub = sub - sub.mean(0, keepdims=True)
    if sub.shape[1] < 2 or len(sub) < 2:
        coords = np.zeros((len(sub), 2))
        coords[:, : min(2, sub.shape[1])] = sub[:, :2]
    else:
        # The top right-singular vectors of the centred data; the small (d, d) Gram avoids an (M, M) SVD.
        gram = sub.T @ sub
        vals, vecs = np.linalg.eigh(gram)
        top = vecs[:, np.argsort(vals)[::-1][:2]]
        top *= np.where(top[np.abs(top).argmax(0), range(2)] < 0, -1.0, 1.0)  # deterministic signs
        coords = sub @ top
    return index.astype(np.int64), coords.astype(np.float32)


def save_report_data(directory: str | os.PathLike, features: Any, *, seed: int = 0) -> Path:
    """Store the PCA map coordinates beside a plan (``report_data.npz``)."""
    index, coords = pca_2d(features, seed=seed)
    path = Path(directory) / REPORT_DATA
    return atomic_write(path, lambda f: np.savez(f, index=index, coords=coords))


def draw_report(directory: str | os.PathLike, plan: Plan | None = None) -> Path:
    """Draw ``report.png`` for the plan saved in ``directory``.

    Args:
        directory: a directory written by ``plan.save`` (plus ``report_data.npz`` for the map).
        plan: the plan, when already loaded.

    Returns:
        Path of ``report.png``.

    Raises:
        ImportError: matplotlib is missing (the message says how to install it).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - matplotlib is a dependency
        raise ImportError("clusterlm report needs matplotlib: pip install matplotlib") from exc
    directory = Path(directory)
    plan = plan if plan is not None else Plan.load(directory)
    labels = plan.cluster_labels
    n_clusters = len(plan.cluster_sizes)
    selected = plan.weights > 0
    sel_per_cluster = np.bincount(labels[selected & (labels >= 0)], minlength=n_clusters)
    cmap = plt.get_cmap("tab10" if n_clusters <= 10 else "tab20")
    colours = [cmap(c % cmap.N) for c in range(n_clusters)]

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    ax = axes[0, 0]
    pos = np.arange(n_clusters)
    ax.bar(pos - 0.2, plan.cluster_sizes, width=0.4, color=colours, alpha=0.45, label="cluster size $n_c$")
    ax.bar(pos + 0.2, sel_per_cluster, width=0.4, color=colours, label="selected $s_c$")
    ax.set(title=f"Clusters: {int(selected.sum())} of {len(labels)} selected", xlabel="cluster", ylabel="examples")
    ax.set_xticks(pos)
    ax.legend()

    ax = axes[0, 1]
    w = np.array([plan.weights[selected & (labels == c)].mean() if sel_per_cluster[c] else 0.0
                  for c in range(n_clusters)])
    ax.bar(pos, w, color=colours)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set(title="Loss weight per cluster ($(n_c/N)(S/s_c)$; mean over selection = 1)", xlabel="cluster",
           ylabel="weight")
    ax.set_xticks(pos)

    ax = axes[1, 0]
    data_path = directory / REPORT_DATA
    if data_path.exists():
        with np.load(data_path, allow_pickle=False) as data:
            index, coords = data["index"], data["coords"]
        c_of = np.array([colours[c] if c >= 0 else (0.5, 0.5, 0.5, 1.0) for c in labels[index]])
        sel = selected[index]
        ax.scatter(coords[~sel, 0], coords[~sel, 1], s=4, c=c_of[~sel], alpha=0.25, linewidths=0)
        ax.scatter(coords[sel, 0], coords[sel, 1], s=14, c=c_of[sel], marker="o", edgecolors="k", linewidths=0.4)
        ax.set(title=f"Features, PCA (selected: outlined; {len(index)} points)", xlabel="PC 1", ylabel="PC 2")
    else:
        ax.text(0.5, 0.5, "no report_data.npz (features not stored)", ha="center", va="center")
        ax.set_axis_off()

    ax = axes[1, 1]
    tokens = np.stack([plan.lengths[plan.indices(r)] for r in range(plan.world_size)]).astype(np.int64)
    for r in range(plan.world_size):
        ax.plot(np.arange(1, tokens.shape[1] + 1), np.cumsum(tokens[r]), lw=1.2, label=f"rank {r}")
    title = "Tokens per rank (cumulative over the visit order)"
    if plan.world_size > 1 and tokens.shape[1] >= 8:
        ratio = plan.step_token_ratio(8)
        title += f"\nper-step max/mean at micro-batch 8: mean {ratio.mean():.3f}, max {ratio.max():.3f}"
    ax.set(title=title, xlabel="example position", ylabel="tokens")
    if plan.world_size <= 10:
        ax.legend()
    fig.suptitle(f"clusterlm plan: {plan.config.get('method', '?')} / {plan.config.get('preset', '-')}, "
                 f"world size {plan.world_size}")
    fig.tight_layout()
    out = directory / REPORT_PNG
    try:
        atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)
    return out


def show_report(directory: str | os.PathLike) -> Path:
    """``clusterlm report DIR``: redraw ``DIR/report.png`` of the saved plan and print its summary; the path."""
    plan = Plan.load(directory)
    path = draw_report(directory, plan)
    print(plan.summary())
    print(f"\nreport: {path}")
    return path
