"""Per-example causal-LM loss and the plan-weighted batch loss.

``per_example_loss(logits, labels)[b]`` is example ``b``'s mean next-token cross entropy over its answer
tokens: after the causal shift (``logits[:, t]`` predicts ``labels[:, t + 1]``, the Hugging Face
convention where ``labels[t] == input_ids[t]``) every position whose label is not -100 counts once.
This is the per-example loss the featurizer's gradients are taken of, so the examples a plan weights
are the examples its features described.

Memory. The cross entropy is computed by a custom autograd function over the answer tokens only, in
chunks of ``chunk_tokens`` rows of the vocabulary: forward keeps one float32 log-sum-exp per token,
backward recomputes the softmax chunk by chunk and writes the gradient straight into a tensor shaped
like ``logits`` (in its dtype). Beyond the logits and their gradient, at most one ``(chunk, V)`` float32
block exists at a time, never a ``(B*T, V)`` float32 copy. The maths is float32 for float32/bf16/fp16
logits and float64 for float64 logits.

``weighted_loss(loss, w) = mean_b(w_b * loss_b)``: with plan weights (mean 1 over the selection) DDP's
gradient average of this loss over ranks estimates the full-data gradient ``sum_c (n_c / N) g_c``.
"""

from __future__ import annotations

from typing import Any

import torch

from cluster_kernels.lm_head_features import IGNORE_INDEX

__all__ = ["per_example_loss", "weighted_loss"]

# Default chunk: 2**26 float32 elements (256 MiB) of (chunk, V) logits at a time.
_CHUNK_ELEMENTS = 1 << 26


class _TokenNLL(torch.autograd.Function):
    """NLL of ``targets`` under ``logits[rows, cols]`` (one row of V logits per token), chunked."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        rows: torch.Tensor,
        cols: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
        compute_dtype: torch.dtype,
    ) -> torch.Tensor:
        n = rows.numel()
        nll = torch.empty(n, dtype=compute_dtype, device=logits.device)
        lse = torch.empty(n, dtype=compute_dtype, device=logits.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            x = logits[rows[s:e], cols[s:e]].to(compute_dtype)  # (c, V): the only float32 copy
            lse[s:e] = torch.logsumexp(x, dim=-1)
            nll[s:e] = lse[s:e] - x.gather(1, targets[s:e, None]).squeeze(1)
        ctx.save_for_backward(logits, rows, cols, targets, lse)
        ctx.chunk = chunk
        ctx.compute_dtype = compute_dtype
        return nll

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_nll: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, rows, cols, targets, lse = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        n, chunk = rows.numel(), ctx.chunk
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            x = logits[rows[s:e], cols[s:e]].to(ctx.compute_dtype)
            # d nll / d x = softmax(x) - onehot(target)
            p = torch.exp(x - lse[s:e, None])
            p[torch.arange(e - s, device=p.device), targets[s:e]] -= 1.0
            p *= grad_nll[s:e, None].to(ctx.compute_dtype)
            grad[rows[s:e], cols[s:e]] = p.to(grad.dtype)
        return grad, None, None, None, None, None


def per_example_loss(logits: torch.Tensor, labels: torch.Tensor, *, chunk_tokens: int | None = None) -> torch.Tensor:
    """Mean next-token cross entropy over each example's answer tokens.

    Args:
        logits: (B, T, V) float logits of a causal LM (any float dtype; bf16 is upcast per chunk).
        labels: (B, T) int64 labels, -100 on positions that are not trained (prompt, padding).
        chunk_tokens: answer tokens per chunk of the vocabulary pass; default ``2**26 // V`` (256 MiB of
            float32 per chunk).

    Returns:
        (B,) float32 (float64 for float64 logits) per-example loss, differentiable w.r.t. ``logits``.

    Raises:
        TypeError: logits not floating point or labels not integer.
        ValueError: shapes that do not match, labels outside ``[0, V)`` other than -100, a non-positive
            ``chunk_tokens``, or examples without any answer token after the shift (named by row).
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        got = getattr(logits, "dtype", type(logits))
        raise TypeError(f"per_example_loss: logits must be a floating-point tensor, got {got}.")
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.dtype == torch.bool:
        got = getattr(labels, "dtype", type(labels))
        raise TypeError(f"per_example_loss: labels must be an integer tensor, got {got}.")
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"per_example_loss: expected logits (B, T, V) and labels (B, T), got logits {tuple(logits.shape)} and "
            f"labels {tuple(labels.shape)}."
        )
    b, _, v = logits.shape
    if chunk_tokens is None:
        chunk_tokens = max(1, _CHUNK_ELEMENTS // max(v, 1))
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"per_example_loss: chunk_tokens must be a positive int, got {chunk_tokens!r}.")
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    labels = labels.to(device=logits.device, dtype=torch.int64)
    target = labels[:, 1:]
    valid = target != IGNORE_INDEX
    counts = valid.sum(dim=1)
    empty = (counts == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"per_example_loss: rows {empty[:10]}{' ...' if len(empty) > 10 else ''} of labels have no answer token "
            "after the causal shift (all labels past the first position are -100); drop those examples or fix "
            "their labels."
        )
    rows, cols = valid.nonzero(as_tuple=True)
    targets = target[rows, cols]
    bad = (targets < 0) | (targets >= v)
    if bool(bad.any()):
        first = int(targets[bad][0])
        raise ValueError(f"per_example_loss: labels must be -100 or in [0, {v}) (vocabulary size), got {first}.")
    nll = _TokenNLL.apply(logits, rows, cols, targets, chunk_tokens, compute_dtype)
    sums = torch.zeros(b, dtype=compute_dtype, device=logits.device).index_add(0, rows, nll)
    return sums / counts.to(compute_dtype)


def weighted_loss(per_example_loss: torch.Tensor, weights: torch.Tensor | Any) -> torch.Tensor:
    """Plan-weighted batch loss ``mean_b(weights[b] * per_example_loss[b])``.

    Args:
        per_example_loss: (B,) float per-example losses (e.g. from :func:`per_example_loss`).
        weights: (B,) non-negative weights (a tensor or array-like); moved to the loss's device and dtype.

    Returns:
        0-dim tensor in the loss's dtype.

    Raises:
        TypeError: per_example_loss not a floating-point tensor.
        ValueError: an empty batch, shapes that differ, or negative / NaN weights.
    """
    if not isinstance(per_example_loss, torch.Tensor) or not per_example_loss.is_floating_point():
        raise TypeError(
            f"weighted_loss: per_example_loss must be a floating-point tensor, got {type(per_example_loss).__name__}."
        )
    weights = torch.as_tensor(weights)
    if per_example_loss.dim() != 1 or per_example_loss.numel() == 0:
        raise ValueError(
            f"weighted_loss: per_example_loss must have shape (B,) with B > 0, got {tuple(per_example_loss.shape)}."
        )
    if weights.shape != per_example_loss.shape:
        raise ValueError(
            f"weighted_loss: weights must have the loss's shape {tuple(per_example_loss.shape)}, got "
            f"{tuple(weights.shape)}."
        )
    weights = weights.to(device=per_example_loss.device, dtype=per_example_loss.dtype)
    if not bool((weights >= 0).all()):
        raise ValueError("weighted_loss: weights must be >= 0 and not NaN; pass the plan's weights.")
    return (weights * per_example_loss).mean()
