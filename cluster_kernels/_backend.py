"""Backend discovery and explicit dispatch shared by every op.

``backend="auto"`` picks the fastest available implementation for the input's device and logs its
choice once per op; an explicit request for a backend that is not available raises an error that
says how to get it (the way trak's projector selection does). Nothing here imports Triton or the
native extension eagerly, so ``import cluster_kernels`` never fails.
"""

from __future__ import annotations

import importlib
import logging
import os
from functools import cache
from types import ModuleType

import torch

logger = logging.getLogger("cluster_kernels")

BACKENDS = ("auto", "triton", "cuda", "cpu", "torch")

_HOW_TO_BUILD = (
    "reinstall the package so that setup.py builds the extension: `pip install -e .` "
    "(or `make test`, which does it in .venv)"
)


@cache
def native() -> ModuleType | None:
    """The compiled extension ``cluster_kernels._C`` or None when it was not built."""
    if os.environ.get("CLUSTER_KERNELS_DISABLE_NATIVE", "0") == "1":
        return None
    try:
        return importlib.import_module("cluster_kernels._C")
    except ImportError as exc:  # pragma: no cover - depends on the install
        logger.debug("cluster_kernels._C not importable: %s", exc)
        return None


def has_cpu_native() -> bool:
    """True when the C++/OpenMP part of ``_C`` is importable."""
    return native() is not None


def has_cuda_native() -> bool:
    """True when ``_C`` was compiled with its CUDA part (a GPU is still needed to run it)."""
    mod = native()
    return bool(mod is not None and getattr(mod, "has_cuda", False))


@cache
def has_triton() -> bool:
    """True when Triton imports (on CPU it only runs under ``TRITON_INTERPRET=1``)."""
    try:
        importlib.import_module("triton")
        return True
    except Exception:  # noqa: BLE001 - a broken triton install counts as missing
        return False


def cuda_device_available() -> bool:
    """True when torch sees a CUDA device."""
    try:
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def missing_backend_error(op: str, backend: str, reason: str, fix: str) -> RuntimeError:
    """The error raised when a backend was requested explicitly but cannot run."""
    return RuntimeError(f"{op}: backend={backend!r} is not available: {reason}. To get it: {fix}.")


def check_backend_name(op: str, backend: str) -> None:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}.")


_logged: set[tuple[str, str, str]] = set()


def log_choice_once(op: str, device: str, backend: str, why: str) -> None:
    """Log the backend that ``auto`` chose, once per (op, device, backend)."""
    key = (op, device, backend)
    if key not in _logged:
        _logged.add(key)
        logger.info("%s: backend='auto' chose %r on %s (%s)", op, backend, device, why)


def require_cpu_native(op: str, backend: str = "cpu") -> ModuleType:
    mod = native()
    if mod is None:
        raise missing_backend_error(op, backend, "the extension cluster_kernels._C is not built", _HOW_TO_BUILD)
    return mod


def require_cuda_native(op: str) -> ModuleType:
    mod = require_cpu_native(op, "cuda")
    if not getattr(mod, "has_cuda", False):
        raise missing_backend_error(
            op,
            "cuda",
            "cluster_kernels._C was built without its CUDA part (no nvcc at build time, or CLUSTER_KERNELS_CUDA=0)",
            "install a CUDA toolkit, then rebuild with CLUSTER_KERNELS_CUDA=1 pip install -e .",
        )
    if not cuda_device_available():
        raise missing_backend_error(op, "cuda", "no CUDA device is visible to torch", "run on a machine with a GPU")
    return mod


def require_triton(op: str) -> None:
    if not has_triton():
        raise missing_backend_error(op, "triton", "triton is not installed", "`pip install triton`")
