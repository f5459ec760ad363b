"""Devices and dtypes by name: ``"auto"`` and its choices (:func:`resolve_device`, :func:`resolve_dtype`)."""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["DEVICES", "DTYPES", "as_dtype", "resolve_device", "resolve_dtype"]

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_device(device: Any) -> torch.device:
    """The device ``device`` names: ``"auto"`` is CUDA when present (``cuda:LOCAL_RANK`` under torchrun), else CPU.

    Raises:
        ValueError: not a device name, or CUDA was asked for and no CUDA device is visible (one line naming the fix).
    """
    if device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"device must be one of {', '.join(DEVICES)}, 'cuda:N' or a torch.device, got {device!r}."
        ) from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: no CUDA device is visible to this process (torch {torch.__version__}, built with "
            f"CUDA {torch.version.cuda or 'none'}); run on a GPU machine, or use --device cpu (or auto)."
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible; pick one of "
                           f"cuda:0..cuda:{torch.cuda.device_count() - 1}.")
    return dev


def resolve_dtype(dtype: Any, device: torch.device) -> torch.dtype | None:
    """The weights' dtype: ``"auto"`` is bfloat16 on a CUDA device that supports it, else float32; a name or
    ``torch.dtype`` as given; None keeps the checkpoint's.

    Raises:
        TypeError: not a dtype or its name.
    """
    if dtype != "auto":
        return as_dtype(dtype)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def as_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype.removeprefix("torch."), None), torch.dtype):
        return getattr(torch, dtype.removeprefix("torch."))
    raise TypeError(f"load_model: dtype must be None, a torch.dtype or its name (e.g. 'bfloat16'), got {dtype!r}.")
