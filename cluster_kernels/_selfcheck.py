"""First-use self-check of the GPU kernels, per process, and the record of which backend ran.

No GPU kernel of this package has been run by its test suite (the machines it is built on have none), so
each custom op checks itself the first time it runs on a CUDA device in a process:

- ``lm_head_features`` and ``project_linear_grads`` (Triton): the first call runs the kernel on the
  caller's input, then recomputes the first examples (at most :data:`CHECK_TOKENS` tokens, at least one
  example) on the torch path and compares. The check sits after the real call on purpose: Triton's
  autotuner benchmarks its configs on the first input of a key, and a small check input would make it
  pick the config that is fastest for a few tokens.
- ``capacity_kmeans`` and ``assign_with_capacity`` (CUDA, ``cluster_kernels._C``): before the first call,
  a small problem (256 points, 4 well-separated blobs, capacity bounds) runs on the CUDA and the C++/OpenMP
  path; the CUDA code repeats every decision of the CPU code, so labels must be equal and the costs agree.

Tolerances (:func:`tolerance`): features are compared as ``max |kernel - torch| <= tol * max |torch|`` over
the checked examples, ``tol = 1e-4`` for float32 inputs and ``1e-2`` for 16-bit inputs (bf16/fp16 inputs
carry ~4e-3 of their own rounding; a broken kernel is off by O(1)); non-finite values fail.

A launch failure (any exception from the kernel) or a mismatch gives one ``RuntimeWarning`` naming the op,
the device, the dtype, the reason and the fallback; that ``(op, device, dtype)`` then runs on the fallback
(torch for the features, the C++/OpenMP path with a host copy for K-means) for the rest of the process.
``CLUSTER_KERNELS_SELF_CHECK=0`` skips every check. :func:`backends_used` tells which backend each op ran
last (a plan records it).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = [
    "CHECK_TOKENS",
    "SELF_CHECK_ENV",
    "backends_used",
    "backend_for",
    "check_failed",
    "check_prefix",
    "compare_features",
    "kmeans_backend",
    "record_backend",
    "reset_self_checks",
    "run_first_use",
    "self_check_enabled",
    "self_check_status",
    "tolerance",
]

T = TypeVar("T")

SELF_CHECK_ENV = "CLUSTER_KERNELS_SELF_CHECK"
CHECK_TOKENS = 512  # tokens recomputed on the torch path by the features' check
CHECKED_DEVICE_TYPES: tuple[str, ...] = ("cuda",)  # tests add "cpu" to run the check under the interpreter
_KMEANS_N, _KMEANS_K, _KMEANS_D = 256, 4, 8

_lock = threading.RLock()
_status: dict[tuple[str, str, str], str] = {}  # (op, device, dtype) -> "checking" | "ok" | "failed: <reason>"
_used: dict[str, str] = {}


def self_check_enabled() -> bool:
    """False when ``CLUSTER_KERNELS_SELF_CHECK`` is ``0`` (or ``false``/``no``/``off``)."""
    return os.environ.get(SELF_CHECK_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def tolerance(dtype: torch.dtype) -> float:
    """The features' check tolerance, relative to the largest entry of the torch result."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 1e-2


def record_backend(op: str, backend: str) -> None:
    """Note that ``op`` just ran on ``backend`` (what :func:`backends_used` reports)."""
    with _lock:
        _used[op] = backend


def backends_used() -> dict[str, str]:
    """``{op: backend}``: the backend each op ran on at its latest call in this process.

    Backends are ``"triton"``, ``"torch"``, ``"cuda"`` or ``"cpu"``; an op whose self-check failed shows its
    fallback. Ops not called yet are absent.
    """
    with _lock:
        return dict(_used)


def self_check_status() -> dict[str, str]:
    """``{"op@device/dtype": "ok" | "failed: <reason>"}`` for every check run in this process."""
    with _lock:
        return {f"{op}@{dev}/{dt}": st for (op, dev, dt), st in _status.items() if st != "checking"}


def reset_self_checks() -> None:
    """Forget every check result and recorded backend (for tests; a process normally never needs it)."""
    with _lock:
        _status.clear()
        _used.clear()


def _key(op: str, device: torch.device, dtype: torch.dtype | None) -> tuple[str, str, str]:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return op, str(dev), str(dtype).replace("torch.", "") if dtype is not None else "-"


def check_failed(op: str, device: torch.device, dtype: torch.dtype | None) -> bool:
    """True when ``op`` failed its check on ``device`` for ``dtype``: it must run on its fallback."""
    with _lock:
        return _status.get(_key(op, device, dtype), "").startswith("failed")


def _needs_check(key: tuple[str, str, str], device: torch.device) -> bool:
    if not self_check_enabled() or torch.device(device).type not in CHECKED_DEVICE_TYPES:
        return False
    with _lock:
        if key in _status:  # "checking" too: a call made by the check itself runs unchecked
            return False
        _status[key] = "checking"
        return True


def _fail(key: tuple[str, str, str], reason: str, fallback: str) -> None:
    op, dev, dt = key
    with _lock:
        _status[key] = f"failed: {reason}"
    warnings.warn(
        f"cluster_kernels: the first-use self-check of {op} on {dev} ({dt} inputs) failed: {reason}. {op} uses "
        f"the {fallback} backend on {dev} for the rest of this process (set {SELF_CHECK_ENV}=0 to skip the check).",
        RuntimeWarning,
        stacklevel=4,
    )


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" + ("..." if len(text) > 300 else "")


def backend_for(op: str, device: torch.device, dtype: torch.dtype | None, primary: str,
                fallback: str) -> tuple[str, bool]:
    """The backend to run ``op`` on and whether this call is its first-use check.

    Returns:
        ``(fallback, False)`` once the check failed for ``(op, device, dtype)``; ``(primary, True)`` on the first
        call that must be checked (the caller then goes through :func:`run_first_use`); else ``(primary, False)``.
        Calls that are not checked are recorded for :func:`backends_used` here.
    """
    if check_failed(op, device, dtype):
        record_backend(op, fallback)
        return fallback, False
    if _needs_check(_key(op, device, dtype), device):
        return primary, True
    record_backend(op, primary)
    return primary, False


def run_first_use(
    op: str,
    device: torch.device,
    dtype: torch.dtype | None,
    backends: tuple[str, str],
    run_primary: Callable[[], T],
    verify: Callable[[T], str | None],
    run_fallback: Callable[[], T],
) -> T:
    """The first call of ``op`` on ``device``: run the primary backend, verify it, fall back on a failure.

    Args:
        op, device, dtype: what the check is kept for (one check per triple and process).
        backends: ``(primary, fallback)`` backend names, for :func:`backends_used` and the warning.
        run_primary: computes the result with the primary backend into new buffers.
        verify: given that result, returns None when it agrees with the fallback on a small part, else why not.
        run_fallback: computes the result with the fallback backend.

    Returns:
        The primary's result when the check passed, else the fallback's.
    """
    primary, fallback = backends
    key = _key(op, device, dtype)
    try:
        result = run_primary()
        problem = verify(result)
    except Exception as exc:  # noqa: BLE001 - any launch or runtime failure means "do not trust this kernel"
        problem = f"the {primary} kernel raised {_short(exc)}"
    if problem is not None:
        _fail(key, problem, fallback)
        record_backend(op, fallback)
        return run_fallback()
    with _lock:
        _status[key] = "ok"
    record_backend(op, primary)
    return result


def check_prefix(cu: Any) -> int:
    """How many leading examples the features' check recomputes: those within :data:`CHECK_TOKENS` tokens.

    At least one (when there is one), at most 8. ``cu`` is the host array of offsets.
    """
    n_ex = len(cu) - 1
    j = 1
    while j < min(n_ex, 8) and int(cu[j + 1]) <= CHECK_TOKENS:
        j += 1
    return min(j, n_ex)


def compare_features(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, backend: str) -> str | None:
    """None when ``got`` (kernel) matches ``ref`` (torch) within :func:`tolerance`, else a one-line reason."""
    if tuple(got.shape) != tuple(ref.shape):
        return f"the {backend} result has shape {tuple(got.shape)}, the torch path's {tuple(ref.shape)}"
    got64, ref64 = got.detach().double(), ref.detach().double()
    if not bool(torch.isfinite(got64).all()):
        return f"the {backend} result has non-finite values where the torch path's are finite"
    scale = float(ref64.abs().max()) if ref64.numel() else 0.0
    err = float((got64 - ref64).abs().max()) / (scale if scale > 0 else 1.0) if ref64.numel() else 0.0
    tol = tolerance(dtype)
    if err > tol:
        return f"the {backend} result differs from the torch path by {err:.3g} (relative; tolerance {tol:g})"
    return None


# --------------------------------------------------------------------------------------------------
# K-means (CUDA extension vs the C++/OpenMP path)
# --------------------------------------------------------------------------------------------------


def _kmeans_inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """256 points in 4 well-separated blobs of unequal sizes (float64), and 4 centroids near the blobs."""
    gen = torch.Generator().manual_seed(1234)
    centres = torch.randn(_KMEANS_K, _KMEANS_D, generator=gen, dtype=torch.float64) * 20.0
    comp = torch.tensor([0] * 100 + [1] * 70 + [2] * 50 + [3] * 36)
    x = centres[comp] + torch.randn(_KMEANS_N, _KMEANS_D, generator=gen, dtype=torch.float64)
    x = x[torch.randperm(_KMEANS_N, generator=gen)]
    return x.to(device), (centres + 0.5).to(device)


def _compare_kmeans(op: str, on_cuda: Any, on_cpu: Any) -> str | None:
    """Labels equal and costs within 1e-9 (relative); ``on_*`` are KMeansResult or (labels, distances)."""
    if op == "capacity_kmeans":
        lab_g, lab_c = on_cuda.labels, on_cpu.labels
        cost_g, cost_c = float(on_cuda.inertia), float(on_cpu.inertia)
    else:
        lab_g, lab_c = on_cuda[0], on_cpu[0]
        cost_g, cost_c = float(on_cuda[1].double().sum()), float(on_cpu[1].double().sum())
    lab_g = lab_g.detach().cpu()
    lab_c = lab_c.detach().cpu() if isinstance(lab_c, torch.Tensor) else torch.as_tensor(lab_c)
    if lab_g.shape != lab_c.shape or not torch.equal(lab_g.long(), lab_c.long()):
        n_diff = int((lab_g.long() != lab_c.long()).sum()) if lab_g.shape == lab_c.shape else -1
        return f"the CUDA labels differ from the C++/OpenMP labels on {n_diff} of {_KMEANS_N} points"
    if not abs(cost_g - cost_c) <= 1e-9 * max(abs(cost_c), 1e-300):
        return f"the CUDA cost {cost_g!r} differs from the C++/OpenMP cost {cost_c!r}"
    return None


def kmeans_backend(op: str, device: torch.device, chosen: str, kmeans_fn: Callable[..., Any],
                   cpu_native: bool) -> str:
    """The backend a K-means dispatcher should run: ``chosen``, unless the CUDA path failed its check.

    On the first ``chosen == "cuda"`` call on ``device``, runs ``kmeans_fn`` (the public
    ``capacity_kmeans`` or ``assign_with_capacity``) on a small problem with ``backend="cuda"`` and with
    ``backend="cpu"`` and compares (labels equal, costs within 1e-9); a failure warns once and makes
    every later call on that device take the fallback: ``"cpu"`` (the caller copies to the host) when the
    C++/OpenMP part is built (``cpu_native``), else ``"torch"``. Records the backend for
    :func:`backends_used`.
    """
    if chosen != "cuda":
        record_backend(op, chosen)
        return chosen
    fallback = "cpu" if cpu_native else "torch"
    key = _key(op, device, None)
    if check_failed(op, device, None):
        record_backend(op, fallback)
        return fallback
    if _needs_check(key, device):
        problem = _run_kmeans_check(op, torch.device(device), kmeans_fn, fallback)
        if problem is not None:
            _fail(key, problem, "C++/OpenMP (host copy)" if fallback == "cpu" else "torch")
            record_backend(op, fallback)
            return fallback
        with _lock:
            _status[key] = "ok"
    record_backend(op, "cuda")
    return "cuda"


def _run_kmeans_check(op: str, device: torch.device, kmeans_fn: Callable[..., Any], fallback: str) -> str | None:
    x, cent = _kmeans_inputs(device)
    cap = {"min_size": 40, "max_size": 90}  # binds on the blobs of 100 and 36 points
    if op == "capacity_kmeans":
        def run(inp: torch.Tensor, backend: str) -> Any:
            return kmeans_fn(inp, _KMEANS_K, **cap, n_init=1, max_iter=20, seed=0, backend=backend)
    else:
        def run(inp: torch.Tensor, backend: str) -> Any:
            return kmeans_fn(inp, cent.to(inp.device), **cap, backend=backend)
    try:
        on_cuda = run(x, "cuda")
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # an asynchronous launch failure surfaces here
    except Exception as exc:  # noqa: BLE001 - a launch failure is what the check is for
        return f"the CUDA kernel raised {_short(exc)}"
    on_ref = run(x.cpu(), fallback)
    return _compare_kmeans(op, on_cuda, on_ref)
