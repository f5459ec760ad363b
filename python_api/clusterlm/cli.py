"""Command line: ``clusterlm <command>`` (also ``python -m clusterlm``).

Commands:
    demo    capacity-constrained K-means on a real data set shipped with scikit-learn (8x8 digit
            images), K = 8 "GPUs": cluster sizes without caps, with the paper's 1.5 N/K cap and with
            exact balance, side by side. The selection demo replaces it once ``select`` lands.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np


def _load_demo_data() -> tuple[np.ndarray, str]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:  # scikit-learn is a test extra; fall back to a generated mixture
        rng = np.random.default_rng(0)
        comp = rng.choice(8, size=4000, p=rng.dirichlet(np.ones(8)))
        centers = rng.standard_normal((8, 32)) * 4
        return (centers[comp] + rng.standard_normal((4000, 32))).astype(np.float32), "Gaussian mixture (4000 x 32)"
    digits = load_digits()
    return digits.data.astype(np.float32), f"scikit-learn digits ({digits.data.shape[0]} x {digits.data.shape[1]})"


def demo(args: argparse.Namespace) -> int:
    from cluster_kernels import capacity_kmeans

    x, name = _load_demo_data()
    n, k = x.shape[0], args.world_size
    print(f"data: {name}; K = {k} clusters (one per GPU)")
    rows = []
    settings = [
        ("unconstrained", None, None),
        ("cap 1.5 N/K (paper)", None, math.ceil(1.5 * n / k)),
        ("exact balance", n // k, math.ceil(n / k)),
    ]
    for label, lo, hi in settings:
        t0 = time.perf_counter()
        res = capacity_kmeans(x, k, min_size=lo, max_size=hi, n_init=3, seed=args.seed)
        secs = time.perf_counter() - t0
        ok = (lo is None or res.sizes.min() >= lo) and (hi is None or res.sizes.max() <= hi)
        rows.append((label, secs, res.inertia, res.sizes, ok))
    base = rows[0][2]
    print(f"{'setting':<22}{'seconds':>9}{'inertia':>14}{'vs free':>9}  {'sizes':<44}{'caps met':>9}")
    for label, secs, inertia, sizes, ok in rows:
        print(f"{label:<22}{secs:>9.3f}{inertia:>14.1f}{inertia / base - 1:>+9.2%}  {str(sizes.tolist()):<44}"
              f"{'yes' if ok else 'NO':>9}")
    return 0 if all(r[4] for r in rows) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clusterlm", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="capacity-constrained K-means on a built-in real data set")
    p_demo.add_argument("--world-size", type=int, default=8, help="number of clusters / GPUs (default 8)")
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.set_defaults(func=demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
