"""per_example_loss against a float64 reference (values and gradients, odd shapes, bf16), weighted_loss."""

from __future__ import annotations

import pytest
import torch

from clusterlm.engine.loss import per_example_loss, weighted_loss


def _reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """float64 loop: row b's mean over t with labels[b, t+1] != -100 of -log_softmax(logits[b, t])[labels[b, t+1]]."""
    x = logits.double()
    out = []
    for b in range(x.shape[0]):
        terms = []
        for t in range(x.shape[1] - 1):
            y = int(labels[b, t + 1])
            if y != -100:
                terms.append(-torch.log_softmax(x[b, t], dim=-1)[y])
        out.append(torch.stack(terms).mean())
    return torch.stack(out)


def _labels(b: int, t: int, v: int, gen: torch.Generator) -> torch.Tensor:
    labels = torch.randint(0, v, (b, t), generator=gen)
    masked = torch.rand(b, t, generator=gen) < 0.4
    labels[masked] = -100
    for row in range(b):  # every row keeps at least one answer token after the shift
        if (labels[row, 1:] == -100).all():
            labels[row, t - 1] = int(torch.randint(0, v, (1,), generator=gen))
    return labels


SHAPES = [(1, 2, 3), (3, 7, 11), (5, 13, 257), (2, 33, 50)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk_tokens", [1, 3, None])
def test_matches_float64_reference_values_and_gradients(shape, chunk_tokens):
    b, t, v = shape
    gen = torch.Generator().manual_seed(b * 1000 + t * 10 + v)
    logits = (torch.randn(b, t, v, generator=gen) * 3).requires_grad_(True)
    labels = _labels(b, t, v, gen)
    weights = torch.rand(b, generator=gen) * 2

    loss = per_example_loss(logits, labels, chunk_tokens=chunk_tokens)
    assert loss.dtype == torch.float32 and loss.shape == (b,)
    ref_logits = logits.detach().double().requires_grad_(True)
    ref = _reference(ref_logits, labels)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)

    weighted_loss(loss, weights).backward()
    (weights.double() * ref).mean().backward()
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=1e-5, atol=1e-6)


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = _labels(3, 5, 7, gen)
    assert torch.autograd.gradcheck(lambda x: per_example_loss(x, labels, chunk_tokens=2), (logits,))


def test_bf16_logits_use_float32_math():
    gen = torch.Generator().manual_seed(1)
    b, t, v = 4, 9, 301
    logits32 = torch.randn(b, t, v, generator=gen) * 4
    logits = logits32.to(torch.bfloat16).requires_grad_(True)
    labels = _labels(b, t, v, gen)
    loss = per_example_loss(logits, labels, chunk_tokens=5)
    assert loss.dtype == torch.float32
    # the reference on the same (rounded) bf16 values in float64: only float32 rounding separates them
    ref_logits = logits.detach().double().requires_grad_(True)
    ref = _reference(ref_logits, labels)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    loss.sum().backward()
    ref.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=1e-2, atol=1e-3)  # bf16 storage


def test_non_contiguous_logits_and_int32_labels():
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(6, 3, 17, generator=gen, requires_grad=True)
    logits = base.transpose(0, 1)  # (3, 6, 17), not contiguous
    labels = _labels(3, 6, 17, gen).to(torch.int32)
    loss = per_example_loss(logits, labels, chunk_tokens=4)
    ref = _reference(logits.detach(), labels)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    loss.mean().backward()
    assert base.grad is not None and torch.isfinite(base.grad).all()


def test_unlabelled_positions_get_zero_gradient():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, 9, generator=gen, requires_grad=True)
    labels = torch.full((2, 6), -100)
    labels[0, 3] = 4
    labels[1, 5] = 1
    labels[1, 0] = 2  # position 0 is never a target after the shift
    per_example_loss(logits, labels).sum().backward()
    touched = logits.grad.abs().sum(-1) > 0
    expected = torch.zeros(2, 6, dtype=torch.bool)
    expected[0, 2] = expected[1, 4] = True
    assert torch.equal(touched, expected)


def test_examples_without_answer_tokens_are_named():
    logits = torch.randn(4, 5, 8)
    labels = torch.randint(0, 8, (4, 5))
    labels[1, 1:] = -100
    labels[3] = -100
    with pytest.raises(ValueError, match=r"rows \[1, 3\] of labels have no answer token"):
        per_example_loss(logits, labels)


@pytest.mark.parametrize(
    "logits, labels, kwargs, error, match",
    [
        (torch.randn(2, 4, 5), torch.zeros(2, 3, dtype=torch.long), {}, ValueError, r"labels \(2, 3\)"),
        (torch.randn(2, 4), torch.zeros(2, 4, dtype=torch.long), {}, ValueError, r"logits \(B, T, V\)"),
        (torch.zeros(2, 4, 5, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), {}, TypeError, "floating"),
        (torch.randn(2, 4, 5), torch.zeros(2, 4), {}, TypeError, "integer"),
        (torch.randn(2, 4, 5), torch.full((2, 4), 5), {}, ValueError, r"-100 or in \[0, 5\)"),
        (torch.randn(2, 4, 5), torch.zeros(2, 4, dtype=torch.long), {"chunk_tokens": 0}, ValueError, "chunk_tokens"),
    ],
)
def test_per_example_loss_errors(logits, labels, kwargs, error, match):
    with pytest.raises(error, match=match):
        per_example_loss(logits, labels, **kwargs)


def test_weighted_loss_value_and_gradient():
    loss = torch.tensor([0.5, 2.0, 1.0, 4.0], requires_grad=True)
    w = torch.tensor([1.5, 0.5, 1.0, 1.0])
    out = weighted_loss(loss, w)
    assert out.item() == pytest.approx((0.75 + 1.0 + 1.0 + 4.0) / 4)
    out.backward()
    torch.testing.assert_close(loss.grad, w / 4)
    # numpy / list weights are accepted and moved to the loss's dtype
    assert weighted_loss(loss.detach().double(), [1.0, 1.0, 1.0, 1.0]).dtype == torch.float64


@pytest.mark.parametrize(
    "loss, w, error, match",
    [
        (torch.ones(3), torch.ones(2), ValueError, r"weights must have the loss's shape \(3,\), got \(2,\)"),
        (torch.ones(0), torch.ones(0), ValueError, "B > 0"),
        (torch.ones(2, 2), torch.ones(2, 2), ValueError, r"shape \(B,\)"),
        (torch.ones(2), torch.tensor([1.0, -1.0]), ValueError, ">= 0"),
        (torch.ones(2), torch.tensor([1.0, float("nan")]), ValueError, "NaN"),
        (torch.ones(2, dtype=torch.long), torch.ones(2), TypeError, "floating-point"),
    ],
)
def test_weighted_loss_errors(loss, w, error, match):
    with pytest.raises(error, match=match):
        weighted_loss(loss, w)


def test_backward_keeps_no_float32_copy_of_the_logits():
    """What autograd saves for backward: the bf16 logits themselves and per-token scalars, no (tokens, V) float32."""
    gen = torch.Generator().manual_seed(4)
    b, t, v = 3, 16, 512
    logits = torch.randn(b, t, v, generator=gen).to(torch.bfloat16).requires_grad_(True)
    labels = _labels(b, t, v, gen)
    saved = []

    def pack(x):
        saved.append((x.dtype, x.numel()))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = per_example_loss(logits, labels, chunk_tokens=4)
    big_float32 = [s for s in saved if s[0] == torch.float32 and s[1] >= 4 * v]
    assert big_float32 == [], saved
    loss.sum().backward()
    assert logits.grad.shape == logits.shape
