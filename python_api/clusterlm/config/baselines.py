"""The baselines' settings: :class:`S2LConfig` (:func:`clusterlm.selection.baselines.s2l_plan`),
:class:`LessConfig` (:func:`clusterlm.selection.baselines.less_plan`) and :class:`TrainLoopConfig`, the small
training loop both use for their proxy and warm-up (:func:`clusterlm.selection.baselines.train_loop`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from clusterlm.config.base import Config

if TYPE_CHECKING:
    import torch

__all__ = ["BASELINE_SPECS", "LESS_BATCH_TOKENS", "LESS_DIM", "LESS_TARGETS", "LOSS_BATCH_TOKENS", "MICRO_BATCH_SIZE",
           "LessConfig", "S2LConfig", "TrainLoopConfig", "is_baseline_spec"]

LOSS_BATCH_TOKENS = 8192  # padded tokens per loss forward (example_losses, S2L's trajectories)
MICRO_BATCH_SIZE = 8  # examples per optimizer step of the baselines' training (train_loop, S2L, LESS)
LESS_DIM = 1024  # LESS's projected gradient dimension (not the selection's feature size, clusterlm.selection.features)
LESS_BATCH_TOKENS = 4096  # padded tokens per LESS gradient pass
LESS_TARGETS = "q_proj,k_proj,v_proj,o_proj"

# The --plan values that name a baseline instead of a plan directory (selection.baselines builds them).
BASELINE_SPECS = ("full", "random:<ratio>", "random:<count>", "random:tokens=<ratio>", "random:tokens=<count>")


def is_baseline_spec(spec: str) -> bool:
    """True when ``spec`` names a baseline (``full`` or ``random:...``) rather than a plan directory."""
    return spec == "full" or spec.startswith("random:")


@dataclass(frozen=True)
class TrainLoopConfig(Config):
    """The settings of :func:`train_loop` (``epochs`` and ``lr`` are required).

    Attributes:
        epochs: passes over the training indices.
        lr: peak learning rate.
        micro_batch_size: examples per optimizer step.
        warmup_ratio / schedule / weight_decay / max_grad_norm: as the trainer's options (linear warm-up over
            ``warmup_ratio`` of the steps, then ``schedule`` decay to 0: :func:`clusterlm.engine.step.lr_factor`).
        seed: order of the examples (and dropout, through a forked RNG).
        pad_id: padding id (default the model's).
        checkpoint_steps: after these optimizer steps (1-based) the loop's ``on_checkpoint`` callback runs.
        autocast_dtype: e.g. ``torch.bfloat16``; None for none.
    """

    epochs: int
    lr: float
    micro_batch_size: int = MICRO_BATCH_SIZE
    warmup_ratio: float = 0.03
    schedule: str = "linear"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    pad_id: int | None = None
    checkpoint_steps: Sequence[int] = ()
    autocast_dtype: torch.dtype | None = None



    OWNER: ClassVar[str] = "train_loop"


@dataclass(frozen=True)
class S2LConfig(Config):
    """The settings of :func:`s2l_plan` (defaults: S2L's where the paper gives them, else this small scale's).

    Attributes:
        seed: seed of proxy training order, K-means and sampling.
        proxy_layers: decoder layers of the proxy (default half of the model's).
        proxy_epochs: proxy training epochs over the full data.
        n_checkpoints: evenly spaced checkpoints (trajectory length T).
        n_clusters: K-means clusters (S2L: 100; clamped to N).
        skip_size: clusters of at most this size are skipped.
        lr / micro_batch_size: proxy training.
        batch_tokens: padded tokens per loss forward.
        autocast_dtype: e.g. ``torch.bfloat16`` on GPU.
        token_balance: the random baseline's allocation option.
    """

    seed: int = 0
    proxy_layers: int | None = None
    proxy_epochs: int = 1
    n_checkpoints: int = 4
    n_clusters: int = 100
    skip_size: int = 2
    lr: float = 1e-3
    micro_batch_size: int = MICRO_BATCH_SIZE
    batch_tokens: int = LOSS_BATCH_TOKENS
    autocast_dtype: torch.dtype | None = None
    token_balance: bool = True


    def proxy_training(self, checkpoint_steps: list[int]) -> TrainLoopConfig:
        """The proxy's :func:`~clusterlm.selection.baselines._training.train_loop` settings."""
        return TrainLoopConfig(epochs=self.proxy_epochs, lr=self.lr, micro_batch_size=self.micro_batch_size,
                               seed=self.seed, checkpoint_steps=tuple(checkpoint_steps),
                               autocast_dtype=self.autocast_dtype)

    OWNER: ClassVar[str] = "s2l_plan"


@dataclass(frozen=True)
class LessConfig(Config):
    """The settings of :func:`less_plan` (defaults: LESS's where the paper gives them, else this small scale's).

    Attributes:
        seed: warm-up sample, order, LoRA initialisation and projections.
        warmup_fraction / warmup_epochs / lr / micro_batch_size: the warm-up (LESS: 5 %, 4 epochs, 2e-5).
        lora_r / lora_alpha / lora_dropout / lora_targets: the LoRA (alpha default ``4 r``).
        dim: projected gradient dimension (:data:`LESS_DIM`).
        batch_tokens: padded tokens per gradient pass.
        token_balance: the random baseline's allocation option.
    """

    seed: int = 0
    warmup_fraction: float = 0.05
    warmup_epochs: int = 4
    lr: float = 2e-5
    lora_r: int = 8
    lora_alpha: float | None = None
    lora_dropout: float = 0.1
    lora_targets: str = LESS_TARGETS
    micro_batch_size: int = MICRO_BATCH_SIZE
    dim: int = LESS_DIM
    batch_tokens: int = LESS_BATCH_TOKENS
    token_balance: bool = True


    def warmup(self, checkpoint_steps: Sequence[int]) -> TrainLoopConfig:
        """The warm-up's :func:`~clusterlm.selection.baselines._training.train_loop` settings."""
        return TrainLoopConfig(epochs=self.warmup_epochs, lr=self.lr, micro_batch_size=self.micro_batch_size,
                               seed=self.seed, checkpoint_steps=tuple(checkpoint_steps))

    OWNER: ClassVar[str] = "less_plan"
