"""project_linear_grads: every backend against the float64 definition, odd shapes, bad input."""

import importlib
import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cluster_kernels._backend as backend_mod
from cluster_kernels.project_linear_grads import project_linear_grads, project_linear_grads_ref

# The package re-exports a function of the module's name, so fetch the module itself.
plg = importlib.import_module("cluster_kernels.project_linear_grads")

TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2, torch.float16: 5e-3}
# The Triton tests run on the GPU when there is one (benchmarks/gpu/run_all.sh), else in the interpreter.
DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def to_dev(*tensors):
    return tuple(t.to(DEV) if isinstance(t, torch.Tensor) else t for t in tensors)


def make_inputs(lengths, d_in, d_out, k_i, k_o, dtype=torch.float32, seed=0, weights=False, cu_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    n = int(sum(lengths))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=cu_dtype)
    x = torch.randn(n, d_in, generator=gen).to(dtype)
    g = torch.randn(n, d_out, generator=gen).to(dtype)
    p_in = torch.randn(d_in, k_i, generator=gen) / k_i**0.5
    p_out = torch.randn(d_out, k_o, generator=gen) / k_o**0.5
    w = torch.rand(n, generator=gen) if weights else None
    return x, g, cu, p_in, p_out, w


def rel_err(got, ref):
    """max |got - ref| relative to the largest entry of ref (the scale of the feature)."""
    scale = ref.abs().max().item()
    return (got.double() - ref).abs().max().item() / (scale if scale > 0 else 1.0)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=5),
    d_in=st.integers(1, 40),
    d_out=st.integers(1, 40),
    k_i=st.integers(1, 9),
    k_o=st.integers(1, 9),
    weights=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
)
def test_torch_backend_matches_float64_definition(lengths, d_in, d_out, k_i, k_o, weights, dtype):
    x, g, cu, p_in, p_out, w = make_inputs(lengths, d_in, d_out, k_i, k_o, dtype, weights=weights)
    ref = project_linear_grads_ref(x, g, cu, p_in, p_out, token_weights=w)
    got = project_linear_grads(x, g, cu, p_in, p_out, token_weights=w, backend="torch")
    assert got.shape == (len(lengths), k_o, k_i)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # Relative to the sum of |terms| (the reference on absolute values), not to the result: a single feature
    # of many tokens can cancel to far below its terms, where rounding relative to the result is unbounded.
    bound = project_linear_grads_ref(x.abs(), g.abs(), cu, p_in.abs(), p_out.abs(), token_weights=w)
    scale = bound.abs().max().item()
    assert (got.double() - ref).abs().max().item() <= TOL[dtype] * (scale if scale > 0 else 1.0)


@pytest.mark.parametrize(
    ("lengths", "d_in", "d_out", "k_i", "k_o", "weights", "chunk"),
    [
        ([1, 7, 13], 33, 20, 5, 17, False, None),
        ([1, 7, 13], 33, 20, 5, 17, True, 4),  # several work items per example, partial sums combined
        ([0, 50, 0, 3], 16, 64, 64, 16, True, 16),  # empty examples, exact block sizes
        ([40], 65, 7, 70, 3, False, None),  # k_i > 64: two column blocks
    ],
)
def test_triton_kernel_matches_float64_definition(lengths, d_in, d_out, k_i, k_o, weights, chunk):
    x, g, cu, p_in, p_out, w = make_inputs(lengths, d_in, d_out, k_i, k_o, weights=weights, seed=1)
    ref = project_linear_grads_ref(x, g, cu, p_in, p_out, token_weights=w)
    out = torch.zeros(len(lengths), k_o, k_i, device=DEV)
    cu_host = plg.check_cu_seqlens("test", cu, x.shape[0])
    got = plg.project_linear_grads_triton(*to_dev(x, g), cu_host, *to_dev(p_in, p_out, w), out, chunk_tokens=chunk)
    assert got is out
    assert rel_err(got.cpu(), ref) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_kernel_takes_16_bit_inputs(dtype):
    x, g, cu, p_in, p_out, w = make_inputs([9, 30, 2], 40, 24, 8, 12, dtype=dtype, weights=True, seed=5)
    ref = project_linear_grads_ref(x, g, cu, p_in, p_out, token_weights=w)
    got = project_linear_grads(*to_dev(x, g, cu, p_in, p_out), token_weights=to_dev(w)[0], backend="triton")
    assert got.dtype == torch.float32
    assert rel_err(got.cpu(), ref) <= TOL[dtype]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 products at scale: GPU only")
@pytest.mark.parametrize(("k_i", "k_o", "weights"), [(16, 16, False), (64, 64, False), (32, 32, True), (70, 3, True)])
def test_triton_kernel_default_shapes_on_the_gpu(k_i, k_o, weights):
    for dtype in (torch.float32, torch.bfloat16):
        x, g, cu, p_in, p_out, w = make_inputs([300, 1, 4000, 77], 576, 1536, k_i, k_o, dtype, seed=9, weights=weights)
        ref = project_linear_grads_ref(x, g, cu, p_in, p_out, token_weights=w)
        got = project_linear_grads(*to_dev(x, g, cu, p_in, p_out), token_weights=to_dev(w)[0], backend="triton")
        assert rel_err(got.cpu(), ref) <= (1e-5 if dtype == torch.float32 else TOL[dtype])


def test_triton_dispatch_takes_int32_offsets_and_strided_inputs():
    x, g, cu, p_in, p_out, w = make_inputs([5, 11], 24, 18, 6, 6, weights=True, cu_dtype=torch.int32)
    x_strided = torch.cat([x, x], dim=1)[:, ::2]  # stride (48, 2)
    assert not x_strided.is_contiguous()
    ref = project_linear_grads_ref(x_strided, g, cu, p_in, p_out, token_weights=w)
    x_dev = torch.cat([x, x], dim=1).to(DEV)[:, ::2]
    got = project_linear_grads(x_dev, *to_dev(g, cu, p_in, p_out.T.contiguous().T, w)[:4], token_weights=to_dev(w)[0],
                               backend="triton")
    assert rel_err(got.cpu(), ref) <= 1e-5


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_out_accumulates_layers_into_one_space_and_is_deterministic(backend):
    a = make_inputs([3, 9], 12, 10, 4, 5, seed=2)
    b = make_inputs([3, 9], 20, 6, 4, 5, seed=3)
    dev = DEV if backend == "triton" else torch.device("cpu")
    a_dev, b_dev = (tuple(t.to(dev) for t in a[:5]), tuple(t.to(dev) for t in b[:5]))
    out = torch.zeros(2, 5, 4, device=dev)
    project_linear_grads(*a_dev, out=out, backend=backend)
    project_linear_grads(*b_dev, out=out, backend=backend)
    ref = project_linear_grads_ref(*a[:5]) + project_linear_grads_ref(*b[:5])
    assert rel_err(out.cpu(), ref) <= 1e-5
    again = torch.zeros(2, 5, 4, device=dev)
    project_linear_grads(*a_dev, out=again, backend=backend)
    project_linear_grads(*b_dev, out=again, backend=backend)
    assert torch.equal(out, again)


def test_cpu_alias_and_auto_pick_the_torch_path_and_log_once(caplog):
    x, g, cu, p_in, p_out, _ = make_inputs([4, 2], 8, 8, 3, 3)
    backend_mod._logged.discard(("project_linear_grads", "cpu", "torch"))
    with caplog.at_level(logging.INFO, logger="cluster_kernels"):
        a = project_linear_grads(x, g, cu, p_in, p_out)
        project_linear_grads(x, g, cu, p_in, p_out)
    assert [r.getMessage() for r in caplog.records].count(
        "project_linear_grads: backend='auto' chose 'torch' on cpu (CPU tensors)"
    ) == 1
    assert torch.equal(a, project_linear_grads(x, g, cu, p_in, p_out, backend="cpu"))


def test_empty_batch_gives_empty_result():
    x, g, cu, p_in, p_out, _ = make_inputs([0, 0], 8, 8, 3, 4)
    assert torch.equal(project_linear_grads(x, g, cu, p_in, p_out), torch.zeros(2, 4, 3))


def test_backend_errors_say_what_to_do(monkeypatch):
    x, g, cu, p_in, p_out, _ = make_inputs([4], 8, 8, 3, 3)
    with pytest.raises(ValueError, match="use backend='triton'"):
        project_linear_grads(x, g, cu, p_in, p_out, backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        project_linear_grads(x, g, cu, p_in, p_out, backend="gpu")
    with pytest.raises(TypeError, match="use backend='torch' for float64"):
        project_linear_grads(x.double(), g.double(), cu, p_in, p_out, backend="triton")
    monkeypatch.setattr(plg, "_INTERPRET", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        project_linear_grads(x, g, cu, p_in, p_out, backend="triton")
    monkeypatch.setattr(backend_mod, "has_triton", lambda: False)
    with pytest.raises(RuntimeError, match="pip install triton"):
        project_linear_grads(x, g, cu, p_in, p_out, backend="triton")


def _bad_cases():
    x, g, cu, p_in, p_out, w = make_inputs([3, 4], 6, 5, 2, 3, weights=True)
    base = dict(x=x, g=g, cu_seqlens=cu, p_in=p_in, p_out=p_out)
    return [
        (dict(base, x=x[:, :, None]), ValueError, "x must be 2-D"),
        (dict(base, g=g[:-1]), ValueError, "same number of tokens"),
        (dict(base, g=g.double()), TypeError, "same dtype"),
        (dict(base, x=x.long(), g=g.long()), TypeError, "x must be float32"),
        (dict(base, p_in=p_in[:-1]), ValueError, r"p_in must have shape \(d_in=6, k_i\)"),
        (dict(base, p_out=p_out.T), ValueError, r"p_out must have shape \(d_out=5, k_o\)"),
        (dict(base, p_in=p_in.to("meta")), ValueError, "move all inputs to one device"),
        (dict(base, cu_seqlens=cu.float()), TypeError, "int32 or int64"),
        (dict(base, cu_seqlens=cu[None]), ValueError, "must be 1-D"),
        (dict(base, cu_seqlens=torch.tensor([1, 3, 7])), ValueError, r"cu_seqlens\[0\] must be 0"),
        (dict(base, cu_seqlens=torch.tensor([0, 5, 4, 7])), ValueError, "non-decreasing.*example 1"),
        (dict(base, cu_seqlens=torch.tensor([0, 3, 6])), ValueError, "must equal the number of packed tokens 7"),
        (dict(base, token_weights=w[:-1]), ValueError, r"token_weights must have shape \(7,\)"),
        (dict(base, token_weights=w.long()), TypeError, "token_weights must be a floating"),
        (dict(base, out=torch.zeros(2, 2, 3)), ValueError, r"out must have shape \(B, k_o, k_i\)=\(2, 3, 2\)"),
        (dict(base, out=torch.zeros(2, 3, 2, dtype=torch.int32)), TypeError, "out must be a float32"),
    ]


@pytest.mark.parametrize(("kwargs", "exc", "match"), _bad_cases())
def test_bad_input_is_refused_with_a_clear_message(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        project_linear_grads(**kwargs)


def test_offsets_reach_the_host_once_per_tensor_and_again_after_a_change():
    """One cu_seqlens serves every layer of a batch: its host copy (a device sync on a GPU) is made once."""
    from cluster_kernels.project_linear_grads import check_cu_seqlens

    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    first = check_cu_seqlens("op", cu, 7)
    assert check_cu_seqlens("op", cu, 7) is first and not first.flags.writeable
    other = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert check_cu_seqlens("op", other, 7) is not first
    cu[1] = 5  # in place: the version counter moves, so the offsets are read again
    assert check_cu_seqlens("op", cu, 7).tolist() == [0, 5, 7]
    cu[2] = 9
    with pytest.raises(ValueError, match="cu_seqlens\\[-1\\] must equal"):
        check_cu_seqlens("op", cu, 7)
