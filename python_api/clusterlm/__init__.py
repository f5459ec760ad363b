"""clusterlm: cluster-aware balanced data selection for multi-GPU fine-tuning (CluSTER).

    plan = clusterlm.select(model, dataset, world_size=4, ratio=0.31)   # features -> K-means -> picks
    config = clusterlm.SelectConfig(world_size=4, ratio=0.31, feature_tokens=32)   # or: every setting as one object
    plan = clusterlm.select(model, dataset, config)
    plan.save("plan/")                                                  # plan.json + plan.npz
    sampler = clusterlm.PlanSampler(plan, rank)                         # per-rank DataLoader order
    loss = clusterlm.weighted_loss(clusterlm.per_example_loss(logits, labels), weights)

Importing ``clusterlm`` does not import transformers; the featurizer, models and the Hugging Face
integration (``clusterlm.integrations.hf``) load it when used.
"""

from clusterlm.allocation import selection_weights
from clusterlm.config import SelectConfig
from clusterlm.data import SFTDataset, collate, fingerprint, load_data
from clusterlm.features import LAYER_PRESETS, GradientFeaturizer
from clusterlm.loss import per_example_loss, weighted_loss
from clusterlm.plan import Plan
from clusterlm.sampler import PlanSampler
from clusterlm.select import select, select_from_features
from clusterlm.store import FeatureStore

__all__ = [
    "LAYER_PRESETS",
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
