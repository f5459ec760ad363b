"""Per-example lm-head gradient features in one pass over the vocabulary, without a logits tensor.

Maths. With logits ``z_t = W h_t (+ b)`` (``W`` of shape ``(V, d)``), ``p_t = softmax(z_t)`` and target
``y_t``, the cross-entropy gradient w.r.t. the logits is ``p_t - e_{y_t}`` and the last-layer gradient
of example ``b`` is ``G_b = sum_{t in b} w_t (p_t - e_{y_t}) h_t^T`` (``V x d``). Tokens whose label is
``-100`` do not count.

- ``mode="paper"`` (the authors' proxy, no projection): per example
  ``mean_{t in b} (p_t(y_t) - 1) h_t``  (``d``), the mean over that example's counted tokens. This is
  the gradient w.r.t. the output-embedding rows of the targets, summed.
- ``mode="projected"``: the Kronecker projection ``P_out^T G_b P_in`` (``k_o x k_i``) with
  ``P_out (V, k_o)``, ``P_in (d, k_i)``. Because ``P_out^T (p_t - e_y) = sum_v p_t[v] P_out[v] - P_out[y]``
  is an attention read-out (keys = rows of ``W``, values = rows of ``P_out``), it is computed with an
  online log-sum-exp over vocabulary chunks, as in flash attention: running max ``m``, running sum
  ``l`` and running read-out ``a``; for each chunk ``m' = max(m, max z)``, ``l = l e^{m-m'} + sum e^{z-m'}``,
  ``a = a e^{m-m'} + e^{z-m'} P_out[chunk]``. Memory is ``O(T k_o)``, never ``O(T V)``. The per-token
  projected gradients are then reduced per example exactly like ``project_linear_grads``.

``p_t(y_t) = exp(z_t[y_t] - lse_t)`` comes out of the same pass. Only counted tokens (label != -100)
enter the vocabulary pass: prompts cost nothing there.

Implementations:

- ``lm_head_features_ref``: materialises the float64 logits and, for ``projected``, each ``G_b``. Oracle.
  It lives, with the input checks it shares with the fast paths, in
  :mod:`cluster_kernels.lm_head_features_reference` (the op's contract, in plain torch; this module was over
  600 lines with it) and is re-exported here, as are ``IGNORE_INDEX`` and ``LM_HEAD_MODES``.
- Triton kernel (CUDA; CPU under ``TRITON_INTERPRET=1``): one program per block of tokens streams
  ``W`` (and ``P_out``) in vocabulary chunks; logits live only in registers. The logits product runs
  in the inputs' dtype (bf16/fp16 tensor cores, fp32 accumulation; IEEE fp32 for fp32 inputs), the
  softmax statistics and read-out in fp32.
- Vectorised torch path: token chunks x vocabulary chunks with at most ``max_chunk_elems`` logits alive.

The first Triton call on a CUDA device is self-checked against the torch path on its first examples
(``cluster_kernels._selfcheck``); a failure warns once and the torch path runs from then on.

All-ignored examples: ``mode="paper"`` raises a ``ValueError`` naming the example (its mean is
undefined); ``mode="projected"`` is a sum and gives that example a zero feature.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
import torch.nn.functional as F

from cluster_kernels._backend import has_triton, missing_backend_error, require_triton
from cluster_kernels._selfcheck import backend_for, check_prefix, compare_features, record_backend, run_first_use
from cluster_kernels.lm_head_features_reference import (
    IGNORE_INDEX,
    LM_HEAD_MODES,
    check_lm_head_inputs,
    counts_per_example,
    lm_head_features_ref,
    raise_if_empty_examples,
)
from cluster_kernels.project_linear_grads import project_linear_grads_triton, resolve_backend, segment_outer_sum

__all__ = ["IGNORE_INDEX", "LM_HEAD_MODES", "example_mean_nll", "lm_head_features", "lm_head_features_ref"]

_OP = "lm_head_features"
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_MAX_CHUNK_ELEMS = 1 << 20  # logits alive at once on the torch path (4 MiB in fp32)
_TORCH_VOCAB_CHUNK = 8192


# --------------------------------------------------------------------------------------------------
# Triton kernel: one vocabulary pass per block of tokens
# --------------------------------------------------------------------------------------------------

# GPU autotune configs as ((BLOCK_T, BLOCK_V, BLOCK_D, num_warps, num_stages), precision, largest BLOCK_K), plain
# tuples so that the compile gate (tests/cluster_kernels/test_aot_compile.py) and benchmarks/ptxas_report.py read
# them without a GPU; each is spill-free on sm_80, sm_90 and sm_100 for every key :func:`vocab_configs_for` gives it
# (BENCHMARKS.md has the register table; largest BLOCK_K 0 = the paper mode only, which has no read-out). 16-bit
# inputs ("tf32": bf16/fp16 tensor-core logits, TF32 read-out) take large tiles: W is re-read once per BLOCK_T
# tokens. float32 inputs ("ieee") run both products on the FMA units, whose operands Triton replicates across
# threads, so their tiles stay small; the (BLOCK_T, BLOCK_K) read-out accumulator and (BLOCK_V, BLOCK_K) P_out tile
# of BLOCK_K = 64 / 128 take the smallest ones.
LMH_GPU_CONFIGS: tuple[tuple[tuple[int, int, int, int, int], str, int], ...] = (
    ((128, 64, 64, 8, 3), "tf32", 64),
    ((64, 64, 64, 8, 3), "tf32", 128),
    ((64, 128, 64, 8, 2), "tf32", 16),
    ((128, 128, 64, 8, 2), "tf32", 0),
    ((64, 64, 32, 8, 2), "ieee", 16),
    ((64, 32, 16, 4, 2), "ieee", 128),
    ((32, 64, 16, 4, 2), "ieee", 32),
    ((32, 32, 32, 4, 2), "ieee", 128),
)


def lm_head_block_k(k_o: int) -> int:
    """The read-out block of the vocabulary kernel for ``k_o`` projected rows: 16, 32, 64 or 128."""
    return max(16, min(128, 1 << (k_o - 1).bit_length()))


def vocab_configs_for(precision: str, block_k: int, has_proj: bool) -> list[tuple[int, int, int, int, int]]:
    """The GPU configs the autotuner tries for one key of the vocabulary kernel (module comment above)."""
    return [cfg for cfg, prec, max_k in LMH_GPU_CONFIGS if prec == precision and (not has_proj or block_k <= max_k)]


def prune_vocab_configs(configs: list, named_args: dict, **kwargs: object) -> list:
    """Triton ``early_config_prune`` hook: keep the configs :func:`vocab_configs_for` allows for this key."""
    keep = set(vocab_configs_for(str(kwargs["PRECISION"]), int(kwargs["BLOCK_K"]), bool(kwargs["HAS_PROJ"])))
    kept = [c for c in configs
            if (c.kwargs["BLOCK_T"], c.kwargs["BLOCK_V"], c.kwargs["BLOCK_D"], c.num_warps, c.num_stages) in keep]
    return kept or list(configs)  # the interpreter's single config is not in the GPU list


if has_triton():
    import triton
    import triton.language as tl

    if _INTERPRET:
        _LMH_CONFIGS = [triton.Config({"BLOCK_T": 16, "BLOCK_V": 32, "BLOCK_D": 32}, num_warps=1)]
    else:  # pragma: no cover - GPU only
        _LMH_CONFIGS = [
            triton.Config({"BLOCK_T": bt, "BLOCK_V": bv, "BLOCK_D": bd}, num_warps=nw, num_stages=ns)
            for (bt, bv, bd, nw, ns), _, _ in LMH_GPU_CONFIGS
        ]

    @triton.autotune(
        configs=_LMH_CONFIGS,
        key=["d", "V", "BLOCK_K", "HAS_PROJ", "PRECISION"],
        prune_configs_by={"early_config_prune": prune_vocab_configs},
    )
    @triton.jit
    def lm_head_vocab_kernel(
        h_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        p_ptr,
        lse_ptr,
        zy_ptr,
        read_ptr,
        n_tok,
        d,
        V,
        k_o,
        stride_ht,
        stride_hd,
        stride_wv,
        stride_wd,
        stride_pv,
        stride_pk,
        stride_rt,
        stride_rk,
        HAS_BIAS: tl.constexpr,
        HAS_PROJ: tl.constexpr,
        LOWP: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # One program: BLOCK_T tokens x BLOCK_K read-out columns, streaming W (and P_out) by BLOCK_V rows.
        pid_t = tl.program_id(0)
        pid_k = tl.program_id(1)
        # 64-bit base pointers per block; 32-bit offsets inside a tile (fewer registers than 64-bit tiles).
        t0 = pid_t.to(tl.int64) * BLOCK_T
        rows = tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_V)
        mask_t = rows < n_tok - t0
        h_base = h_ptr + t0 * stride_ht
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_o
        y = tl.load(y_ptr + t0 + rows, mask=mask_t, other=-1).to(tl.int32)  # labels < V < 2**31
        m = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros((BLOCK_T,), dtype=tl.float32)
        z_y = tl.zeros((BLOCK_T,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        w_base = w_ptr  # advanced by BLOCK_V rows per step (64-bit pointer, 32-bit step)
        p_base = p_ptr
        for v0 in range(0, V, BLOCK_V):
            mask_v = cols < V - v0
            logits = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
            for d0 in range(0, d, BLOCK_D):
                offs_d = d0 + tl.arange(0, BLOCK_D)
                mask_d = offs_d < d
                ht = tl.load(
                    h_base + rows[:, None] * stride_ht + offs_d[None, :] * stride_hd,
                    mask=mask_t[:, None] & mask_d[None, :],
                    other=0.0,
                )
                wt = tl.load(
                    w_base + cols[:, None] * stride_wv + offs_d[None, :] * stride_wd,
                    mask=mask_v[:, None] & mask_d[None, :],
                    other=0.0,
                )
                if LOWP:
                    logits += tl.dot(ht, tl.trans(wt.to(ht.dtype)))
                else:
                    logits += tl.dot(ht.to(tl.float32), tl.trans(wt.to(tl.float32)), input_precision=PRECISION)
            if HAS_BIAS:
                logits += tl.load(b_ptr + v0 + cols, mask=mask_v, other=0.0).to(tl.float32)[None, :]
            logits = tl.where(mask_v[None, :], logits, float("-inf"))
            z_y += tl.sum(tl.where((v0 + cols)[None, :] == y[:, None], logits, 0.0), axis=1)
            m_new = tl.maximum(m, tl.max(logits, axis=1))
            alpha = tl.exp(m - m_new)
            p_exp = tl.exp(logits - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p_exp, axis=1)
            if HAS_PROJ:
                pv = tl.load(
                    p_base + cols[:, None] * stride_pv + offs_k[None, :] * stride_pk,
                    mask=mask_v[:, None] & mask_k[None, :],
                    other=0.0,
                )
                acc = acc * alpha[:, None] + tl.dot(p_exp, pv.to(tl.float32), input_precision=PRECISION)
                p_base += BLOCK_V * stride_pv
            m = m_new
            w_base += BLOCK_V * stride_wv
        if pid_k == 0:
            tl.store(lse_ptr + t0 + rows, m + tl.log(l_sum), mask=mask_t)
            tl.store(zy_ptr + t0 + rows, z_y, mask=mask_t)
        if HAS_PROJ:
            tl.store(
                read_ptr + t0 * stride_rt + rows[:, None] * stride_rt + offs_k[None, :] * stride_rk,
                acc / l_sum[:, None],
                mask=mask_t[:, None] & mask_k[None, :],
            )


def vocab_pass_kernel_args(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, p_out: torch.Tensor | None,
    lse: torch.Tensor, z_y: torch.Tensor, readout: torch.Tensor,
) -> dict[str, object]:
    """Every argument of the vocabulary kernel but the autotuned blocks, by name (the compile gate builds them too).

    Args:
        h: ``(T, d)``; weight: ``(V, d)``; bias: ``(V,)`` or None; y: ``(T,)`` labels; p_out: ``(V, k_o)`` float32
            or None (``mode="paper"``); lse, z_y: ``(T,)`` float32 outputs; readout: ``(T, k_o)`` float32 output
            (any float32 tensor when ``p_out`` is None).
    """
    k_o = p_out.shape[1] if p_out is not None else 1
    p = p_out if p_out is not None else weight  # dummy pointer when HAS_PROJ is False
    lowp = h.dtype != torch.float32
    return {
        "h_ptr": h, "w_ptr": weight, "b_ptr": bias if bias is not None else weight, "y_ptr": y, "p_ptr": p,
        "lse_ptr": lse, "zy_ptr": z_y, "read_ptr": readout, "n_tok": h.shape[0], "d": h.shape[1],
        "V": weight.shape[0], "k_o": k_o, "stride_ht": h.stride(0), "stride_hd": h.stride(1),
        "stride_wv": weight.stride(0), "stride_wd": weight.stride(1), "stride_pv": p.stride(0),
        "stride_pk": p.stride(1), "stride_rt": readout.stride(0), "stride_rk": readout.stride(-1),
        "HAS_BIAS": bias is not None, "HAS_PROJ": p_out is not None, "LOWP": lowp,
        "PRECISION": "tf32" if lowp else "ieee", "BLOCK_K": lm_head_block_k(k_o),
    }


def _vocab_pass_triton(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, p_out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per token: ``lse``, target logit ``z_y`` and ``sum_v p[v] P_out[v]`` (float32), no logits stored."""
    require_triton(_OP)
    if h.dtype not in _TRITON_DTYPES or weight.dtype not in _TRITON_DTYPES:
        raise TypeError(
            f"{_OP}: backend='triton' takes float32/bfloat16/float16 h and weight, got {h.dtype} and "
            f"{weight.dtype}; use backend='torch' for float64."
        )
    if h.device.type != "cuda" and not _INTERPRET:
        raise missing_backend_error(
            _OP,
            "triton",
            f"the tensors are on {h.device} and TRITON_INTERPRET is not 1",
            "move the tensors to a CUDA device (or set TRITON_INTERPRET=1 before importing cluster_kernels, "
            "for testing)",
        )
    n_tok = h.shape[0]
    dev = h.device
    lse = torch.empty(n_tok, dtype=torch.float32, device=dev)
    z_y = torch.empty(n_tok, dtype=torch.float32, device=dev)
    if n_tok == 0:
        return lse, z_y, (None if p_out is None else torch.empty(0, p_out.shape[1], dtype=torch.float32, device=dev))
    k_o = p_out.shape[1] if p_out is not None else 1
    readout = torch.empty(n_tok, k_o, dtype=torch.float32, device=dev) if p_out is not None else lse
    args = vocab_pass_kernel_args(h, weight, bias, y, p_out, lse, z_y, readout)
    # Each k block recomputes the logits: k_o <= 128 (one block) is the intended use.
    n_k = triton.cdiv(k_o, args["BLOCK_K"]) if p_out is not None else 1
    lm_head_vocab_kernel[lambda meta: (triton.cdiv(n_tok, meta["BLOCK_T"]), n_k)](**args)
    return lse, z_y, (readout if p_out is not None else None)


# --------------------------------------------------------------------------------------------------
# Vectorised torch path
# --------------------------------------------------------------------------------------------------


def _vocab_pass_torch(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    p_out: torch.Tensor | None,
    max_chunk_elems: int = DEFAULT_MAX_CHUNK_ELEMS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Same outputs as the kernel, with at most ``max_chunk_elems`` logits alive at a time.

    Per vocabulary chunk: one GEMM, one fused ``logsumexp``, and for the read-out the chunk's
    probabilities relative to the running normaliser ``exp(z - lse')``; the running read-out is rescaled by
    ``exp(lse - lse')``, so it is normalised at every step (few passes over each chunk: CPU time is
    dominated by the GEMM).
    """
    ct = torch.float64 if h.dtype == torch.float64 else torch.float32
    n_tok, _ = h.shape
    vocab = weight.shape[0]
    # Wide vocabulary chunks keep each GEMM efficient (narrow ones measured 2-5x slower on CPU); the
    # token chunk then takes what is left of the budget.
    v_chunk = max(1, min(vocab, _TORCH_VOCAB_CHUNK, max_chunk_elems))
    t_chunk = max(1, min(n_tok, max_chunk_elems // v_chunk))
    lse = torch.empty(n_tok, dtype=ct, device=h.device)
    z_y = torch.empty(n_tok, dtype=ct, device=h.device)
    readout = torch.empty(n_tok, p_out.shape[1], dtype=ct, device=h.device) if p_out is not None else None
    for s in range(0, n_tok, t_chunk):
        e = min(n_tok, s + t_chunk)
        hc = h[s:e].to(ct)
        yc = y[s:e].long()
        z_y[s:e] = (hc * weight[yc].to(ct)).sum(dim=1) + (bias[yc].to(ct) if bias is not None else 0.0)
        run_lse = torch.full((e - s,), float("-inf"), dtype=ct, device=h.device)
        acc = torch.zeros(e - s, p_out.shape[1], dtype=ct, device=h.device) if p_out is not None else None
        for v0 in range(0, vocab, v_chunk):
            v1 = min(vocab, v0 + v_chunk)
            logits = F.linear(hc, weight[v0:v1].to(ct), bias[v0:v1].to(ct) if bias is not None else None)
            new_lse = torch.logaddexp(run_lse, torch.logsumexp(logits, dim=1))
            if acc is not None:
                logits.sub_(new_lse[:, None]).exp_()  # in place: no second (chunk, V) buffer
                acc.mul_(torch.exp(run_lse - new_lse)[:, None]).addmm_(logits, p_out[v0:v1].to(ct))
            run_lse = new_lse
        lse[s:e] = run_lse
        if acc is not None:
            readout[s:e] = acc
    return lse, z_y, readout


# --------------------------------------------------------------------------------------------------
# Dispatcher
# --------------------------------------------------------------------------------------------------


def lm_head_features(
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
    out: torch.Tensor | None = None,
    backend: str = "auto",
    max_chunk_elems: int = DEFAULT_MAX_CHUNK_ELEMS,
    losses: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-example lm-head gradient features without materialising the ``(T, V)`` logits.

    Args:
        h: ``(N_tok, d)`` last hidden states (the lm head's inputs), packed by ``cu_seqlens``;
            float32/bfloat16/float16 (float64 on the torch backend).
        weight: ``(V, d)`` lm-head weight; ``bias``: optional ``(V,)``.
        labels: ``(N_tok,)`` int target of each position (already shifted: the token that position
            predicts), ``-100`` for positions that do not count.
        cu_seqlens: ``(B + 1,)`` int32/int64 offsets.
        p_in: ``(d, k_i)``, p_out: ``(V, k_o)``: projections, ``mode="projected"`` only.
        mode: ``"paper"``: ``mean_t (p_t(y_t) - 1) h_t`` per example, ``(B, d)``. ``"projected"``:
            ``P_out^T [sum_t w_t (p_t - e_{y_t}) h_t^T] P_in``, ``(B, k_o, k_i)``.
        token_weights: optional ``(N_tok,)`` weights ``w_t`` (``projected`` only; e.g. ``1/n_b`` for a mean).
        out: optional float32 tensor of the result's shape to accumulate into.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` | ``"cpu"`` (alias of torch); ``"cuda"`` is refused.
        max_chunk_elems: torch path only: logits alive at a time (memory bound).
        losses: optional ``(B,)`` floating tensor on ``h``'s device that receives each example's mean cross-entropy
            ``mean_t (lse_t - z_t[y_t])`` over its counted tokens (0 without one), from the same vocabulary pass
            (overwritten, not accumulated).

    Returns:
        float32 tensor (float64 for float64 inputs on the torch backend when ``out`` is None).

    Raises:
        TypeError / ValueError: bad shapes, dtypes, devices, labels outside ``[0, V)`` and not ``-100``,
            projections missing or given in the wrong mode; ``mode="paper"`` with an example whose labels are
            all ``-100`` (the message names the example).
        RuntimeError: an explicitly requested backend is not available.
    """
    cu = check_lm_head_inputs(h, weight, labels, cu_seqlens, p_in, p_out, mode, bias, token_weights, out)
    chosen = resolve_backend(_OP, backend, h.device)
    counts = counts_per_example(labels, cu)
    if mode == "paper":
        raise_if_empty_examples(counts)
    if losses is not None and (losses.shape != (len(cu) - 1,) or not losses.is_floating_point()
                               or losses.device != h.device):
        raise ValueError(f"{_OP}: losses must be a floating ({len(cu) - 1},) tensor on {h.device}, got "
                         f"{tuple(losses.shape)} {losses.dtype} on {losses.device}.")
    compute = functools.partial(
        _features, h, weight, labels, cu, counts, p_in=p_in, p_out=p_out, mode=mode, bias=bias,
        token_weights=token_weights, max_chunk_elems=max_chunk_elems, losses=losses,
    )
    check = False
    if chosen == "triton":
        chosen, check = backend_for(_OP, h.device, h.dtype, "triton", "torch")
    else:
        record_backend(_OP, chosen)
    if not check or h.shape[0] == 0:
        return compute(chosen, out)
    res = run_first_use(
        _OP, h.device, h.dtype, ("triton", "torch"), lambda: compute("triton", None),
        lambda got: _verify_prefix(got, h, weight, labels, cu, p_in, p_out, mode, bias, token_weights),
        lambda: compute("torch", None),
    )
    if out is None:
        return res
    out += res.to(out.dtype)
    return out


def _verify_prefix(got: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, cu: np.ndarray,
                   p_in: torch.Tensor | None, p_out: torch.Tensor | None, mode: str, bias: torch.Tensor | None,
                   token_weights: torch.Tensor | None) -> str | None:
    """The first-use check: the kernel's features of the first examples against the torch path's."""
    j = check_prefix(cu)
    n = int(cu[j])
    ref = lm_head_features(
        h[:n], weight, labels[:n], torch.from_numpy(cu[: j + 1].copy()), p_in=p_in, p_out=p_out, mode=mode,
        bias=bias, token_weights=None if token_weights is None else token_weights[:n], backend="torch",
    )
    return compare_features(got[:j], ref, h.dtype, "triton")


def _features(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, cu: np.ndarray, counts: np.ndarray,
              chosen: str, out: torch.Tensor | None, *, p_in: torch.Tensor | None, p_out: torch.Tensor | None,
              mode: str, bias: torch.Tensor | None, token_weights: torch.Tensor | None,
              max_chunk_elems: int, losses: torch.Tensor | None = None) -> torch.Tensor:
    """The features on the ``chosen`` backend, added to ``out`` (a new tensor when None); ``losses`` receives each
    example's mean cross-entropy from the same pass."""
    n_ex = len(cu) - 1
    ct = torch.float64 if (h.dtype == torch.float64 and chosen == "torch") else torch.float32
    if out is None:
        shape = (n_ex, h.shape[1]) if mode == "paper" else (n_ex, p_out.shape[1], p_in.shape[1])
        out = torch.zeros(shape, dtype=ct, device=h.device)
    # Only counted tokens enter the vocabulary pass.
    valid_idx = (labels != IGNORE_INDEX).nonzero().squeeze(1)
    all_valid = len(valid_idx) == h.shape[0]
    hv = h if all_valid else h.index_select(0, valid_idx)
    yv = labels if all_valid else labels.index_select(0, valid_idx)
    cu_v = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    p_out_c = p_out.to(torch.float32 if chosen == "triton" else ct) if mode == "projected" else None
    if chosen == "triton":
        lse, z_y, readout = _vocab_pass_triton(hv, weight, bias, yv, p_out_c)
    else:
        lse, z_y, readout = _vocab_pass_torch(hv, weight, bias, yv, p_out_c, max_chunk_elems)
    if losses is not None:
        losses.copy_(example_mean_nll(lse, z_y, cu_v))
    if mode == "paper":
        return _paper_features(h, hv, z_y, lse, counts, cu_v, ct, out)
    wv = None
    if token_weights is not None:
        wv = token_weights if all_valid else token_weights.index_select(0, valid_idx)
    return _projected_features(chosen, hv, yv, readout, p_in, p_out_c, wv, cu_v, ct, out)


def example_mean_nll(lse: torch.Tensor, z_y: torch.Tensor, cu_v: np.ndarray) -> torch.Tensor:
    """Per example, the mean of ``lse_t - z_y_t`` over its counted tokens (rows ``cu_v[b]:cu_v[b+1]``), float64, 0 for
    an example without one; summed in order (a float64 running sum: deterministic on every device)."""
    nll = (lse.to(torch.float64) - z_y.to(torch.float64))
    csum = torch.cat([nll.new_zeros(1), torch.cumsum(nll, 0)])
    cu_t = torch.from_numpy(np.asarray(cu_v, dtype=np.int64)).to(nll.device)
    counts = (cu_t[1:] - cu_t[:-1]).to(torch.float64)
    return (csum[cu_t[1:]] - csum[cu_t[:-1]]) / counts.clamp_min(1.0)


def _paper_features(h: torch.Tensor, hv: torch.Tensor, z_y: torch.Tensor, lse: torch.Tensor, counts: np.ndarray,
                    cu_v: np.ndarray, ct: torch.dtype, out: torch.Tensor) -> torch.Tensor:
    """``mode="paper"``: ``mean_t (p_t(y_t) - 1) h_t`` per example, added to ``out``."""
    n_ex = len(counts)
    coef = torch.exp(z_y - lse) - 1.0
    inv_n = torch.from_numpy(1.0 / np.maximum(counts, 1)).to(h.device, coef.dtype)
    coef = coef * torch.repeat_interleave(inv_n, torch.from_numpy(counts).to(h.device), output_size=len(z_y))
    # (B, 1, d) = per-example sum of coef_t * h_t, via the same deterministic segment reduction.
    res = torch.zeros(n_ex, 1, h.shape[1], dtype=ct, device=h.device)
    segment_outer_sum(coef[:, None].to(ct), hv.to(ct), cu_v, res)
    out += res[:, 0].to(out.dtype)
    return out


def _projected_features(chosen: str, hv: torch.Tensor, yv: torch.Tensor, readout: torch.Tensor, p_in: torch.Tensor,
                        p_out_c: torch.Tensor, wv: torch.Tensor | None, cu_v: np.ndarray, ct: torch.dtype,
                        out: torch.Tensor) -> torch.Tensor:
    """``mode="projected"``: ``P_out^T [sum_t w_t (p_t - e_{y_t}) h_t^T] P_in`` per example, added to ``out``."""
    g_proj = readout - p_out_c.index_select(0, yv.long())  # P_out^T (p_t - e_{y_t}), (T_valid, k_o)
    if chosen == "triton":
        eye = torch.eye(g_proj.shape[1], dtype=torch.float32, device=hv.device)
        xg = hv if hv.dtype == torch.float32 else hv.float()  # the kernel wants x and g in one dtype
        return project_linear_grads_triton(xg, g_proj, cu_v, p_in, eye, wv, out)
    xp = hv.to(ct) @ p_in.to(ct)
    if wv is not None:
        xp *= wv.to(ct)[:, None]
    if out.dtype == ct:
        return segment_outer_sum(g_proj.to(ct), xp, cu_v, out)
    out += segment_outer_sum(g_proj.to(ct), xp, cu_v, torch.zeros(out.shape, dtype=ct, device=hv.device)).to(out.dtype)
    return out
