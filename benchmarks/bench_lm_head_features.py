"""pytest-benchmark: ``lm_head_features`` vs the authors' materialised ``log_softmax`` proxy.

Run from the repository root::

    PYTHONPATH=.:python_api pytest benchmarks/bench_lm_head_features.py --benchmark-group-by=group

T = 512 tokens, V = 32 000, d = 256 (float32). Peak memory is measured by
``benchmarks/features_report.py`` (fresh process per method), not here.
"""

import pytest
import torch

from cluster_kernels.lm_head_features import lm_head_features
from cluster_kernels.projection import random_projection

N_TOK, VOCAB, HIDDEN = 512, 32000, 256


def _inputs(device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(N_TOK, HIDDEN, generator=gen).to(device, dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5).to(device, dtype)
    labels = torch.randint(0, VOCAB, (N_TOK,), generator=gen).to(device)
    cu = torch.tensor([0, 100, 300, N_TOK], device=device)
    return h, weight, labels, cu


def materialised_paper_proxy(h, weight, labels, cu):
    """The authors' computation: full logits, log_softmax, gather, per-example mean of (p_y - 1) h."""
    logp = torch.log_softmax(h.float() @ weight.float().T, dim=-1)
    per_tok = (logp.gather(1, labels[:, None]).squeeze(1).exp() - 1.0)[:, None] * h.float()
    return torch.stack([per_tok[cu[i] : cu[i + 1]].mean(0) for i in range(len(cu) - 1)])


@pytest.mark.benchmark(group="lm_head_features-paper")
def test_paper_torch(benchmark):
    h, weight, labels, cu = _inputs()
    out = benchmark(lm_head_features, h, weight, labels, cu, mode="paper", backend="torch")
    torch.testing.assert_close(out, materialised_paper_proxy(h, weight, labels, cu), rtol=1e-4, atol=1e-6)


@pytest.mark.benchmark(group="lm_head_features-paper")
def test_paper_materialised(benchmark):
    h, weight, labels, cu = _inputs()
    benchmark(materialised_paper_proxy, h, weight, labels, cu)


@pytest.mark.benchmark(group="lm_head_features-projected")
def test_projected_torch(benchmark):
    h, weight, labels, cu = _inputs()
    p_in = random_projection(HIDDEN, 64, seed=0, name="in")
    p_out = random_projection(VOCAB, 64, seed=0, name="out")
    out = benchmark(lm_head_features, h, weight, labels, cu, p_in=p_in, p_out=p_out, mode="projected", backend="torch")
    assert out.shape == (3, 64, 64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel is benchmarked on a CUDA device only")
@pytest.mark.parametrize("mode", ["paper", "projected"])
@pytest.mark.benchmark(group="lm_head_features-cuda")
def test_triton_cuda(benchmark, mode):
    h, weight, labels, cu = _inputs("cuda", torch.bfloat16)
    kw = {}
    if mode == "projected":
        kw = dict(
            p_in=random_projection(HIDDEN, 64, seed=0, name="in", device="cuda"),
            p_out=random_projection(VOCAB, 64, seed=0, name="out", device="cuda"),
        )

    def run():
        out = lm_head_features(h, weight, labels, cu, mode=mode, backend="triton", **kw)
        torch.cuda.synchronize()
        return out

    run()
    benchmark(run)
