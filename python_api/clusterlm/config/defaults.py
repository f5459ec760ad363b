"""Values the configs need and the code below them shares, defined once.

The configs import only this package, so these constants live here rather than in the modules that use them
(the featurizer, the picks, the allocation, the authors' selection, the trainer's checkpoints), which import them
from here.
"""

# Data (data.loading)
DEFAULT_MAX_LENGTH = 1024  # tokens per example (select, train and compare truncate to this by default)

# The command lines' --chat-template values -> load_data(chat_template=...)
CHAT_TEMPLATE_MODES: dict[str, bool | None] = {"auto": None, "on": True, "off": False}

# The feature window and batching (selection.features)
DEFAULT_FEATURE_TOKENS = 64  # the default feature window: settled by `make bench-real` (README, BENCHMARKS.md)
DEFAULT_SHARD_SIZE = 1024  # examples per window / store shard (batches never cross one)
DEFAULT_BATCH_TOKENS = 8192  # padded tokens per featurization forward
LAYER_PRESETS = ("paper", "lm_head", "all-linear", "lora")
DEFAULT_DIM = (32, 32)  # projected feature size k_o x k_i (one default for every caller)

# Within-cluster picks (selection.picking): geometric ones, then those on the per-example signals that come with the
# features (gradient norm, loss; selection.signals), alone and combined with the distance to the centroid; and
# cluster -> rank allocations (selection.allocation)
WITHIN_CLUSTER = ("farthest", "nearest", "random", "kcenter", "grad-norm", "loss", "rank-farthest-loss",
                  "rank-farthest-grad-norm", "alternate-loss-farthest")
ALLOCATIONS = ("cluster-per-rank", "stratified")

# The authors' selection (selection.paper)
PAPER_SEED = 42  # their args.seed default; the callback adds the epoch (0 at train begin)
PAPER_CAP = 1.5  # cap = ceil(1.5 N / K), applied only when a cluster exceeds 1.5 N / K
PAPER_N_INIT = 10

# `--resume` without a value: OUT's newest checkpoint (engine.step); the checkpoints' folder in OUT
LATEST = "latest"
CKPT_DIR = "ckpt"
