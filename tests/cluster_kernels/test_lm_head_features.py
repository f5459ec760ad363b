"""lm_head_features: paper and projected modes against the float64 materialised definition."""

import importlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from cluster_kernels.lm_head_features import lm_head_features, lm_head_features_ref

# The package re-exports a function of the module's name, so fetch the module itself.
lmh = importlib.import_module("cluster_kernels.lm_head_features")

TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2, torch.float16: 5e-3}
# The Triton tests run on the GPU when there is one (benchmarks/gpu/run_all.sh), else in the interpreter.
DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def to_dev(inputs):
    return tuple(t.to(DEV) if isinstance(t, torch.Tensor) else t for t in inputs)


def make_inputs(lengths, d, vocab, k_i=5, k_o=7, dtype=torch.float32, seed=0, ignore_frac=0.3, logit_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    n = int(sum(lengths))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)
    h = torch.randn(n, d, generator=gen).to(dtype)
    weight = (torch.randn(vocab, d, generator=gen) * logit_scale / d**0.5).to(dtype)
    bias = torch.randn(vocab, generator=gen).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < ignore_frac] = -100
    labels[cu[:-1][torch.tensor(lengths) > 0]] = 1  # every non-empty example keeps >= 1 counted token
    p_in = torch.randn(d, k_i, generator=gen) / k_i**0.5
    p_out = torch.randn(vocab, k_o, generator=gen) / k_o**0.5
    w = torch.rand(n, generator=gen)
    return h, weight, bias, labels, cu, p_in, p_out, w


def rel_err(got, ref):
    scale = ref.abs().max().item()
    return (got.double() - ref).abs().max().item() / (scale if scale > 0 else 1.0)


def call(mode, h, weight, bias, labels, cu, p_in, p_out, w, use_bias, use_w, **kw):
    extra = dict(p_in=p_in, p_out=p_out, token_weights=w if use_w else None) if mode == "projected" else {}
    return lm_head_features(h, weight, labels, cu, mode=mode, bias=bias if use_bias else None, **extra, **kw)


def call_ref(mode, h, weight, bias, labels, cu, p_in, p_out, w, use_bias, use_w):
    extra = dict(p_in=p_in, p_out=p_out, token_weights=w if use_w else None) if mode == "projected" else {}
    return lm_head_features_ref(h, weight, labels, cu, mode=mode, bias=bias if use_bias else None, **extra)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=4),
    d=st.integers(1, 40),
    vocab=st.integers(2, 300),
    mode=st.sampled_from(["paper", "projected"]),
    use_bias=st.booleans(),
    use_w=st.booleans(),
    chunk=st.sampled_from([7, 64, 1 << 20]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
)
def test_torch_backend_matches_float64_definition(lengths, d, vocab, mode, use_bias, use_w, chunk, dtype):
    inputs = make_inputs(lengths, d, vocab, dtype=dtype)
    ref = call_ref(mode, *inputs, use_bias, use_w)
    got = call(mode, *inputs, use_bias, use_w, backend="torch", max_chunk_elems=chunk)
    assert got.shape == ref.shape
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # The per-example mean of (p - 1) h can cancel to far below its terms (d=1, mixed signs), so
    # float32 gets a little headroom relative to the result here; the Triton tests keep 1e-5.
    tol = 5e-5 if dtype == torch.float32 else TOL[dtype]
    assert rel_err(got, ref) <= tol


@pytest.mark.parametrize("mode", ["paper", "projected"])
@pytest.mark.parametrize(
    ("lengths", "d", "vocab", "k_o", "use_bias"),
    [
        ([1, 7, 13], 33, 100, 7, True),
        ([20, 3], 16, 64, 33, False),  # k_o not a power of two, vocab a multiple of the block
        ([45], 8, 37, 130, True),  # k_o > 128: two read-out blocks
    ],
)
def test_triton_kernel_matches_float64_definition(mode, lengths, d, vocab, k_o, use_bias):
    inputs = make_inputs(lengths, d, vocab, k_o=k_o, seed=4, logit_scale=8.0)
    ref = call_ref(mode, *inputs, use_bias, True)
    got = call(mode, *to_dev(inputs), use_bias, True, backend="triton")
    assert rel_err(got.cpu(), ref) <= 1e-5


@pytest.mark.parametrize("mode", ["paper", "projected"])
def test_triton_kernel_takes_fp16_inputs(mode):
    # bf16 products are checked on a GPU only: the interpreter has no bf16 arithmetic.
    inputs = make_inputs([6, 17], 24, 90, dtype=torch.float16, seed=6)
    ref = call_ref(mode, *inputs, True, True)
    assert rel_err(call(mode, *to_dev(inputs), True, True, backend="triton").cpu(), ref) <= TOL[torch.float16]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 products need a GPU (the interpreter has none)")
@pytest.mark.parametrize("mode", ["paper", "projected"])
@pytest.mark.parametrize("k_o", [7, 32, 130])
def test_triton_kernel_takes_bf16_inputs_on_the_gpu(mode, k_o):
    inputs = make_inputs([6, 170, 33], 576, 3000, k_o=k_o, dtype=torch.bfloat16, seed=7, logit_scale=4.0)
    ref = call_ref(mode, *inputs, False, True)
    assert rel_err(call(mode, *to_dev(inputs), False, True, backend="triton").cpu(), ref) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_large_logits_stay_finite(backend):
    inputs = make_inputs([9, 4], 12, 50, seed=2, logit_scale=300.0)
    for mode in ("paper", "projected"):
        got = call(mode, *(to_dev(inputs) if backend == "triton" else inputs), True, False, backend=backend).cpu()
        assert torch.isfinite(got).all()
        # logits of size ~300 carry an absolute fp32 error of ~300 * eps in z - lse, hence 1e-4 here
        assert rel_err(got, call_ref(mode, *inputs, True, False)) <= 1e-4


def test_paper_mode_is_the_mean_of_p_target_minus_one_times_h():
    h = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    weight = torch.zeros(4, 2)  # uniform softmax: p = 1/4 for every token
    labels = torch.tensor([2, -100, 0])
    got = lm_head_features(h, weight, labels, torch.tensor([0, 3]), mode="paper")
    expected = ((0.25 - 1) * h[0] + (0.25 - 1) * h[2]) / 2
    torch.testing.assert_close(got[0], expected)


class _MaxNumel(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        if func.is_view:  # slices and transposes of the inputs allocate nothing
            return res
        for t in res if isinstance(res, (tuple, list)) else [res]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return res


@pytest.mark.parametrize("mode", ["paper", "projected"])
def test_torch_path_never_materialises_the_logits(mode):
    n_tok, d, vocab = 300, 16, 5000
    h, weight, bias, labels, cu, p_in, p_out, w = make_inputs([100, 200], d, vocab, ignore_frac=0.0)
    budget = 20_000
    with _MaxNumel() as spy:
        call(mode, h, weight, bias, labels, cu, p_in, p_out, w, True, True, backend="torch", max_chunk_elems=budget)
    # The largest new tensor is one logits chunk (or a token-sized copy of h), far below T * V = 1.5M.
    assert spy.max_numel <= max(budget, n_tok * d)
    assert spy.max_numel < n_tok * vocab / 20


def test_projected_mode_gives_an_all_ignored_example_a_zero_feature():
    h, weight, bias, labels, cu, p_in, p_out, w = make_inputs([4, 5, 6], 8, 30)
    labels[4:9] = -100
    got = lm_head_features(h, weight, labels, cu, p_in=p_in, p_out=p_out, mode="projected")
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert got[0].abs().sum() > 0 and got[2].abs().sum() > 0


def test_paper_mode_refuses_an_all_ignored_example_naming_it():
    h, weight, bias, labels, cu, p_in, p_out, w = make_inputs([4, 5, 6], 8, 30)
    labels[4:9] = -100
    with pytest.raises(ValueError, match="example 1 has no counted token"):
        lm_head_features(h, weight, labels, cu, mode="paper")


def _bad_cases():
    h, weight, bias, labels, cu, p_in, p_out, w = make_inputs([3, 4], 6, 20)
    base = dict(h=h, weight=weight, labels=labels, cu_seqlens=cu, mode="projected", p_in=p_in, p_out=p_out)
    paper = dict(h=h, weight=weight, labels=labels, cu_seqlens=cu, mode="paper")
    return [
        (dict(base, mode="full"), ValueError, "mode must be one of"),
        (dict(base, weight=weight[:, :-1]), ValueError, r"weight must have shape \(V, d=6\)"),
        (dict(base, h=h.long()), TypeError, "h must be float32"),
        (dict(base, labels=labels.float()), TypeError, "labels must be an int32/int64"),
        (dict(base, labels=labels[:-1]), ValueError, r"labels must have shape \(N_tok,\)=\(7,\)"),
        (dict(base, labels=torch.full_like(labels, 20)), ValueError, r"labels\[0\]=20"),
        (dict(base, labels=torch.full_like(labels, -1)), ValueError, r"or -100 \(ignored\)"),
        (dict(base, cu_seqlens=torch.tensor([0, 3, 8])), ValueError, "must equal the number of packed tokens 7"),
        (dict(base, p_out=None), ValueError, "needs p_out of shape"),
        (dict(base, p_in=p_in[1:]), ValueError, r"p_in must be a floating 2-D tensor of shape \(6, k\)"),
        (dict(base, bias=bias[1:]), ValueError, r"bias must be a floating tensor of shape \(V,\)=\(20,\)"),
        (dict(base, weight=weight.to("meta")), ValueError, "move them to one device"),
        (dict(base, out=torch.zeros(2, 5, 7)), ValueError, r"out must have shape \(2, 7, 5\)"),
        (dict(paper, p_in=p_in), ValueError, "only used with mode='projected'"),
        (dict(paper, token_weights=w), ValueError, "takes no token_weights"),
        (dict(paper, backend="cuda"), ValueError, "use backend='triton'"),
    ]


@pytest.mark.parametrize(("kwargs", "exc", "match"), _bad_cases())
def test_bad_input_is_refused_with_a_clear_message(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        lm_head_features(**kwargs)


def test_explicit_triton_without_a_gpu_or_interpreter_says_how_to_get_it(monkeypatch):
    h, weight, bias, labels, cu, *_ = make_inputs([3], 6, 20)
    monkeypatch.setattr(lmh, "_INTERPRET", False)
    with pytest.raises(RuntimeError, match="move the tensors to a CUDA device"):
        lm_head_features(h, weight, labels, cu, mode="paper", backend="triton")
