"""cluster_kernels: the compute layer of CluSTER kernels.

Every op has a pure-torch reference (the test oracle and fallback), native kernels (C++/OpenMP and
CUDA in the extension ``cluster_kernels._C``, Triton for CUDA tensors) and one dispatcher taking
``backend="auto" | "triton" | "cuda" | "cpu" | "torch"``.

Importing this package never fails because Triton, a GPU or ``_C`` is missing.
"""

from cluster_kernels._selfcheck import backends_used
from cluster_kernels.distributed import distributed_capacity_kmeans
from cluster_kernels.kmeans import KMeansResult, assign_with_capacity, capacity_kmeans, has_cuda_kmeans
from cluster_kernels.lm_head_features import IGNORE_INDEX, lm_head_features, lm_head_features_ref
from cluster_kernels.project_linear_grads import project_linear_grads, project_linear_grads_ref
from cluster_kernels.projection import PROJECTION_KINDS, projection_key, random_projection

__all__ = [
    "IGNORE_INDEX",
    "KMeansResult",
    "PROJECTION_KINDS",
    "assign_with_capacity",
    "backends_used",
    "capacity_kmeans",
    "distributed_capacity_kmeans",
    "has_cuda_kmeans",
    "lm_head_features",
    "lm_head_features_ref",
    "project_linear_grads",
    "project_linear_grads_ref",
    "projection_key",
    "random_projection",
]
__version__ = "0.1.0"
