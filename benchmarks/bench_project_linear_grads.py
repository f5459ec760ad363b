"""pytest-benchmark: fused ``project_linear_grads`` vs LESS-style materialise-then-project.

Run from the repository root::

    PYTHONPATH=.:python_api pytest benchmarks/bench_project_linear_grads.py --benchmark-group-by=group

Both compute the same per-example features of one linear layer (same output dimension D = k_o * k_i):
the fused op never forms a gradient; the baseline forms each example's ``d_out x d_in`` gradient,
flattens it and applies a dense Rademacher projection whose ``(P, 128)`` blocks are regenerated for
every call, as TRAK's ``BasicProjector`` does when D > 128. Ratios for the whole feature pipeline
are in ``benchmarks/features_report.py``.
"""

import math

import numpy as np
import pytest
import torch

from cluster_kernels.project_linear_grads import project_linear_grads
from cluster_kernels.projection import random_projection

LENGTHS = [96, 128, 160, 64, 128, 200, 32, 216]  # 8 examples, 1024 tokens
D_IN, D_OUT, K_O, K_I = 128, 256, 32, 32


def _inputs(device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    n = sum(LENGTHS)
    x = torch.randn(n, D_IN, generator=gen).to(device, dtype)
    g = torch.randn(n, D_OUT, generator=gen).to(device, dtype)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(LENGTHS)]), device=device)
    p_in = random_projection(D_IN, K_I, seed=0, name="bench/in", device=device)
    p_out = random_projection(D_OUT, K_O, seed=0, name="bench/out", device=device)
    return x, g, cu, p_in, p_out


def materialise_then_project(x, g, cu, proj_dim, block=128):
    """Per-example gradient (d_out x d_in), flattened, times a block-regenerated dense Rademacher matrix."""
    grads = torch.stack([(g[cu[b] : cu[b + 1]].T @ x[cu[b] : cu[b + 1]]).reshape(-1) for b in range(len(cu) - 1)])
    sketch = torch.zeros(grads.shape[0], proj_dim, device=x.device)
    gen = torch.Generator(device=x.device)
    proj = torch.empty(grads.shape[1], min(block, proj_dim), device=x.device)
    for b in range(math.ceil(proj_dim / block)):
        gen.manual_seed(1000 * b)
        proj.bernoulli_(0.5, generator=gen).mul_(2).sub_(1)
        st, ed = b * block, min((b + 1) * block, proj_dim)
        sketch[:, st:ed] = grads @ proj[:, : ed - st]
    return sketch / math.sqrt(proj_dim)


@pytest.mark.benchmark(group="project_linear_grads")
def test_fused_torch(benchmark):
    x, g, cu, p_in, p_out = _inputs()
    out = benchmark(project_linear_grads, x, g, cu, p_in, p_out, backend="torch")
    assert out.shape == (len(LENGTHS), K_O, K_I)


@pytest.mark.benchmark(group="project_linear_grads")
def test_materialise_then_project_trak_style(benchmark):
    x, g, cu, *_ = _inputs()
    out = benchmark.pedantic(materialise_then_project, args=(x, g, cu, K_O * K_I), rounds=3, iterations=1)
    assert out.shape == (len(LENGTHS), K_O * K_I)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel is benchmarked on a CUDA device only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.benchmark(group="project_linear_grads-cuda")
def test_fused_triton_cuda(benchmark, dtype):
    x, g, cu, p_in, p_out = _inputs("cuda", dtype)

    def run():
        out = project_linear_grads(x, g, cu, p_in, p_out, backend="triton")
        torch.cuda.synchronize()
        return out

    assert run().shape == (len(LENGTHS), K_O, K_I)
    benchmark(run)
