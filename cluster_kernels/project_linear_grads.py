"""Per-example Kronecker-projected gradients of a linear layer from packed variable-length tokens.

Maths. For ``y = x W^T`` the gradient of example ``b`` is ``dW_b = sum_{t in b} w_t g_t x_t^T``
(``g_t = dL/dy_t`` of shape ``d_out``, ``x_t`` of shape ``d_in``, optional token weights ``w_t``).
With fixed projections ``P_in (d_in, k_i)`` and ``P_out (d_out, k_o)``::

    phi_b = P_out^T dW_b P_in = sum_{t in b} (P_out^T g_t) (w_t P_in^T x_t)^T        (k_o, k_i)

which costs ``2 (d_in k_i + d_out k_o + k_o k_i)`` FLOPs per token and never forms the
``(d_out, d_in)`` gradient. Tokens are packed without padding: example ``b`` owns rows
``cu_seqlens[b]:cu_seqlens[b + 1]`` of ``x`` and ``g``. Results are float32 (float64 for float64
inputs on the torch path) and are *added* to ``out`` when it is given, so several layers projected
into the same ``(k_o, k_i)`` space sum into one feature (a block Johnson-Lindenstrauss projection of
the concatenated gradient).

Implementations:

- ``project_linear_grads_ref``: the definition, in float64 by default: forms ``dW_b`` per example and
  projects it. The test oracle only (memory ``d_out * d_in`` per example). It lives, with the input checks it
  shares with the fast paths (``check_project_inputs``, ``check_cu_seqlens``), in
  :mod:`cluster_kernels.project_linear_grads_reference` (the op's contract, in plain torch; this module was over
  600 lines with it) and is re-exported here.
- Triton kernel (CUDA tensors; CPU tensors under ``TRITON_INTERPRET=1``): the packed tokens are cut
  into work items of at most ``chunk_tokens`` tokens that never cross an example boundary; each
  program streams one item's tokens once, computes ``P_in^T x_t`` and ``P_out^T g_t`` tile by tile
  (``tl.dot`` on tiles converted to fp32 in registers: IEEE fp32 products for fp32 inputs, TF32 tensor
  cores for bf16/fp16 inputs, whose own rounding is coarser) and accumulates their outer products in
  registers; partial sums go to a ``(B, items_per_example, k_o, k_i)`` buffer that is summed in a
  fixed order (no float atomics, so results are deterministic).
- Vectorised torch path (CPU, and CUDA without Triton): two GEMMs ``X P_in`` and ``G P_out`` in
  token blocks, then the same chunked segment reduction as one batched matmul.

The first Triton call on a CUDA device is self-checked against the torch path on its first examples
(``cluster_kernels._selfcheck``); a failure warns once and the torch path runs from then on.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
import torch

from cluster_kernels._backend import (
    check_backend_name,
    has_triton,
    log_choice_once,
    missing_backend_error,
    require_triton,
)
from cluster_kernels._selfcheck import backend_for, check_prefix, compare_features, record_backend, run_first_use
from cluster_kernels.project_linear_grads_reference import (
    check_cu_seqlens,
    check_project_inputs,
    project_linear_grads_ref,
)

__all__ = ["check_cu_seqlens", "project_linear_grads", "project_linear_grads_ref"]

_OP = "project_linear_grads"
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TORCH_TOKEN_BLOCK = 8192  # rows converted to fp32 at a time on the torch path (bounds the temporaries)
_TORCH_CHUNK = 256  # tokens per segment-reduction item on the torch path (padding waste <= B * chunk)


# --------------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------------


def _work_items(cu: np.ndarray, chunk: int) -> tuple[np.ndarray, ...]:
    """Split every example into items of <= chunk tokens: (example, slot, start, stop), slots per example."""
    lengths = np.diff(cu)
    n_items = (lengths + chunk - 1) // chunk
    total = int(n_items.sum())
    example = np.repeat(np.arange(len(lengths), dtype=np.int64), n_items)
    first_item = np.cumsum(n_items) - n_items
    slot = np.arange(total, dtype=np.int64) - np.repeat(first_item, n_items)
    start = cu[:-1][example] + slot * chunk
    stop = np.minimum(start + chunk, cu[1:][example])
    max_slots = int(n_items.max()) if len(n_items) else 0
    return example, slot, start.astype(np.int64), stop.astype(np.int64), max_slots


# GPU autotune configs as (BLOCK_T, BLOCK_D, num_warps, num_stages), kept as plain tuples so that the compile gate
# (tests/cluster_kernels/test_aot_compile.py) and benchmarks/ptxas_report.py can read them without a GPU. Each one
# is spill-free on sm_80, sm_90 and sm_100 for every key where :func:`project_configs_for` keeps it (the gate
# compiles them all; BENCHMARKS.md has the register table). IEEE fp32 dots (float32 inputs) run on the FMA units,
# whose operands Triton replicates across threads: they take 8 warps and BLOCK_T <= 32. TF32 dots (16-bit inputs)
# use the tensor cores and afford 128-token tiles, which re-read P_in / P_out a quarter as often as 32-token ones.
PLG_GPU_CONFIGS: tuple[tuple[int, int, int, int], ...] = (
    (128, 32, 8, 2),
    (64, 64, 8, 2),
    (64, 32, 4, 3),
    (32, 32, 8, 2),
    (16, 64, 8, 3),
)


def project_configs_for(precision: str, block_ko: int, block_ki: int) -> list[tuple[int, int, int, int]]:
    """The GPU configs the autotuner tries for one key: those that fit the registers (module comment above)."""
    if precision == "ieee":
        return [c for c in PLG_GPU_CONFIGS if c[0] <= 32]
    big = block_ko * block_ki >= 64 * 64
    return [c for c in PLG_GPU_CONFIGS if c[2] == 8 or not big]


def prune_project_configs(configs: list, named_args: dict, **kwargs: object) -> list:
    """Triton ``early_config_prune`` hook: keep the configs :func:`project_configs_for` allows for this key."""
    keep = set(project_configs_for(str(kwargs["PRECISION"]), int(kwargs["BLOCK_KO"]), int(kwargs["BLOCK_KI"])))
    kept = [c for c in configs if (c.kwargs["BLOCK_T"], c.kwargs["BLOCK_D"], c.num_warps, c.num_stages) in keep]
    return kept or list(configs)  # the interpreter's single config is not in the GPU list


if has_triton():
    import triton
    import triton.language as tl

    if _INTERPRET:
        # The interpreter runs every config of an autotuner: keep one small one.
        _PLG_CONFIGS = [triton.Config({"BLOCK_T": 16, "BLOCK_D": 32}, num_warps=1)]
    else:  # pragma: no cover - GPU only
        _PLG_CONFIGS = [
            triton.Config({"BLOCK_T": bt, "BLOCK_D": bd}, num_warps=nw, num_stages=ns)
            for bt, bd, nw, ns in PLG_GPU_CONFIGS
        ]

    @triton.autotune(
        configs=_PLG_CONFIGS,
        key=["d_in", "d_out", "BLOCK_KO", "BLOCK_KI", "PRECISION"],
        prune_configs_by={"early_config_prune": prune_project_configs},
    )
    @triton.jit
    def project_linear_grads_kernel(
        x_ptr,
        g_ptr,
        w_ptr,
        p_in_ptr,
        p_out_ptr,
        partial_ptr,
        item_example_ptr,
        item_slot_ptr,
        item_start_ptr,
        item_stop_ptr,
        d_in,
        d_out,
        k_i,
        k_o,
        stride_xt,
        stride_xd,
        stride_gt,
        stride_gd,
        stride_pi_d,
        stride_pi_k,
        stride_po_d,
        stride_po_k,
        stride_part_b,
        stride_part_s,
        stride_part_o,
        stride_part_i,
        HAS_WEIGHTS: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_KO: tl.constexpr,
        BLOCK_KI: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        item = tl.program_id(0)
        pid_o = tl.program_id(1)
        pid_i = tl.program_id(2)
        example = tl.load(item_example_ptr + item).to(tl.int64)
        slot = tl.load(item_slot_ptr + item).to(tl.int64)
        start = tl.load(item_start_ptr + item).to(tl.int64)
        # An item holds few tokens: 32-bit offsets inside it, one 64-bit base pointer per tensor.
        n_item = (tl.load(item_stop_ptr + item).to(tl.int64) - start).to(tl.int32)
        x_base = x_ptr + start * stride_xt
        g_base = g_ptr + start * stride_gt
        offs_o = pid_o * BLOCK_KO + tl.arange(0, BLOCK_KO)
        offs_i = pid_i * BLOCK_KI + tl.arange(0, BLOCK_KI)
        mask_o = offs_o < k_o
        mask_i = offs_i < k_i
        rows = tl.arange(0, BLOCK_T)
        acc = tl.zeros((BLOCK_KO, BLOCK_KI), dtype=tl.float32)
        for t0 in range(0, n_item, BLOCK_T):
            offs_t = t0 + rows
            mask_t = offs_t < n_item
            xp = tl.zeros((BLOCK_T, BLOCK_KI), dtype=tl.float32)
            for d0 in range(0, d_in, BLOCK_D):
                offs_d = d0 + tl.arange(0, BLOCK_D)
                mask_d = offs_d < d_in
                xt = tl.load(
                    x_base + offs_t[:, None] * stride_xt + offs_d[None, :] * stride_xd,
                    mask=mask_t[:, None] & mask_d[None, :],
                    other=0.0,
                )
                pt = tl.load(
                    p_in_ptr + offs_d[:, None] * stride_pi_d + offs_i[None, :] * stride_pi_k,
                    mask=mask_d[:, None] & mask_i[None, :],
                    other=0.0,
                )
                xp += tl.dot(xt.to(tl.float32), pt.to(tl.float32), input_precision=PRECISION)
            gp = tl.zeros((BLOCK_T, BLOCK_KO), dtype=tl.float32)
            for d0 in range(0, d_out, BLOCK_D):
                offs_d = d0 + tl.arange(0, BLOCK_D)
                mask_d = offs_d < d_out
                gt = tl.load(
                    g_base + offs_t[:, None] * stride_gt + offs_d[None, :] * stride_gd,
                    mask=mask_t[:, None] & mask_d[None, :],
                    other=0.0,
                )
                pt = tl.load(
                    p_out_ptr + offs_d[:, None] * stride_po_d + offs_o[None, :] * stride_po_k,
                    mask=mask_d[:, None] & mask_o[None, :],
                    other=0.0,
                )
                gp += tl.dot(gt.to(tl.float32), pt.to(tl.float32), input_precision=PRECISION)
            if HAS_WEIGHTS:
                wt = tl.load(w_ptr + start + offs_t, mask=mask_t, other=0.0).to(tl.float32)
                xp = xp * wt[:, None]
            acc += tl.dot(tl.trans(gp), xp, input_precision=PRECISION)
        dst = (
            partial_ptr
            + example * stride_part_b
            + slot * stride_part_s
            + offs_o[:, None] * stride_part_o
            + offs_i[None, :] * stride_part_i
        )
        tl.store(dst, acc, mask=mask_o[:, None] & mask_i[None, :])


def block_k(k: int) -> int:
    """The kernel's block over a projected dimension ``k``: 16, 32 or 64 (``tl.dot`` needs >= 16)."""
    return max(16, min(64, 1 << (k - 1).bit_length()))


def _default_chunk(n_tok: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1024  # interpreter: fewer, longer programs
    sms = torch.cuda.get_device_properties(device).multi_processor_count  # pragma: no cover - GPU only
    # Enough items to fill every SM a few times, but long enough to amortise the partial-sum store.
    return int(min(4096, max(64, 64 * math.ceil(n_tok / (4 * sms) / 64))))  # pragma: no cover


def project_kernel_args(
    x: torch.Tensor,
    g: torch.Tensor,
    token_weights: torch.Tensor | None,
    p_in32: torch.Tensor,
    p_out32: torch.Tensor,
    partial: torch.Tensor,
    items: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> dict[str, object]:
    """Every argument of the kernel but the autotuned block sizes, by name (the compile gate builds them too).

    Args:
        x, g: ``(N_tok, d_in)`` / ``(N_tok, d_out)`` inputs; token_weights: ``(N_tok,)`` or None.
        p_in32, p_out32: float32 projections. partial: ``(B, slots, k_o, k_i)`` float32 partial sums.
        items: the work items' example, slot, start and stop (int64 device tensors).
    """
    lowp = x.dtype != torch.float32  # 16-bit inputs already carry ~1e-3 error: TF32 products are enough
    names = ("item_example_ptr", "item_slot_ptr", "item_start_ptr", "item_stop_ptr")
    return {
        "x_ptr": x, "g_ptr": g, "w_ptr": token_weights if token_weights is not None else x,  # dummy when unused
        "p_in_ptr": p_in32, "p_out_ptr": p_out32, "partial_ptr": partial, **dict(zip(names, items, strict=True)),
        "d_in": x.shape[1], "d_out": g.shape[1], "k_i": p_in32.shape[1], "k_o": p_out32.shape[1],
        "stride_xt": x.stride(0), "stride_xd": x.stride(1), "stride_gt": g.stride(0), "stride_gd": g.stride(1),
        "stride_pi_d": p_in32.stride(0), "stride_pi_k": p_in32.stride(1),
        "stride_po_d": p_out32.stride(0), "stride_po_k": p_out32.stride(1),
        "stride_part_b": partial.stride(0), "stride_part_s": partial.stride(1),
        "stride_part_o": partial.stride(2), "stride_part_i": partial.stride(3),
        "HAS_WEIGHTS": token_weights is not None,
        "PRECISION": "tf32" if lowp else "ieee",  # fp32 inputs keep fp32 accuracy (rel. err <= 1e-5)
        "BLOCK_KO": block_k(p_out32.shape[1]), "BLOCK_KI": block_k(p_in32.shape[1]),
    }


def project_linear_grads_triton(
    x: torch.Tensor,
    g: torch.Tensor,
    cu: np.ndarray,
    p_in: torch.Tensor,
    p_out: torch.Tensor,
    token_weights: torch.Tensor | None,
    out: torch.Tensor,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Launch the kernel; ``out`` (B, k_o, k_i) float32 is accumulated into and returned."""
    require_triton(_OP)
    if x.dtype not in _TRITON_DTYPES:
        raise TypeError(
            f"{_OP}: backend='triton' takes float32/bfloat16/float16 inputs, got {x.dtype}; "
            "use backend='torch' for float64."
        )
    if x.device.type != "cuda" and not _INTERPRET:
        raise missing_backend_error(
            _OP,
            "triton",
            f"the tensors are on {x.device} and TRITON_INTERPRET is not 1",
            "move the tensors to a CUDA device (or set TRITON_INTERPRET=1 before importing cluster_kernels, "
            "for testing)",
        )
    n_tok = x.shape[0]
    k_i, k_o = p_in.shape[1], p_out.shape[1]
    n_ex = len(cu) - 1
    if n_tok == 0 or n_ex == 0:
        return out
    chunk = int(chunk_tokens) if chunk_tokens is not None else _default_chunk(n_tok, x.device)
    example, slot, start, stop, max_slots = _work_items(cu, chunk)
    dev = x.device
    partial = torch.zeros(n_ex, max_slots, k_o, k_i, dtype=torch.float32, device=dev)
    items = tuple(torch.from_numpy(a).to(dev) for a in (example, slot, start, stop))
    args = project_kernel_args(x, g, token_weights, p_in.to(torch.float32), p_out.to(torch.float32), partial, items)
    grid = (len(example), triton.cdiv(k_o, args["BLOCK_KO"]), triton.cdiv(k_i, args["BLOCK_KI"]))
    project_linear_grads_kernel[grid](**args)
    out += partial.sum(dim=1).to(out.dtype)
    return out


# --------------------------------------------------------------------------------------------------
# Vectorised torch path
# --------------------------------------------------------------------------------------------------


def segment_outer_sum(
    gp: torch.Tensor, xp: torch.Tensor, cu: np.ndarray, out: torch.Tensor, chunk: int = _TORCH_CHUNK
) -> torch.Tensor:
    """``out[b] += sum_{t in b} gp_t xp_t^T`` for already projected tokens, as one batched matmul.

    Every example is cut into items of ``chunk`` tokens (zero-padded to ``chunk``), the items' outer
    products come from one ``bmm``, and the items of an example (contiguous) are combined through a
    float64 prefix sum over items: a fixed order on every device, so results are deterministic.

    Args:
        gp: ``(N_tok, k_o)``; xp: ``(N_tok, k_i)`` (same floating dtype); cu: host int64 offsets.
        out: ``(B, k_o, k_i)`` accumulated into.
    """
    n_ex = len(cu) - 1
    if gp.shape[0] == 0 or n_ex == 0:
        return out
    example, _slot, start, stop, _ = _work_items(cu, chunk)
    n_items = len(example)
    lengths = stop - start
    # Token t of item j sits at row j * chunk + (t - start_j) of the padded layout.
    rows = np.repeat(np.arange(n_items, dtype=np.int64) * chunk - start, lengths) + np.arange(
        int(cu[-1]), dtype=np.int64
    )
    rows_t = torch.from_numpy(rows).to(gp.device)
    g_pad = gp.new_zeros(n_items * chunk, gp.shape[1]).index_copy_(0, rows_t, gp)
    x_pad = xp.new_zeros(n_items * chunk, xp.shape[1]).index_copy_(0, rows_t, xp)
    items = torch.bmm(g_pad.view(n_items, chunk, -1).transpose(1, 2), x_pad.view(n_items, chunk, -1))
    n_per_ex = np.bincount(example, minlength=n_ex)
    if (n_per_ex == 1).all():  # one item per example (the common case): nothing to combine
        out += items.to(out.dtype)
        return out
    prefix = torch.zeros(n_items + 1, *items.shape[1:], dtype=torch.float64, device=items.device)
    torch.cumsum(items.to(torch.float64), dim=0, out=prefix[1:])
    bounds = torch.from_numpy(np.concatenate([[0], np.cumsum(n_per_ex)])).to(items.device)
    out += (prefix[bounds[1:]] - prefix[bounds[:-1]]).to(out.dtype)
    return out


def _project_linear_grads_torch(
    x: torch.Tensor,
    g: torch.Tensor,
    cu: np.ndarray,
    p_in: torch.Tensor,
    p_out: torch.Tensor,
    token_weights: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    pi, po = p_in.to(ct), p_out.to(ct)
    n_tok = x.shape[0]
    xp = torch.empty(n_tok, pi.shape[1], dtype=ct, device=x.device)
    gp = torch.empty(n_tok, po.shape[1], dtype=ct, device=x.device)
    for s in range(0, n_tok, _TORCH_TOKEN_BLOCK):  # bounded fp32 copies of bf16/fp16 inputs
        e = min(n_tok, s + _TORCH_TOKEN_BLOCK)
        torch.matmul(x[s:e].to(ct), pi, out=xp[s:e])
        torch.matmul(g[s:e].to(ct), po, out=gp[s:e])
    if token_weights is not None:
        xp *= token_weights.to(ct)[:, None]
    if out.dtype == ct:
        return segment_outer_sum(gp, xp, cu, out)
    out += segment_outer_sum(gp, xp, cu, torch.zeros(out.shape, dtype=ct, device=out.device)).to(out.dtype)
    return out


# --------------------------------------------------------------------------------------------------
# Dispatcher
# --------------------------------------------------------------------------------------------------


def resolve_backend(op: str, backend: str, device: torch.device) -> str:
    """The implementation ``backend`` means for ``device``: "triton" or "torch" (shared with lm_head_features)."""
    check_backend_name(op, backend)
    if backend == "cuda":
        raise ValueError(
            f"{op}: there is no native CUDA build of this op; use backend='triton' for CUDA tensors (or 'auto')."
        )
    if backend == "cpu":
        return "torch"
    if backend != "auto":
        return backend
    if device.type == "cuda" and has_triton():
        log_choice_once(op, str(device), "triton", "CUDA tensors and triton importable")
        return "triton"
    why = "CPU tensors" if device.type != "cuda" else "triton is not installed"
    log_choice_once(op, str(device), "torch", why)
    return "torch"


def project_linear_grads(
    x: torch.Tensor,
    g: torch.Tensor,
    cu_seqlens: torch.Tensor,
    p_in: torch.Tensor,
    p_out: torch.Tensor,
    *,
    token_weights: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Per-example projected linear-layer gradients ``P_out^T (sum_t w_t g_t x_t^T) P_in``.

    Args:
        x: ``(N_tok, d_in)`` layer inputs, packed (example ``b`` = rows ``cu_seqlens[b]:cu_seqlens[b+1]``);
            float32/bfloat16/float16 (float64 on the torch backend).
        g: ``(N_tok, d_out)`` gradients of the loss w.r.t. the layer outputs, same dtype as ``x``.
        cu_seqlens: ``(B + 1,)`` int32/int64 offsets: 0, non-decreasing, ending at ``N_tok``.
        p_in: ``(d_in, k_i)`` projection of the input side. p_out: ``(d_out, k_o)`` of the output side.
        token_weights: optional ``(N_tok,)`` per-token weights ``w_t``.
        out: optional ``(B, k_o, k_i)`` float32 tensor to accumulate into (several layers into one space).
        backend: ``"auto"`` (Triton for CUDA tensors, else torch), ``"triton"``, ``"torch"`` or ``"cpu"``
            (alias of ``"torch"``). ``"cuda"`` is refused: this op has only a Triton GPU kernel.

    Returns:
        ``out`` (or a new tensor) of shape ``(B, k_o, k_i)``, float32 (float64 for float64 inputs on the
        torch backend when ``out`` is None).

    Raises:
        TypeError / ValueError: mismatched shapes, dtypes or devices, bad ``cu_seqlens``, unknown backend.
        RuntimeError: an explicitly requested backend is not available (the message says how to get it).
    """
    cu = check_project_inputs(x, g, cu_seqlens, p_in, p_out, token_weights, out)
    chosen = resolve_backend(_OP, backend, x.device)
    check = False
    if chosen == "triton":
        chosen, check = backend_for(_OP, x.device, x.dtype, "triton", "torch")
    else:
        record_backend(_OP, chosen)
    compute = functools.partial(_compute, x, g, cu, p_in, p_out, token_weights)
    if not check or x.shape[0] == 0:
        return compute(chosen, out)
    res = run_first_use(
        _OP, x.device, x.dtype, ("triton", "torch"), lambda: compute("triton", None),
        lambda got: _verify_prefix(got, x, g, cu, p_in, p_out, token_weights), lambda: compute("torch", None),
    )
    if out is None:
        return res
    out += res.to(out.dtype)
    return out


def _compute(x: torch.Tensor, g: torch.Tensor, cu: np.ndarray, p_in: torch.Tensor, p_out: torch.Tensor,
             token_weights: torch.Tensor | None, chosen: str, out: torch.Tensor | None) -> torch.Tensor:
    """The features on the ``chosen`` backend, added to ``out`` (a new tensor when None)."""
    if out is None:
        dt = torch.float64 if (x.dtype == torch.float64 and chosen == "torch") else torch.float32
        out = torch.zeros(len(cu) - 1, p_out.shape[1], p_in.shape[1], dtype=dt, device=x.device)
    if chosen == "triton":
        return project_linear_grads_triton(x, g, cu, p_in, p_out, token_weights, out)
    return _project_linear_grads_torch(x, g, cu, p_in, p_out, token_weights, out)


def _verify_prefix(got: torch.Tensor, x: torch.Tensor, g: torch.Tensor, cu: np.ndarray, p_in: torch.Tensor,
                   p_out: torch.Tensor, token_weights: torch.Tensor | None) -> str | None:
    """The first-use check: the kernel's result for the first examples against the torch path's."""
    j = check_prefix(cu)
    n = int(cu[j])
    w = None if token_weights is None else token_weights[:n]
    ref = _compute(x[:n], g[:n], cu[: j + 1], p_in, p_out, w, "torch", None)
    return compare_features(got[:j], ref, x.dtype, "triton")
