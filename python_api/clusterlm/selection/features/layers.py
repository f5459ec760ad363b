"""Which layers a gradient feature looks at: the presets, the lm head, the linear layers, the feature size.

:func:`find_lm_head` finds and checks the lm head (an ``nn.Linear`` computing ``h W^T + b``), :func:`resolve_layers`
turns a ``features`` value (a preset of :data:`LAYER_PRESETS` or module names) into the :class:`Layer` list whose
weight gradients enter the feature, :func:`split_dim` factors the feature size ``k_o * k_i``, and
:func:`warn_if_lora_b_zero` warns about a fresh LoRA adapter whose ``lora_A`` gradients are exactly zero.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from clusterlm.config.defaults import DEFAULT_DIM, LAYER_PRESETS

__all__ = [
    "DEFAULT_DIM", "LAYER_PRESETS", "LOGIT_TRANSFORMS", "Layer", "find_lm_head", "layer_dims", "linear_types",
    "resolve_layers", "split_dim", "warn_if_lora_b_zero",
]



@functools.cache
def linear_types() -> tuple[type, ...]:
    """nn.Linear, and transformers' Conv1D of GPT-2 style models (y = x W + b, W of shape (d_in, d_out)).

    Imported on first use so that ``import clusterlm`` does not pull in transformers.
    """
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # noqa: BLE001 - without transformers there is no Conv1D to support
        return (nn.Linear,)
    return (nn.Linear, Conv1D)


# Config fields that change how logits are made from the last hidden state; the lm-head maths assumes
# plain ``h W^T + b``, so such models are refused instead of silently mis-featurised.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


@dataclass
class Layer:
    """A linear layer whose weight gradient enters the feature: its module name, module and sizes."""

    name: str
    module: nn.Module
    d_in: int
    d_out: int


def layer_dims(module: nn.Module) -> tuple[int, int]:
    """``(d_in, d_out)`` of an ``nn.Linear`` or a GPT-2 ``Conv1D``."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return int(module.weight.shape[0]), int(module.weight.shape[1])  # Conv1D


def split_dim(dim: int | tuple[int, int] | Sequence[int] | None) -> tuple[int, int]:
    """``(k_o, k_i)`` of a ``dim`` argument: None (:data:`DEFAULT_DIM`), a pair, or a total factored squarely."""
    if dim is None:
        return DEFAULT_DIM
    if isinstance(dim, bool):
        raise TypeError("GradientFeaturizer: dim must be an int or a (k_o, k_i) pair, got a bool.")
    if isinstance(dim, (int, np.integer)):
        total = int(dim)
        if total < 1:
            raise ValueError(f"GradientFeaturizer: dim must be >= 1, got {dim}.")
        # The most square factorisation k_o * k_i = dim keeps both projections informative.
        k_o = max(f for f in range(1, math.isqrt(total) + 1) if total % f == 0)
        return k_o, total // k_o
    if isinstance(dim, Sequence) and len(dim) == 2 and all(isinstance(v, (int, np.integer)) for v in dim):
        k_o, k_i = int(dim[0]), int(dim[1])
        if k_o < 1 or k_i < 1:
            raise ValueError(f"GradientFeaturizer: dim=(k_o, k_i) must be positive, got {tuple(dim)}.")
        return k_o, k_i
    raise TypeError(f"GradientFeaturizer: dim must be None, an int (total size) or a (k_o, k_i) pair, got {dim!r}.")


def find_lm_head(model: nn.Module) -> tuple[nn.Linear, str]:
    """The lm head (``get_output_embeddings()``, an ``nn.Linear`` computing ``h W^T + b``) and its module name.

    Raises:
        TypeError / ValueError: no lm head, one that is not an ``nn.Linear``, or a config that transforms the
            logits (softcapping, scaling).
    """
    head = None
    if hasattr(model, "get_output_embeddings"):
        try:
            head = model.get_output_embeddings()
        except (NotImplementedError, AttributeError):
            head = None
    if head is None:
        raise ValueError(
            f"GradientFeaturizer: {type(model).__name__} has no lm head (get_output_embeddings() "
            "returned nothing); pass a causal language model, e.g. AutoModelForCausalLM."
        )
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"GradientFeaturizer: the lm head must be an nn.Linear (logits = h W^T + b), got "
            f"{type(head).__name__}; a LoRA-wrapped or quantised lm head is not supported."
        )
    config = getattr(model, "config", None)
    for field in LOGIT_TRANSFORMS:
        value = getattr(config, field, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"GradientFeaturizer: the model's config sets {field}={value!r}, so its logits are "
                "not h W^T + b; such models are not supported."
            )
    name = next((n for n, m in model.named_modules() if m is head), None)
    assert name is not None, "get_output_embeddings() returned a module outside the model"
    return head, name


def resolve_layers(model: nn.Module, layers: str | Sequence[str], lm_head_name: str) -> tuple[list[Layer], bool]:
    """The layers a ``features`` value names (the lm head left out) and whether the lm head is one of them.

    Raises:
        TypeError / ValueError: an unknown preset or layer name (the message lists the available ones), a name
            given twice, ``"lora"`` on a model without LoRA layers.
    """
    linear = {n: m for n, m in model.named_modules() if isinstance(m, linear_types()) and n != lm_head_name}
    if isinstance(layers, str):
        if layers in ("paper", "lm_head"):
            return [], True
        if layers == "all-linear":
            return [Layer(n, m, *layer_dims(m)) for n, m in linear.items()], True
        if layers == "lora":
            lora = [Layer(n, m, *layer_dims(m)) for n, m in linear.items() if ".lora_A." in n or ".lora_B." in n]
            if not lora:
                raise ValueError(
                    "GradientFeaturizer: layers='lora' but the model has no LoRA layers; wrap it "
                    "with peft.get_peft_model(model, LoraConfig(...)) or use layers='all-linear'."
                )
            return lora, False
        raise ValueError(
            f"GradientFeaturizer: layers must be one of {LAYER_PRESETS} or a list of module names, got {layers!r}."
        )
    if not isinstance(layers, Sequence) or not layers or not all(isinstance(n, str) for n in layers):
        raise TypeError(
            f"GradientFeaturizer: layers must be a preset {LAYER_PRESETS} or a non-empty list of "
            f"module names, got {layers!r}."
        )
    unknown = [n for n in layers if n not in linear and n != lm_head_name]
    if unknown:
        available = [lm_head_name, *linear]
        shown = ", ".join(available[:40]) + (f", ... ({len(available)} in all)" if len(available) > 40 else "")
        raise ValueError(
            f"GradientFeaturizer: no linear layer named {unknown[0]!r} in the model "
            f"(unknown: {unknown[:5]}). Available layers: {shown}."
        )
    if len(set(layers)) != len(layers):
        raise ValueError(f"GradientFeaturizer: layers lists a name twice: {list(layers)}.")
    return [Layer(n, linear[n], *layer_dims(linear[n])) for n in layers if n != lm_head_name], (
        lm_head_name in layers
    )


def warn_if_lora_b_zero(model: nn.Module, layers: Sequence[Layer]) -> None:
    """Warn when the feature is LoRA-only and every selected lora_A's lora_B is zero (no lora_A gradient)."""
    if not layers or not all(".lora_A." in x.name or ".lora_B." in x.name for x in layers):
        return  # other layers carry signal; a zero lora_A part is then a small share of the feature
    a_names = [x.name for x in layers if ".lora_A." in x.name]
    modules = dict(model.named_modules())
    b_modules = [modules.get(n.replace(".lora_A.", ".lora_B.", 1)) for n in a_names]
    weights = [getattr(b, "weight", None) for b in b_modules]
    if not a_names or any(not isinstance(w, torch.Tensor) or w.is_meta for w in weights):
        return
    if any(bool(w.detach().any()) for w in weights):
        return
    warnings.warn(
        f"GradientFeaturizer: every lora_B weight of the selected LoRA layers is zero (a freshly initialised "
        f"adapter), so the gradients of their {len(a_names)} lora_A matrices are exactly zero and that part of "
        "the feature carries nothing; featurize after a short warm-up of the adapter (a few training steps), or "
        "use layers='lm_head' or 'all-linear'.",
        UserWarning,
        stacklevel=3,
    )
