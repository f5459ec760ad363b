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

Importing ``clusterlm`` does not import transformers; the featurizer, models and the Hugging Face
integration (``clusterlm.integrations.hf``) load it when used.
"""

from typing import Any

from clusterlm.allocation import selection_weights
from clusterlm.compare_config import CompareConfig
from clusterlm.config import SelectConfig
from clusterlm.data import SFTDataset, collate, fingerprint, load_data
from clusterlm.features import LAYER_PRESETS, GradientFeaturizer
from clusterlm.loss import per_example_loss, weighted_loss
from clusterlm.plan import Plan
from clusterlm.sampler import PlanSampler
from clusterlm.select import select, select_from_features
from clusterlm.store import FeatureStore
from clusterlm.train_config import TrainConfig

__all__ = [
    "LAYER_PRESETS",
    "CompareConfig",
    "CompareResult",
    "TrainConfig",
    "TrainResult",
    "compare",
    "train",
    "FeatureStore",
    "GradientFeaturizer",
    "Plan",
    "PlanSampler",
    "SFTDataset",
    "SelectConfig",
    "collate",
    "fingerprint",
    "load_data",
    "per_example_loss",
    "select",
    "select_from_features",
    "selection_weights",
    "weighted_loss",
]
__version__ = "0.1.0"

# The entry points that run jobs load the trainer and the baselines (transformers) on first use.
_LAZY = {"train": "clusterlm.train_launch", "TrainResult": "clusterlm.train_launch",
         "compare": "clusterlm.compare_run", "CompareResult": "clusterlm.compare_output"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'clusterlm' has no attribute {name!r}")
