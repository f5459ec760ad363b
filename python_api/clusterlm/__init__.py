"""clusterlm: cluster-aware balanced data selection for multi-GPU fine-tuning (CluSTER).

Importing ``clusterlm`` does not import transformers; the featurizer loads it when used.
"""

from clusterlm.features import LAYER_PRESETS, GradientFeaturizer
from clusterlm.store import FeatureStore

__all__ = ["LAYER_PRESETS", "FeatureStore", "GradientFeaturizer"]
__version__ = "0.1.0"
