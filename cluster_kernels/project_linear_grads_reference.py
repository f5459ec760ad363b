"""The definition of ``project_linear_grads``: its input checks and its float64 reference, the oracle of the tests.

The maths are in :mod:`cluster_kernels.project_linear_grads`, which holds the Triton kernel, the vectorised torch
path and the dispatcher, and re-exports every name here (import them from there). The seam is the op's contract:
what inputs are valid (:func:`check_project_inputs`, :func:`check_cu_seqlens`, shared with ``lm_head_features``)
and what the result is (:func:`project_linear_grads_ref`, which validates its inputs with the very same checks).
Both are plain torch / numpy, so this module imports without Triton, a GPU or the native ``_C``, and it imports no
other op module: the op modules import it, never the other way round.

========================================  =========================================================================
name                                      what it is
========================================  =========================================================================
``check_cu_seqlens``                      packed-sequence offsets checked and copied to the host once per tensor
``check_float_matrices``                  each named argument a 2-D float32/bfloat16/float16/float64 tensor
``check_same_device``                     each named tensor argument on the device of the first input
``check_project_inputs``                  every argument of ``project_linear_grads`` (shapes, dtypes, devices)
``project_linear_grads_ref``              the definition: forms ``dW_b`` per example and projects it (float64)
========================================  =========================================================================
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

__all__ = ["check_cu_seqlens", "check_float_matrices", "check_project_inputs", "check_same_device",
           "project_linear_grads_ref"]

_OP = "project_linear_grads"
_TORCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# --------------------------------------------------------------------------------------------------
# Shared checks
# --------------------------------------------------------------------------------------------------


# The last device offsets copied to the host: the featurizer hands one cu_seqlens to every layer of a batch, and a
# copy per layer would be one device synchronisation per layer. Keyed by the tensor itself (a weak reference) and
# its version counter, so an in-place change is copied again.
_last_offsets: tuple[weakref.ref, int, np.ndarray] | None = None


def _host_offsets(cu_seqlens: torch.Tensor) -> np.ndarray:
    """``cu_seqlens`` as a read-only host int64 array; a device tensor already copied (and unchanged) is not
    copied again."""
    global _last_offsets
    last = _last_offsets
    if last is not None and last[0]() is cu_seqlens and last[1] == cu_seqlens._version:
        return last[2]
    cu = cu_seqlens.detach().to("cpu", torch.int64).numpy()
    cu.setflags(write=False)
    _last_offsets = (weakref.ref(cu_seqlens), cu_seqlens._version, cu)
    return cu


def check_cu_seqlens(op: str, cu_seqlens: torch.Tensor, n_tok: int) -> np.ndarray:
    """Validate packed-sequence offsets and return them as a host int64 array.

    Args:
        op: op name used in error messages.
        cu_seqlens: ``(B + 1,)`` int32/int64 offsets, ``cu_seqlens[0] == 0``, non-decreasing,
            ``cu_seqlens[-1] == n_tok`` (an example may be empty).
        n_tok: number of packed tokens.

    Raises:
        TypeError: not an integer tensor.
        ValueError: wrong rank, empty, not starting at 0, decreasing, or not ending at ``n_tok``.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{op}: cu_seqlens must be a torch.Tensor of int32/int64, got {type(cu_seqlens).__name__}.")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}; convert with .long().")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(
            f"{op}: cu_seqlens must be 1-D with B + 1 >= 1 entries (offsets of B examples), "
            f"got shape {tuple(cu_seqlens.shape)}."
        )
    cu = _host_offsets(cu_seqlens)
    if cu[0] != 0:
        raise ValueError(f"{op}: cu_seqlens[0] must be 0, got {int(cu[0])}.")
    steps = np.diff(cu)
    if (steps < 0).any():
        bad = int(np.nonzero(steps < 0)[0][0])
        raise ValueError(
            f"{op}: cu_seqlens must be non-decreasing, but cu_seqlens[{bad + 1}]={int(cu[bad + 1])} < "
            f"cu_seqlens[{bad}]={int(cu[bad])} (example {bad} would have negative length)."
        )
    if cu[-1] != n_tok:
        raise ValueError(
            f"{op}: cu_seqlens[-1] must equal the number of packed tokens {n_tok}, got {int(cu[-1])}; "
            "offsets are cumulative lengths starting at 0."
        )
    return cu


def check_float_matrices(op: str, named: tuple[tuple[str, object], ...]) -> None:
    """Each ``(name, value)`` of ``named`` must be a 2-D float32/bfloat16/float16/float64 torch.Tensor.

    Raises:
        TypeError: not a tensor, or another dtype. ValueError: not 2-D.
    """
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 2:
            raise ValueError(f"{op}: {name} must be 2-D, got shape {tuple(t.shape)}.")
        if t.dtype not in _TORCH_DTYPES:
            raise TypeError(f"{op}: {name} must be float32/bfloat16/float16/float64, got {t.dtype}.")


def check_same_device(op: str, first: str, device: torch.device, named: tuple[tuple[str, object], ...]) -> None:
    """Each tensor of ``named`` (``(name, value)``; other values are skipped) must be on ``device``, the device of
    the input named ``first``; checked before anything reads the data.

    Raises:
        ValueError: naming the first tensor on another device.
    """
    for name, t in named:
        if isinstance(t, torch.Tensor) and t.device != device:
            raise ValueError(
                f"{op}: {name} is on {t.device} but {first} is on {device}; move all inputs to one device."
            )


def check_project_inputs(
    x: torch.Tensor,
    g: torch.Tensor,
    cu_seqlens: torch.Tensor,
    p_in: torch.Tensor,
    p_out: torch.Tensor,
    token_weights: torch.Tensor | None,
    out: torch.Tensor | None,
) -> np.ndarray:
    """Check every argument of :func:`~cluster_kernels.project_linear_grads.project_linear_grads` (``out`` may be
    None); returns ``cu_seqlens`` as a host int64 array (:func:`check_cu_seqlens`)."""
    check_float_matrices(_OP, (("x", x), ("g", g), ("p_in", p_in), ("p_out", p_out)))
    if x.dtype != g.dtype:
        raise TypeError(f"{_OP}: x and g must have the same dtype, got x {x.dtype} and g {g.dtype}; cast one of them.")
    check_same_device(_OP, "x", x.device, (("g", g), ("p_in", p_in), ("p_out", p_out),
                                           ("token_weights", token_weights), ("out", out)))
    n_tok, d_in = x.shape
    if g.shape[0] != n_tok:
        raise ValueError(f"{_OP}: x and g must have the same number of tokens, got x {n_tok} and g {g.shape[0]}.")
    d_out = g.shape[1]
    if p_in.shape[0] != d_in:
        raise ValueError(f"{_OP}: p_in must have shape (d_in={d_in}, k_i), got {tuple(p_in.shape)}.")
    if p_out.shape[0] != d_out:
        raise ValueError(f"{_OP}: p_out must have shape (d_out={d_out}, k_o), got {tuple(p_out.shape)}.")
    cu = check_cu_seqlens(_OP, cu_seqlens, n_tok)
    if token_weights is not None:
        if not isinstance(token_weights, torch.Tensor) or not token_weights.is_floating_point():
            raise TypeError(f"{_OP}: token_weights must be a floating torch.Tensor of shape (N_tok,) or None.")
        if token_weights.shape != (n_tok,):
            raise ValueError(f"{_OP}: token_weights must have shape ({n_tok},), got {tuple(token_weights.shape)}.")
    if out is not None:
        expected = (len(cu) - 1, p_out.shape[1], p_in.shape[1])
        if not isinstance(out, torch.Tensor) or out.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{_OP}: out must be a float32 (or float64) torch.Tensor of shape {expected}.")
        if tuple(out.shape) != expected:
            raise ValueError(f"{_OP}: out must have shape (B, k_o, k_i)={expected}, got {tuple(out.shape)}.")
    return cu


# --------------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------------


def project_linear_grads_ref(
    x: torch.Tensor,
    g: torch.Tensor,
    cu_seqlens: torch.Tensor,
    p_in: torch.Tensor,
    p_out: torch.Tensor,
    *,
    token_weights: torch.Tensor | None = None,
    upcast: bool = True,
) -> torch.Tensor:
    """Definition of the op: ``P_out^T (sum_t w_t g_t x_t^T) P_in`` per example, forming ``dW_b``.

    Args:
        x: ``(N_tok, d_in)`` layer inputs. g: ``(N_tok, d_out)`` output gradients.
        cu_seqlens: ``(B + 1,)`` offsets. p_in: ``(d_in, k_i)``. p_out: ``(d_out, k_o)``.
        token_weights: optional ``(N_tok,)`` weights ``w_t``.
        upcast: compute in float64 (the oracle); otherwise in float32.

    Returns:
        ``(B, k_o, k_i)`` float64 (``upcast``) or float32 tensor.
    """
    cu = check_project_inputs(x, g, cu_seqlens, p_in, p_out, token_weights, None)
    dt = torch.float64 if upcast else torch.float32
    xs, gs, pi, po = x.to(dt), g.to(dt), p_in.to(dt), p_out.to(dt)
    w = token_weights.to(dt) if token_weights is not None else torch.ones(x.shape[0], dtype=dt, device=x.device)
    res = torch.zeros(len(cu) - 1, p_out.shape[1], p_in.shape[1], dtype=dt, device=x.device)
    for b in range(len(cu) - 1):
        s, e = int(cu[b]), int(cu[b + 1])
        d_w = (gs[s:e] * w[s:e, None]).T @ xs[s:e]  # (d_out, d_in): the gradient the fast paths never form
        res[b] = po.T @ d_w @ pi
    return res
