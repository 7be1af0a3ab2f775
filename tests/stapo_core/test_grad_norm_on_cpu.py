"""The paper's gradient-norm identity and bounds against autograd, and the entropy function."""

import math

import pytest
import torch

from stapo_core import entropy_from_logits, grad_norm_bounds, logit_grad_norm

VOCABS = [2, 3, 10, 1000, 50000]


def _logits(vocab, positions=6, seed=0):
    """Logits from peaked to flat: row j scaled by a different temperature."""
    gen = torch.Generator().manual_seed(seed + vocab)
    scales = torch.tensor([0.1, 1.0, 3.0, 8.0, 20.0, 0.5])[:positions, None]
    return torch.randn(positions, vocab, generator=gen) * scales


def _targets(logits, seed=0):
    """Mix of the argmax (likely), random and the argmin (rare) tokens."""
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, logits.shape[-1], (logits.shape[0],), generator=gen)
    picks[0] = logits[0].argmax()
    picks[-1] = logits[-1].argmin()
    return picks


def _autograd_sq_norm(logits, target, weight=1.0):
    """||d (w log softmax(a)_k) / d a||^2 per row, float64, by autograd."""
    out = []
    for a, k in zip(logits.double(), target.tolist()):
        a = a.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(weight * torch.log_softmax(a, -1)[k], a)
        out.append(float((g * g).sum()))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("vocab", VOCABS)
def test_logit_grad_norm_equals_autograd(vocab):
    logits = _logits(vocab)
    target = _targets(logits)
    got = logit_grad_norm(logits, target)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _autograd_sq_norm(logits, target).sqrt(), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("weight", [1.0, 0.5, -2.0])
def test_weighted_norm_and_bounds_hold(vocab, weight):
    logits = _logits(vocab, seed=1)
    target = _targets(logits, seed=1)
    exact_sq = _autograd_sq_norm(logits, target, weight)
    # exact: w^2 (1 - 2 pi_k + sum pi^2)
    formula = weight**2 * logit_grad_norm(logits, target).double() ** 2
    torch.testing.assert_close(exact_sq, formula, rtol=5e-5, atol=1e-6)
    p = torch.softmax(logits.double(), -1)
    prob = p.gather(-1, target[:, None])[:, 0]
    lower, upper = grad_norm_bounds(entropy_from_logits(logits), prob, vocab)
    tol = 1e-5
    assert torch.all(weight**2 * lower.double() <= exact_sq + tol)
    assert torch.all(exact_sq <= weight**2 * upper.double() + tol)


def test_bounds_by_hand_on_two_tokens():
    # V = 2, pi = (0.9, 0.1), target k = 1 (the rare one)
    p = torch.tensor([0.9, 0.1], dtype=torch.float64)
    h = float(-(p * p.log()).sum())
    lower, upper = grad_norm_bounds(torch.tensor(h), torch.tensor(0.1), 2)
    exact = 1 - 2 * 0.1 + 0.81 + 0.01
    assert float(lower) == pytest.approx(1 - 0.2 + math.exp(-h), rel=1e-6)
    assert float(upper) == pytest.approx(2 - 0.2 - (1 / (2 * math.log(2) ** 2)) * h * h, rel=1e-6)
    assert float(lower) <= exact <= float(upper)


@pytest.mark.parametrize("vocab", [2, 10, 1000])
def test_upper_bound_is_tight_on_the_uniform_distribution(vocab):
    # uniform: H = ln V, exact = 1 - 2/V + 1/V = upper = 2 - 2/V - (V-1)/V
    logits = torch.zeros(1, vocab)
    norm_sq = float(logit_grad_norm(logits, torch.tensor([0]))) ** 2
    lower, upper = grad_norm_bounds(entropy_from_logits(logits), torch.tensor([1 / vocab]), vocab)
    assert norm_sq == pytest.approx(1 - 1 / vocab, rel=1e-5)
    assert float(upper) == pytest.approx(1 - 1 / vocab, rel=1e-5)
    assert float(lower) == pytest.approx(1 - 1 / vocab, rel=1e-5)  # exp(-ln V) = 1/V = sum pi^2


def test_norm_vanishes_for_a_certain_target_without_cancellation():
    logits = torch.tensor([[30.0, 0.0, 0.0]])
    got = float(logit_grad_norm(logits, torch.tensor([0])))
    eps = 2 * math.exp(-30.0)  # 1 - pi_0, to first order
    assert got == pytest.approx(math.sqrt(eps**2 + 2 * math.exp(-60.0)), rel=1e-4)


@pytest.mark.parametrize("vocab", VOCABS)
def test_entropy_equals_minus_sum_p_log_p(vocab):
    logits = _logits(vocab, seed=2)
    log_p = torch.log_softmax(logits.double(), -1)
    reference = -(log_p.exp() * log_p).sum(-1)
    got = entropy_from_logits(logits)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5)


def test_entropy_with_masked_vocabulary_is_finite():
    logits = torch.tensor([[0.0, 0.0, -math.inf, -math.inf]], requires_grad=True)
    h = entropy_from_logits(logits)
    assert float(h.detach()) == pytest.approx(math.log(2))
    (g,) = torch.autograd.grad(h.sum(), logits)
    assert torch.all(torch.isfinite(g))


def test_chunked_equals_unchunked():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 5, 300, generator=gen) * 4
    target = torch.randint(0, 300, (2, 5), generator=gen)
    full_h, full_n = entropy_from_logits(logits), logit_grad_norm(logits, target)
    assert full_h.shape == (2, 5) and full_n.shape == (2, 5)
    for chunk in (1, 3, 7, 100):
        torch.testing.assert_close(entropy_from_logits(logits, chunk_size=chunk), full_h, rtol=0, atol=1e-6)
        torch.testing.assert_close(logit_grad_norm(logits, target, chunk_size=chunk), full_n, rtol=0, atol=1e-6)


def test_bf16_logits_are_computed_in_float32():
    logits = _logits(1000, seed=3).bfloat16()
    target = _targets(logits)
    h = entropy_from_logits(logits, chunk_size=2)
    n = logit_grad_norm(logits, target, chunk_size=2)
    assert h.dtype == torch.float32 and n.dtype == torch.float32
    torch.testing.assert_close(h, entropy_from_logits(logits.float()), rtol=0, atol=1e-6)
    torch.testing.assert_close(n.double(), _autograd_sq_norm(logits.float(), target).sqrt(), rtol=2e-5, atol=1e-6)


def test_empty_positions():
    logits = torch.zeros(0, 7)
    assert entropy_from_logits(logits, chunk_size=4).shape == (0,)
    assert logit_grad_norm(logits, torch.zeros(0, dtype=torch.long), chunk_size=4).shape == (0,)
