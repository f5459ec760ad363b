"""The first-use self-check of the GPU kernels, simulated on the CPU (no GPU needed).

The check normally runs on CUDA devices only; these tests add "cpu" to ``CHECKED_DEVICE_TYPES`` so that the
Triton kernels (under ``TRITON_INTERPRET=1``) and stand-ins for the CUDA K-means go through it, and replace
a kernel by one that raises or one that returns wrong values.
"""

from __future__ import annotations

import importlib
import types
import warnings

import numpy as np
import pytest
import torch

import cluster_kernels
from cluster_kernels import _backend, _selfcheck, capacity_kmeans
from cluster_kernels.lm_head_features import lm_head_features
from cluster_kernels.project_linear_grads import project_linear_grads

lmh = importlib.import_module("cluster_kernels.lm_head_features")
plg = importlib.import_module("cluster_kernels.project_linear_grads")
# On a GPU machine (benchmarks/gpu/run_all.sh) the same tests run the real kernels on CUDA tensors.
DEV = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
NAME = str(DEV)


@pytest.fixture(autouse=True)
def checked_on_cpu(monkeypatch):
    """Self-checks on for CPU tensors, a clean record before and after every test."""
    monkeypatch.delenv(_selfcheck.SELF_CHECK_ENV, raising=False)
    monkeypatch.setattr(_selfcheck, "CHECKED_DEVICE_TYPES", ("cuda", "cpu"))
    _selfcheck.reset_self_checks()
    yield
    _selfcheck.reset_self_checks()


def plg_inputs(dtype=torch.float32, lengths=(5, 9, 600, 3), seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = int(sum(lengths))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)
    x = torch.randn(n, 12, generator=gen).to(dtype)
    g = torch.randn(n, 10, generator=gen).to(dtype)
    p_in, p_out = torch.randn(12, 4, generator=gen) / 2, torch.randn(10, 3, generator=gen) / 2
    return tuple(t.to(DEV) for t in (x, g, cu, p_in, p_out))


def lmh_inputs(lengths=(4, 7, 5), d=16, vocab=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = int(sum(lengths))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)
    h = torch.randn(n, d, generator=gen)
    weight = torch.randn(vocab, d, generator=gen) / d**0.5
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[1] = -100
    p_in, p_out = torch.randn(d, 4, generator=gen), torch.randn(vocab, 5, generator=gen)
    return tuple(t.to(DEV) for t in (h, weight, labels, cu, p_in, p_out))


def self_check_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "self-check" in str(w.message)]


def test_a_kernel_that_raises_warns_once_and_falls_back_for_the_rest_of_the_process(monkeypatch):
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(lmh, "_vocab_pass_triton", broken)
    h, weight, labels, cu, p_in, p_out = lmh_inputs()
    kw = dict(p_in=p_in, p_out=p_out, mode="projected")
    with pytest.warns(RuntimeWarning) as record:
        got = lm_head_features(h, weight, labels, cu, **kw, backend="triton")
    msgs = self_check_warnings(record)
    assert len(msgs) == 1
    assert f"lm_head_features on {NAME} (float32 inputs)" in msgs[0]
    assert "illegal memory access" in msgs[0] and f"uses the torch backend on {NAME}" in msgs[0]
    torch.testing.assert_close(got, lm_head_features(h, weight, labels, cu, **kw, backend="torch"))
    assert cluster_kernels.backends_used()["lm_head_features"] == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        again = lm_head_features(h, weight, labels, cu, **kw, backend="triton")
    assert len(calls) == 1  # the broken kernel is never launched again
    torch.testing.assert_close(again, got)
    status = _selfcheck.self_check_status()[f"lm_head_features@{NAME}/float32"]
    assert status.startswith("failed: the triton kernel raised")


def test_a_kernel_with_wrong_values_is_caught_and_replaced_by_the_torch_path(monkeypatch):
    real = plg.project_linear_grads_triton

    def off_by_a_little(x, g, cu, p_in, p_out, w, out, chunk_tokens=None):
        res = real(x, g, cu, p_in, p_out, w, out, chunk_tokens)
        res[0, 0, 0] += 1e-2 * res.abs().max()  # one entry off by 1 % of the scale: above the 1e-4 tolerance
        return res

    monkeypatch.setattr(plg, "project_linear_grads_triton", off_by_a_little)
    x, g, cu, p_in, p_out = plg_inputs()
    out = torch.ones(4, 3, 4, device=DEV)  # accumulated into: the check must not disturb what is already there
    expected = rf"project_linear_grads on {NAME} \(float32 inputs\).*differs from the torch path by 0\.0\d+ "
    with pytest.warns(RuntimeWarning, match=expected + r"\(relative; tolerance 0\.0001\)"):
        got = project_linear_grads(x, g, cu, p_in, p_out, out=out, backend="triton")
    assert got is out
    ref = project_linear_grads(x, g, cu, p_in, p_out, backend="torch")
    torch.testing.assert_close(out, ref + 1)
    assert cluster_kernels.backends_used()["project_linear_grads"] == "torch"


def test_a_passing_check_keeps_the_kernel_and_checks_only_once(monkeypatch):
    calls = []
    real_verify = plg._verify_prefix

    def counting_verify(*args):
        calls.append(1)
        return real_verify(*args)

    monkeypatch.setattr(plg, "_verify_prefix", counting_verify)
    x, g, cu, p_in, p_out = plg_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = project_linear_grads(x, g, cu, p_in, p_out, backend="triton")
        b = project_linear_grads(x, g, cu, p_in, p_out, backend="triton")
    assert len(calls) == 1
    assert torch.equal(a, b)
    assert cluster_kernels.backends_used()["project_linear_grads"] == "triton"
    assert _selfcheck.self_check_status() == {f"project_linear_grads@{NAME}/float32": "ok"}


def test_each_dtype_is_checked_on_its_own(monkeypatch):
    real = plg.project_linear_grads_triton

    def broken_for_16_bit(x, *args, **kwargs):
        if x.dtype != torch.float32:
            raise RuntimeError("no kernel image is available for execution on the device")
        return real(x, *args, **kwargs)

    monkeypatch.setattr(plg, "project_linear_grads_triton", broken_for_16_bit)
    x, g, cu, p_in, p_out = plg_inputs()
    project_linear_grads(x, g, cu, p_in, p_out, backend="triton")
    with pytest.warns(RuntimeWarning, match=r"float16 inputs"):
        project_linear_grads(x.half(), g.half(), cu, p_in, p_out, backend="triton")
    status = _selfcheck.self_check_status()
    assert status[f"project_linear_grads@{NAME}/float32"] == "ok"
    assert status[f"project_linear_grads@{NAME}/float16"].startswith("failed")
    project_linear_grads(x, g, cu, p_in, p_out, backend="triton")
    assert cluster_kernels.backends_used()["project_linear_grads"] == "triton"


def test_the_check_compares_only_the_first_examples_within_the_token_budget():
    cu = np.array([0, 5, 14, 614, 617])
    assert _selfcheck.check_prefix(cu) == 2  # the third example would take the check past 512 tokens
    assert _selfcheck.check_prefix(np.array([0, 4000, 4001])) == 1  # at least one example
    assert _selfcheck.check_prefix(np.arange(0, 40, 2)) == 8  # at most eight
    assert _selfcheck.check_prefix(np.array([0])) == 0


def test_paper_mode_is_checked_too(monkeypatch):
    real = lmh._vocab_pass_triton

    def wrong_lse(*args, **kwargs):
        lse, z_y, readout = real(*args, **kwargs)
        return lse + 0.5, z_y, readout

    monkeypatch.setattr(lmh, "_vocab_pass_triton", wrong_lse)
    h, weight, labels, cu, _, _ = lmh_inputs()
    with pytest.warns(RuntimeWarning, match=f"lm_head_features on {NAME}"):
        got = lm_head_features(h, weight, labels, cu, mode="paper", backend="triton")
    torch.testing.assert_close(got, lm_head_features(h, weight, labels, cu, mode="paper", backend="torch"))


def test_self_check_off_runs_the_kernel_unchecked(monkeypatch):
    monkeypatch.setenv(_selfcheck.SELF_CHECK_ENV, "0")
    monkeypatch.setattr(plg, "project_linear_grads_triton", lambda x, g, cu, p_in, p_out, w, out, *a: out.add_(7.0))
    x, g, cu, p_in, p_out = plg_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = project_linear_grads(x, g, cu, p_in, p_out, backend="triton")
    assert torch.equal(got, torch.full_like(got, 7.0))  # nothing compared it
    assert _selfcheck.self_check_status() == {}
    assert cluster_kernels.backends_used()["project_linear_grads"] == "triton"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's CPU path")
def test_cpu_calls_are_not_checked_by_default(monkeypatch):
    monkeypatch.setattr(_selfcheck, "CHECKED_DEVICE_TYPES", ("cuda",))
    x, g, cu, p_in, p_out = plg_inputs()
    project_linear_grads(x, g, cu, p_in, p_out, backend="triton")
    assert _selfcheck.self_check_status() == {}


def test_compare_features_names_shape_nan_and_size_of_the_error():
    ref = torch.ones(2, 3)
    assert _selfcheck.compare_features(ref.clone(), ref, torch.float32, "triton") is None
    assert "shape (2, 2)" in _selfcheck.compare_features(torch.ones(2, 2), ref, torch.float32, "triton")
    bad = ref.clone()
    bad[1, 1] = float("nan")
    assert "non-finite" in _selfcheck.compare_features(bad, ref, torch.float32, "triton")
    assert _selfcheck.compare_features(ref * 1.005, ref, torch.bfloat16, "triton") is None  # 16-bit: 1e-2
    assert "by 0.005" in _selfcheck.compare_features(ref * 1.005, ref, torch.float32, "triton")


# --------------------------------------------------------------------------------------------------
# K-means: the CUDA path against the C++/OpenMP path (stand-ins for the CUDA call)
# --------------------------------------------------------------------------------------------------


def fake_cuda_kmeans(behaviour: str, calls: list[str]):
    """``capacity_kmeans`` whose backend="cuda" raises, returns shuffled labels, or returns the CPU result."""

    def run(x, k, *, backend, **kw):
        calls.append(backend)
        if backend == "cuda":
            if behaviour == "raise":
                raise RuntimeError("CUDA error: unspecified launch failure")
            res = capacity_kmeans(x, k, backend="cpu", **kw)
            if behaviour == "wrong":
                res.labels = torch.roll(res.labels, 1)
            return res
        return capacity_kmeans(x, k, backend=backend, **kw)

    return run


@pytest.mark.skipif(not _backend.has_cpu_native(), reason="needs cluster_kernels._C (make install)")
@pytest.mark.parametrize(("behaviour", "message"), [("raise", "unspecified launch failure"),
                                                    ("wrong", "labels differ from the C\\+\\+/OpenMP labels")])
def test_kmeans_failing_its_check_falls_back_to_the_host_path(behaviour, message):
    calls: list[str] = []
    fn = fake_cuda_kmeans(behaviour, calls)
    dev = torch.device("cpu")
    with pytest.warns(RuntimeWarning, match=rf"capacity_kmeans on cpu.*{message}.*uses the C\+\+/OpenMP \(host copy\)"):
        assert _selfcheck.kmeans_backend("capacity_kmeans", dev, "cuda", fn, True) == "cpu"
    expected = ["cuda"] if behaviour == "raise" else ["cuda", "cpu"]  # nothing to compare after a launch failure
    assert calls == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _selfcheck.kmeans_backend("capacity_kmeans", dev, "cuda", fn, True) == "cpu"
    assert calls == expected  # checked once
    assert cluster_kernels.backends_used()["capacity_kmeans"] == "cpu"
    # without the C++/OpenMP part the fallback is the torch reference
    _selfcheck.reset_self_checks()
    with pytest.warns(RuntimeWarning, match="uses the torch backend"):
        assert _selfcheck.kmeans_backend("capacity_kmeans", dev, "cuda", fn, False) == "torch"


@pytest.mark.skipif(not _backend.has_cpu_native(), reason="needs cluster_kernels._C (make install)")
def test_kmeans_passing_its_check_runs_on_cuda_and_other_choices_are_recorded():
    calls: list[str] = []
    fn = fake_cuda_kmeans("same", calls)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _selfcheck.kmeans_backend("capacity_kmeans", torch.device("cpu"), "cuda", fn, True) == "cuda"
    assert _selfcheck.self_check_status() == {"capacity_kmeans@cpu/-": "ok"}
    assert _selfcheck.kmeans_backend("assign_with_capacity", torch.device("cpu"), "cpu", fn, True) == "cpu"
    assert cluster_kernels.backends_used() == {"capacity_kmeans": "cuda", "assign_with_capacity": "cpu"}


@pytest.mark.skipif(not _backend.has_cpu_native(), reason="needs cluster_kernels._C (make install)")
def test_assign_check_compares_labels_and_costs():
    def assign(x, c, *, backend, **kw):
        labels, dist = cluster_kernels.assign_with_capacity(x, c, backend="cpu", **kw)
        return (labels, dist * (1 + 1e-6)) if backend == "cuda" else (labels, dist)

    with pytest.warns(RuntimeWarning, match="the CUDA cost .* differs"):
        assert _selfcheck.kmeans_backend("assign_with_capacity", torch.device("cpu"), "cuda", assign, True) == "cpu"


def test_kmeans_check_inputs_bind_the_bounds():
    x, cent = _selfcheck._kmeans_inputs(torch.device("cpu"))
    assert x.shape == (256, 8) and cent.shape == (4, 8)
    free = torch.cdist(x, cent).argmin(1).bincount(minlength=4)
    assert free.max() > 90 and free.min() < 40  # the capacity bounds of the check change the assignment


# --------------------------------------------------------------------------------------------------
# Dispatch with CUDA availability patched
# --------------------------------------------------------------------------------------------------


def test_auto_picks_triton_for_cuda_tensors_and_torch_for_cpu(monkeypatch):
    cuda = torch.device("cuda", 0)
    assert plg.resolve_backend("project_linear_grads", "auto", cuda) == "triton"
    assert plg.resolve_backend("project_linear_grads", "auto", torch.device("cpu")) == "torch"
    monkeypatch.setattr(plg, "has_triton", lambda: False)
    assert plg.resolve_backend("project_linear_grads", "auto", cuda) == "torch"


def test_explicit_cuda_kmeans_without_a_gpu_says_why_and_how(monkeypatch):
    with_cuda = types.SimpleNamespace(has_cuda=True)
    without_cuda = types.SimpleNamespace(has_cuda=False)
    monkeypatch.setattr(_backend, "native", lambda: without_cuda)
    with pytest.raises(RuntimeError, match=r"built without its CUDA part.*CLUSTER_KERNELS_CUDA=1 pip install -e \."):
        _backend.require_cuda_native("capacity_kmeans")
    monkeypatch.setattr(_backend, "native", lambda: with_cuda)
    monkeypatch.setattr(_backend, "cuda_device_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA device is visible to torch.*run on a machine with a GPU"):
        _backend.require_cuda_native("capacity_kmeans")
    monkeypatch.setattr(_backend, "cuda_device_available", lambda: True)
    assert _backend.require_cuda_native("capacity_kmeans") is with_cuda
    monkeypatch.setattr(_backend, "native", lambda: None)
    with pytest.raises(RuntimeError, match="extension cluster_kernels._C is not built"):
        _backend.require_cuda_native("capacity_kmeans")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu/run_all.sh runs it)")
def test_the_real_kernels_pass_their_first_use_checks_on_the_gpu():
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for dtype in (torch.float32, torch.bfloat16):
            x, g, cu, p_in, p_out = plg_inputs()
            project_linear_grads(x.to(dtype), g.to(dtype), cu, p_in, p_out)
            h, weight, labels, cu2, pi, po = lmh_inputs(d=64, vocab=700)
            lm_head_features(h.to(dtype), weight.to(dtype), labels, cu2, p_in=pi, p_out=po, mode="projected")
            lm_head_features(h.to(dtype), weight.to(dtype), labels, cu2, mode="paper")
        status = _selfcheck.self_check_status()
        assert {k for k, v in status.items() if v == "ok"} == {
            f"{op}@{NAME}/{dt}" for op in ("project_linear_grads", "lm_head_features") for dt in ("float32", "bfloat16")
        }, status
        assert cluster_kernels.backends_used() == {"project_linear_grads": "triton", "lm_head_features": "triton"}
        if _backend.has_cuda_native():
            x, _ = _selfcheck._kmeans_inputs(DEV)
            capacity_kmeans(x, 4, max_size=80)
            cluster_kernels.assign_with_capacity(x, x[:4], max_size=80)
            status = _selfcheck.self_check_status()
            assert status[f"capacity_kmeans@{NAME}/-"] == "ok" and status[f"assign_with_capacity@{NAME}/-"] == "ok"
            assert cluster_kernels.backends_used()["capacity_kmeans"] == "cuda"
