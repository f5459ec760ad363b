"""The definition of ``lm_head_features``: its input checks and its float64 reference, the oracle of the tests.

The maths are in :mod:`cluster_kernels.lm_head_features`, which holds the Triton vocabulary kernel, the vectorised
torch path and the dispatcher, and re-exports the public names here (``IGNORE_INDEX``, ``LM_HEAD_MODES``,
``lm_head_features_ref``), so importers keep importing them from there. The seam is the op's contract: which
inputs are valid (:func:`check_lm_head_inputs` and the per-example token counts) and what the result is
(:func:`lm_head_features_ref`, which validates its inputs with the very same checks). Both are plain torch / numpy,
so this module imports without Triton, a GPU or the native ``_C``; it depends only on the shared checks of
:mod:`cluster_kernels.project_linear_grads_reference` (offsets, 2-D float inputs, one device), and the op module
imports it, never the other way round.

========================================  =========================================================================
name                                      what it is
========================================  =========================================================================
``IGNORE_INDEX``, ``LM_HEAD_MODES``       the label of positions that do not count (-100); the two modes
``check_lm_head_inputs``                  every argument of ``lm_head_features`` (shapes, dtypes, devices, labels)
``counts_per_example``                    counted tokens per example (the ``paper`` mean's divisor)
``raise_if_empty_examples``               ``mode="paper"`` refuses examples without a counted token
``lm_head_features_ref``                  the definition: float64 logits (and each ``G_b`` for ``projected``)
========================================  =========================================================================
"""

from __future__ import annotations

import numpy as np
import torch

from cluster_kernels.project_linear_grads_reference import check_cu_seqlens, check_float_matrices, check_same_device

__all__ = [
    "IGNORE_INDEX",
    "LM_HEAD_MODES",
    "check_lm_head_inputs",
    "counts_per_example",
    "lm_head_features_ref",
    "raise_if_empty_examples",
]

_OP = "lm_head_features"
IGNORE_INDEX = -100
LM_HEAD_MODES = ("paper", "projected")


# --------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------


def check_lm_head_inputs(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    cu_seqlens: torch.Tensor,
    p_in: torch.Tensor | None,
    p_out: torch.Tensor | None,
    mode: str,
    bias: torch.Tensor | None,
    token_weights: torch.Tensor | None,
    out: torch.Tensor | None,
) -> np.ndarray:
    """Check every argument of :func:`lm_head_features` (``out`` may be None); returns the host int64 offsets."""
    if mode not in LM_HEAD_MODES:
        raise ValueError(f"{_OP}: mode must be one of {LM_HEAD_MODES}, got {mode!r}.")
    _check_h_and_weight(h, weight)
    check_same_device(_OP, "h", h.device, (("labels", labels), ("bias", bias), ("p_in", p_in), ("p_out", p_out),
                                           ("token_weights", token_weights), ("out", out)))
    n_tok, d = h.shape
    vocab = weight.shape[0]
    _check_labels(labels, h, vocab)
    cu = check_cu_seqlens(_OP, cu_seqlens, n_tok)
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (vocab,) or not bias.is_floating_point():
            raise ValueError(f"{_OP}: bias must be a floating tensor of shape (V,)=({vocab},) or None.")
        if bias.device != h.device:
            raise ValueError(f"{_OP}: bias is on {bias.device} but h is on {h.device}.")
    n_ex = len(cu) - 1
    if mode == "paper":
        _check_paper_mode(p_in, p_out, token_weights)
        expected = (n_ex, d)
    else:
        _check_projected_mode(h, vocab, p_in, p_out, token_weights)
        expected = (n_ex, p_out.shape[1], p_in.shape[1])
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{_OP}: out must be a float32 (or float64) tensor of shape {expected}.")
        if tuple(out.shape) != expected:
            raise ValueError(f"{_OP}: out must have shape {expected} for mode={mode!r}, got {tuple(out.shape)}.")
        if out.device != h.device:
            raise ValueError(f"{_OP}: out is on {out.device} but h is on {h.device}.")
    return cu


def _check_h_and_weight(h: torch.Tensor, weight: torch.Tensor) -> None:
    check_float_matrices(_OP, (("h", h), ("weight", weight)))
    d = h.shape[1]
    if weight.shape[1] != d:
        raise ValueError(
            f"{_OP}: weight must have shape (V, d={d}) to match h {tuple(h.shape)}, got {tuple(weight.shape)}."
        )
    if weight.device != h.device:
        raise ValueError(f"{_OP}: weight is on {weight.device} but h is on {h.device}; move them to one device.")


def _check_labels(labels: torch.Tensor, h: torch.Tensor, vocab: int) -> None:
    n_tok = h.shape[0]
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{_OP}: labels must be an int32/int64 torch.Tensor of shape ({n_tok},).")
    if labels.shape != (n_tok,):
        raise ValueError(f"{_OP}: labels must have shape (N_tok,)=({n_tok},), got {tuple(labels.shape)}.")
    if labels.device != h.device:
        raise ValueError(f"{_OP}: labels is on {labels.device} but h is on {h.device}.")
    bad = (labels >= vocab) | ((labels < 0) & (labels != IGNORE_INDEX))
    if bool(bad.any()):
        pos = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{_OP}: labels must be in [0, V={vocab}) or {IGNORE_INDEX} (ignored), "
            f"got labels[{pos}]={int(labels[pos])}."
        )


def _check_paper_mode(p_in: torch.Tensor | None, p_out: torch.Tensor | None,
                      token_weights: torch.Tensor | None) -> None:
    if p_in is not None or p_out is not None:
        raise ValueError(
            f"{_OP}: p_in/p_out are only used with mode='projected'; mode='paper' returns the "
            "unprojected (B, d) proxy. Drop them or use mode='projected'."
        )
    if token_weights is not None:
        raise ValueError(
            f"{_OP}: mode='paper' is the per-example mean over counted tokens and takes no "
            "token_weights; use mode='projected' for weighted sums."
        )


def _check_projected_mode(h: torch.Tensor, vocab: int, p_in: torch.Tensor | None, p_out: torch.Tensor | None,
                          token_weights: torch.Tensor | None) -> None:
    n_tok, d = h.shape
    for name, t, rows in (("p_in", p_in, d), ("p_out", p_out, vocab)):
        if t is None:
            raise ValueError(
                f"{_OP}: mode='projected' needs {name} of shape ({rows}, k); "
                "see cluster_kernels.projection.random_projection."
            )
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != rows or not t.is_floating_point():
            raise ValueError(
                f"{_OP}: {name} must be a floating 2-D tensor of shape ({rows}, k), "
                f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}."
            )
        if t.device != h.device:
            raise ValueError(f"{_OP}: {name} is on {t.device} but h is on {h.device}.")
    if token_weights is not None:
        if not isinstance(token_weights, torch.Tensor) or token_weights.shape != (n_tok,):
            raise ValueError(f"{_OP}: token_weights must be a floating tensor of shape ({n_tok},) or None.")
        if token_weights.device != h.device:
            raise ValueError(f"{_OP}: token_weights is on {token_weights.device} but h is on {h.device}.")


def counts_per_example(labels: torch.Tensor, cu: np.ndarray) -> np.ndarray:
    """Counted tokens (label != ``IGNORE_INDEX``) of each example, a host int64 array of length B."""
    valid = (labels != IGNORE_INDEX).to("cpu", torch.int64).numpy()
    csum = np.concatenate([[0], np.cumsum(valid)])
    return csum[cu[1:]] - csum[cu[:-1]]


def raise_if_empty_examples(counts: np.ndarray) -> None:
    """``mode="paper"``: refuse examples without a counted token (their mean is undefined), naming them."""
    empty = np.nonzero(counts == 0)[0]
    if len(empty):
        shown = ", ".join(str(int(i)) for i in empty[:10]) + (" ..." if len(empty) > 10 else "")
        raise ValueError(
            f"{_OP}: example {int(empty[0])} has no counted token (all its labels are {IGNORE_INDEX}), so its "
            f"mode='paper' mean is undefined (examples without counted tokens: {shown}). Drop these examples "
            "or give each at least one answer token."
        )


# --------------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------------


def lm_head_features_ref(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    p_in: torch.Tensor | None = None,
    p_out: torch.Tensor | None = None,
    mode: str,
    bias: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    upcast: bool = True,
) -> torch.Tensor:
    """Definition of ``lm_head_features`` with materialised logits (and ``G_b``); float64 by default.

    Returns:
        ``(B, d)`` for ``mode="paper"``, ``(B, k_o, k_i)`` for ``mode="projected"``; float64 when ``upcast``.
    """
    cu = check_lm_head_inputs(h, weight, labels, cu_seqlens, p_in, p_out, mode, bias, token_weights, None)
    dt = torch.float64 if upcast else torch.float32
    hs, ws = h.to(dt), weight.to(dt)
    logits = hs @ ws.T
    if bias is not None:
        logits = logits + bias.to(dt)
    probs = torch.softmax(logits, dim=-1)
    valid = labels != IGNORE_INDEX
    n_ex = len(cu) - 1
    if mode == "paper":
        raise_if_empty_examples(counts_per_example(labels, cu))
        res = torch.zeros(n_ex, h.shape[1], dtype=dt, device=h.device)
        for b in range(n_ex):
            sel = torch.arange(int(cu[b]), int(cu[b + 1]), device=h.device)
            sel = sel[valid[sel]]
            p_y = probs[sel, labels[sel].long()]
            res[b] = ((p_y - 1.0)[:, None] * hs[sel]).mean(dim=0)
        return res
    w = token_weights.to(dt) if token_weights is not None else torch.ones(h.shape[0], dtype=dt, device=h.device)
    pi, po = p_in.to(dt), p_out.to(dt)
    res = torch.zeros(n_ex, p_out.shape[1], p_in.shape[1], dtype=dt, device=h.device)
    for b in range(n_ex):
        sel = torch.arange(int(cu[b]), int(cu[b + 1]), device=h.device)
        sel = sel[valid[sel]]
        d_logits = probs[sel].clone()
        d_logits[torch.arange(len(sel), device=h.device), labels[sel].long()] -= 1.0
        grad_w = (d_logits * w[sel, None]).T @ hs[sel]  # (V, d): the full last-layer gradient
        res[b] = po.T @ grad_w @ pi
    return res
