"""GPU code paths without a GPU: fake CUDA tensors (torch's FakeTensorMode) through the kernel side.

What this covers and what it cannot. A FakeTensor with ``device="cuda"`` carries shape, dtype and device but
no data, and raises on a CPU/CUDA mix, so it checks device placement without a GPU. In a CPU-only torch build
(the one this project is tested with) only part of torch works on them: factories, elementwise ops, matmul and
``index_select`` do; views/``select``/indexing, ``.to("cuda")`` and autograd need the CUDA device guard, which
a CPU-only build lacks ("PyTorch is not linked with support for cuda devices"; autograd even terminates the
process). So a model's forward (embedding under autograd) cannot run on fake CUDA tensors here, and neither
can ``GradientFeaturizer.featurize_batch``; what runs is covered below: the featurizer on a model whose weights
are fake CUDA tensors (it featurizes on their device), the ops' device checks on CPU/CUDA mixes, backend
dispatch on CUDA devices, and the kernels' launch arguments built from CUDA tensors.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cluster_kernels.lm_head_features import lm_head_features
from cluster_kernels.project_linear_grads import project_linear_grads
from clusterlm.models.pretrain import tiny_llama_config
from clusterlm.selection.features import GradientFeaturizer

lmh = importlib.import_module("cluster_kernels.lm_head_features")
plg = importlib.import_module("cluster_kernels.project_linear_grads")
CUDA = torch.device("cuda", 0)


@pytest.fixture
def fake():
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        yield mode


def fake_cuda_model():
    """tiny-llama's architecture (clusterlm's built-in) built on the meta device, weights as fake CUDA tensors."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_llama_config(300, 1, 2, 0))
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            fake_p = torch.empty(p.shape, dtype=torch.bfloat16, device="cuda")
            setattr(module, name, torch.nn.Parameter(fake_p, requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            module.register_buffer(name, torch.empty(b.shape, dtype=b.dtype, device="cuda"), persistent=False)
    return model


def test_the_featurizer_works_on_the_device_and_dtype_of_the_model(fake):
    model = fake_cuda_model()
    for layers, dim in (("lm_head", (32, 32)), ("all-linear", (16, 16)), ("paper", None)):
        fz = GradientFeaturizer(model, features=layers, dim=dim)
        assert fz.device == CUDA
        assert all(p.device == CUDA and p.dtype == torch.bfloat16 for p in model.parameters())
    fz = GradientFeaturizer(model, features="all-linear", dim=(16, 16))
    assert len(fz.layer_names) == 4 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the lm head


def test_kernels_refuse_a_cpu_cuda_mix_naming_both_devices(fake):
    h = torch.empty(12, 16, dtype=torch.bfloat16, device="cuda")
    weight = torch.empty(50, 16, dtype=torch.bfloat16, device="cuda")
    cu = torch.tensor([0, 5, 12])
    with pytest.raises(ValueError, match=r"labels is on cpu but h is on cuda:0"):
        lm_head_features(h, weight, torch.zeros(12, dtype=torch.int64), cu, mode="paper")
    with pytest.raises(ValueError, match=r"weight is on cpu but h is on cuda:0"):
        lm_head_features(h, torch.empty(50, 16, dtype=torch.bfloat16), torch.zeros(12, dtype=torch.int64), cu,
                         mode="paper")
    x = torch.empty(12, 16, device="cuda")
    with pytest.raises(ValueError, match=r"p_in is on cpu but x is on cuda:0"):
        project_linear_grads(x, torch.empty(12, 8, device="cuda"), cu, torch.empty(16, 4), torch.empty(8, 4,
                                                                                                        device="cuda"))
    with pytest.raises(ValueError, match=r"out is on cpu but x is on cuda:0"):
        project_linear_grads(x, torch.empty(12, 8, device="cuda"), cu, torch.empty(16, 4, device="cuda"),
                             torch.empty(8, 4, device="cuda"), out=torch.zeros(2, 4, 4))


def test_auto_dispatch_picks_triton_for_cuda_tensors(fake, monkeypatch):
    x = torch.empty(12, 16, device="cuda")
    assert x.device == CUDA
    assert plg.resolve_backend("project_linear_grads", "auto", x.device) == "triton"
    assert plg.resolve_backend("project_linear_grads", "auto", torch.empty(3).device) == "torch"
    monkeypatch.setattr(plg, "has_triton", lambda: False)  # a CUDA machine without triton: the torch path
    assert plg.resolve_backend("project_linear_grads", "auto", x.device) == "torch"
    with pytest.raises(ValueError, match="there is no native CUDA build of this op; use backend='triton'"):
        plg.resolve_backend("project_linear_grads", "cuda", x.device)


def test_launch_arguments_from_cuda_tensors(fake):
    pytest.importorskip("triton")
    h = torch.empty(40, 576, dtype=torch.bfloat16, device="cuda")
    weight = torch.empty(49152, 576, dtype=torch.bfloat16, device="cuda")
    y = torch.empty(40, dtype=torch.int64, device="cuda")
    p_out = torch.empty(49152, 32, device="cuda")
    f = torch.empty(40, device="cuda")
    args = lmh.vocab_pass_kernel_args(h, weight, None, y, p_out, f, f, torch.empty(40, 32, device="cuda"))
    tensors = {k: v for k, v in args.items() if isinstance(v, torch.Tensor)}
    assert tensors and all(t.device == CUDA for t in tensors.values())
    assert (args["d"], args["V"], args["BLOCK_K"], args["PRECISION"]) == (576, 49152, 32, "tf32")
    assert (args["stride_wv"], args["stride_wd"], args["stride_pv"]) == (576, 1, 32)
    x = torch.empty(40, 576, device="cuda")
    items = tuple(torch.empty(3, dtype=torch.int64, device="cuda") for _ in range(4))
    args = plg.project_kernel_args(x, torch.empty(40, 32, device="cuda"), f, torch.empty(576, 32, device="cuda"),
                                   torch.eye(32, device="cuda"), torch.empty(2, 1, 32, 32, device="cuda"), items)
    assert all(v.device == CUDA for v in args.values() if isinstance(v, torch.Tensor))
    assert (args["HAS_WEIGHTS"], args["PRECISION"], args["BLOCK_KO"], args["BLOCK_KI"]) == (True, "ieee", 32, 32)


# --------------------------------------------------------------------------------------------------
# The GPU run's features check (benchmarks/gpu/compare_features.py), run on the CPU
# --------------------------------------------------------------------------------------------------


def _compare_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "compare_features.py"
    spec = importlib.util.spec_from_file_location("compare_features", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_comparison_helpers():
    import numpy as np

    cf = _compare_module()
    a = np.array([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0], [3.0, 4.0]])
    b = np.array([[2.0, 0.0], [0.0, -1.0], [1.0, 1.0], [4.0, 3.0]])
    np.testing.assert_allclose(cf.cosine_per_example(a, b), [1.0, -1.0, 0.0, 24 / 25])
    with pytest.raises(ValueError, match="one shape"):
        cf.cosine_per_example(a, b[:2])
    s = cf.summarize(np.array([1.0, 0.995, 0.5]), goal=0.99)
    assert (s["n"], s["below_goal"], s["worst_example"], s["min"]) == (3, 1, 2, 0.5)
    lengths = [5, 100, 7, 30, 31, 2]
    batches = cf.length_batches(lengths, 64)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert all(len(b) * max(lengths[i] for i in b) <= 64 or len(b) == 1 for b in batches)
    assert [100] in [[lengths[i] for i in b] for b in batches]  # longer than the budget: alone


def test_features_check_runs_end_to_end_on_the_cpu(demo, tmp_path):
    import json

    cf = _compare_module()
    rc = cf.main(["--model", "tiny-llama", "--root", str(demo.root), "--data", str(demo.train), "--out",
                  str(tmp_path), "--device", "cpu", "--dtype", "float32", "--n", "12", "--n-ref", "6",
                  "--batch-tokens", "4096", "--max-length", "1024"])
    assert rc == 0
    res = json.loads((tmp_path / "gpu_features_check.json").read_text())
    assert res["examples"] == 12 and res["cosine"]["n"] == 6
    assert res["cosine"]["min"] > 0.9999  # the same model, device and dtype on both sides
    assert res["features_tokens_per_s"] > 0 and res["forward_tokens_per_s"] > 0 and res["speed_ratio"] > 0
    assert res["backends"]["lm_head_features"] in ("torch", "triton")


def test_in_process_kmeans_runs_on_the_models_cuda_device(monkeypatch):
    """select_from_features with a CUDA device: one device copy of the features goes to capacity_kmeans (auto
    picks its CUDA kernels there), results come back to the host for the picks; cpu/torch backends and a build
    without the CUDA K-means stay on the host."""
    import numpy as np

    sel = importlib.import_module("clusterlm.selection.select")  # the module (clusterlm.select is the function)
    from cluster_kernels import capacity_kmeans as real_kmeans

    x = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    seen = []

    def upload(arr, device):  # the H2D copy itself needs a CUDA build; a fake CUDA tensor of the same shape stands in
        seen.append(("copy", tuple(arr.shape), device))
        with FakeTensorMode():
            return torch.empty(arr.shape, dtype=torch.float32, device=device)

    def kmeans(data, k, **kw):  # what the CUDA K-means would return, computed by the C++ one on the same features
        seen.append(("kmeans", data.device if isinstance(data, torch.Tensor) else type(data).__name__, kw["backend"]))
        return real_kmeans(sel.l2_normalize(x), k, **kw | {"backend": "cpu"})

    monkeypatch.setattr(sel, "_to_device", upload)
    monkeypatch.setattr(sel, "capacity_kmeans", kmeans)
    monkeypatch.setattr(sel, "has_cuda_kmeans", lambda: True)
    plan = sel.select_from_features(x, world_size=2, ratio=0.5, device="cuda:0")
    assert seen == [("copy", (64, 8), CUDA), ("kmeans", CUDA, "auto")]
    assert plan.n_selected == 32 and isinstance(plan.cluster_labels, np.ndarray)
    assert sel.kmeans_device("cuda:0", "cuda") == CUDA
    assert sel.kmeans_device("cuda:0", "cpu") is None and sel.kmeans_device("cuda:0", "torch") is None
    assert sel.kmeans_device("cpu", "auto") is None and sel.kmeans_device(None, "auto") is None
    monkeypatch.setattr(sel, "has_cuda_kmeans", lambda: False)
    assert sel.kmeans_device("cuda:0", "auto") is None  # the host C++ path, not the float64 reference on the GPU
    seen.clear()
    sel.select_from_features(x, world_size=2, ratio=0.5, device="cuda:0")
    assert len(seen) == 1 and seen[0][0] == "kmeans" and seen[0][1] == "ndarray"
