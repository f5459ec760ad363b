"""clusterlm: cluster-aware balanced data selection for multi-GPU fine-tuning (CluSTER).

    plan = clusterlm.select(model, dataset, world_size=4, ratio=0.31)   # features -> K-means -> picks
    config = clusterlm.SelectConfig(world_size=4, ratio=0.31, feature_tokens=32)   # or: every setting as one object
    plan = clusterlm.select(model, dataset, config)
    plan.save("plan/")                                                  # plan.json + plan.npz
    sampler = clusterlm.PlanSampler(plan, rank)                         # per-rank DataLoader order
    loss = clusterlm.weighted_loss(clusterlm.per_example_loss(logits, labels), weights)

    result = clusterlm.train(clusterlm.TrainConfig(plan="plan/", model="tiny-llama", data="train.jsonl",
                                                   out="run/", nproc=2, max_steps=40))  # the reference trainer
    report = clusterlm.compare(clusterlm.CompareConfig(methods=("random", "cluster"), seeds=(0, 1)))

Importing ``clusterlm`` imports neither torch nor transformers: every public name below is loaded from its
subpackage on first use (docs/architecture.md lists the subpackages and their jobs), so a config can be built,
read and checked without them.
"""

import sys
import types
from typing import Any

from clusterlm.lazy import lazy_exports

__version__ = "0.1.0"

# public name -> the module that defines it, loaded on first use
_PUBLIC = {
    "SelectConfig": "clusterlm.config.selection",
    "TrainConfig": "clusterlm.config.training",
    "CompareConfig": "clusterlm.config.comparison",
    "ExportConfig": "clusterlm.config.export",
    "select": "clusterlm.selection.select",
    "select_from_features": "clusterlm.selection.select",
    "selection_weights": "clusterlm.selection.allocation",
    "GradientFeaturizer": "clusterlm.selection.features",
    "LAYER_PRESETS": "clusterlm.config.selection",
    "FeatureStore": "clusterlm.selection.store",
    "Plan": "clusterlm.plan",
    "PlanSampler": "clusterlm.plan.sampler",
    "SFTDataset": "clusterlm.data",
    "collate": "clusterlm.data",
    "fingerprint": "clusterlm.data",
    "load_data": "clusterlm.data",
    "per_example_loss": "clusterlm.engine.loss",
    "weighted_loss": "clusterlm.engine.loss",
    "train": "clusterlm.training.run",
    "TrainResult": "clusterlm.training.run",
    "compare": "clusterlm.comparison.run",
    "CompareResult": "clusterlm.comparison.output",
    "execute_program": "clusterlm.tasks.sandbox",
}
__all__ = sorted(_PUBLIC)

# `python -m clusterlm.train` is a module of this package; importing it (as runpy's parent look-up, pkgutil or a
# documentation tool may) would set the attribute `clusterlm.train` to that module and hide the function.
_FUNCTIONS = ("select", "train", "compare")


__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)


class _Package(types.ModuleType):
    """The package module: a submodule import never replaces one of the job functions (`clusterlm.train`)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FUNCTIONS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
