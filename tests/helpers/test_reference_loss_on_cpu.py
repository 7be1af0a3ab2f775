"""Clipped surrogate and its aggregations against scalar hand computations."""

import math

import pytest
import torch

from tests.helpers.reference_loss import aggregate_loss, clipped_policy_loss, clipped_surrogate

CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0


def _token_loss(log_prob, old_log_prob, adv, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, clip_c=None):
    """L for one token in plain python floats (the paper's formula, verl's dual clip)."""
    r = math.exp(max(-20.0, min(20.0, log_prob - old_log_prob)))
    clipped_r = min(max(r, 1 - clip_low), 1 + clip_high)
    loss = -min(r * adv, clipped_r * adv)
    if clip_c is not None and adv < 0:
        loss = min(loss, -clip_c * adv)
    return loss


def _hand_matrix(log_prob, old_log_prob, adv, **clip):
    return [
        [_token_loss(log_prob[i][t], old_log_prob[i][t], adv[i], **clip) for t in range(len(log_prob[i]))]
        for i in range(len(log_prob))
    ]


def _random_case(seed=0, batch=5, width=9):
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(batch, width, generator=gen) - 2
    new = old + 0.6 * torch.randn(batch, width, generator=gen)
    adv = torch.randn(batch, generator=gen)
    mask = (torch.rand(batch, width, generator=gen) > 0.3).float()
    mask[1] = 0.0  # one sequence without tokens
    keep = (torch.rand(batch, width, generator=gen) > 0.2).float()
    return new, old, adv, mask, keep


def test_loss_matrix_equals_scalar_formula_with_and_without_dual_clip():
    new, old, adv, mask, _ = _random_case()
    for clip_c in (None, CLIP_C):
        loss_mat, _ = clipped_surrogate(new, old, adv, mask, clip_c=clip_c)
        hand = torch.tensor(_hand_matrix(new.tolist(), old.tolist(), adv.tolist(), clip_c=clip_c))
        torch.testing.assert_close(loss_mat, hand, rtol=1e-5, atol=1e-6)


def test_per_token_advantages_equal_per_sequence():
    """A (batch,) advantage is the same as that value repeated over the response's tokens."""
    new, old, adv, mask, _ = _random_case(4)
    per_sequence, _ = clipped_surrogate(new, old, adv, mask)
    per_token, _ = clipped_surrogate(new, old, adv[:, None].repeat(1, new.shape[1]), mask)
    torch.testing.assert_close(per_token, per_sequence, rtol=0, atol=0)
    changed = adv[:, None].repeat(1, new.shape[1])
    changed[0, 0] = 5.0  # a (batch, resp_len) tensor is used token by token
    loss_mat, _ = clipped_surrogate(new, old, changed, mask)
    assert float(loss_mat[0, 0]) == pytest.approx(_token_loss(float(new[0, 0]), float(old[0, 0]), 5.0), rel=1e-5)
    torch.testing.assert_close(loss_mat[:, 1:], per_sequence[:, 1:], rtol=0, atol=0)


def test_token_mean_with_keep_is_mean_over_remaining_tokens():
    new, old, adv, mask, keep = _random_case(1)
    loss_mask = mask * keep  # STAPO: M = response_mask * keep
    loss, _ = clipped_policy_loss(new, old, adv, loss_mask, clip_c=CLIP_C)
    hand = _hand_matrix(new.tolist(), old.tolist(), adv.tolist(), clip_c=CLIP_C)
    m = loss_mask.tolist()
    total = sum(hand[i][t] * m[i][t] for i in range(len(m)) for t in range(len(m[0])))
    assert float(loss) == pytest.approx(total / sum(map(sum, m)), rel=1e-5)


def test_seq_mean_token_mean_by_hand():
    new, old, adv, mask, _ = _random_case(2)
    loss, _ = clipped_policy_loss(new, old, adv, mask, agg="seq-mean-token-mean")
    hand = _hand_matrix(new.tolist(), old.tolist(), adv.tolist())
    per_seq = [
        sum(h * w for h, w in zip(row, m)) / sum(m) for row, m in zip(hand, mask.tolist()) if sum(m) > 0
    ]  # sequences without tokens excluded
    assert float(loss) == pytest.approx(sum(per_seq) / len(per_seq), rel=1e-5)


def test_seq_mean_token_sum_by_hand():
    new, old, adv, mask, _ = _random_case(3)
    loss, _ = clipped_policy_loss(new, old, adv, mask, agg="seq-mean-token-sum")
    hand = _hand_matrix(new.tolist(), old.tolist(), adv.tolist())
    per_seq = [sum(h * w for h, w in zip(row, m)) for row, m in zip(hand, mask.tolist()) if sum(m) > 0]
    assert float(loss) == pytest.approx(sum(per_seq) / len(per_seq), rel=1e-5)


def test_aggregate_ignores_non_finite_values_under_zero_mask():
    loss_mat = torch.tensor([[1.0, math.nan, 3.0], [math.inf, 2.0, 4.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    assert float(aggregate_loss(loss_mat, mask, "token-mean")) == pytest.approx(10 / 4)
    assert float(aggregate_loss(loss_mat, mask, "seq-mean-token-mean")) == pytest.approx((2 + 3) / 2)
    assert float(aggregate_loss(loss_mat, mask, "seq-mean-token-sum")) == pytest.approx((4 + 6) / 2)


# ------------------------------------------------------------------------------------------
# clip regions: value, gradient, metrics
# ------------------------------------------------------------------------------------------

# (ratio, advantage, expected loss, clip active, dual clip active, gradient nonzero)
REGIONS = [
    (1.5, 1.0, -1.28, True, False, False),  # A > 0, r > 1 + eps_high: clipped
    (1.1, 1.0, -1.1, False, False, True),  # A > 0, inside
    (0.5, 1.0, -0.5, False, False, True),  # A > 0, r < 1 - eps_low: min picks r A, not clipped
    (0.5, -1.0, 0.8, True, False, False),  # A < 0, r < 1 - eps_low: clipped
    (2.0, -1.0, 2.0, False, False, True),  # A < 0, r > 1 + eps_high, below clip_c
    (5.0, -1.0, 3.0, False, True, False),  # A < 0, r > clip_c: dual clip
]


@pytest.mark.parametrize("ratio,adv,expected,clip_active,dual_active,has_grad", REGIONS)
def test_clip_regions(ratio, adv, expected, clip_active, dual_active, has_grad):
    old = torch.tensor([[-1.0]])
    new = (old + math.log(ratio)).requires_grad_(True)
    loss, metrics = clipped_policy_loss(new, old, torch.tensor([adv]), torch.ones(1, 1), clip_c=CLIP_C)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    assert float(metrics["pg_clipfrac"]) == float(clip_active)
    assert float(metrics["pg_clipfrac_lower"]) == float(dual_active)
    (grad,) = torch.autograd.grad(loss, new)
    # d(-r A)/d log_prob = -r A where the clip is inactive, 0 where it is active
    assert float(grad) == (pytest.approx(-ratio * adv, rel=1e-5) if has_grad else 0.0)


def test_metrics_are_fractions_over_the_mask():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 1.0, 5.0, 0.5]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    _, metrics = clipped_surrogate(new, old, adv, mask, clip_c=CLIP_C)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(1 / 3)  # token 0 (token 3 is masked)
    assert float(metrics["pg_clipfrac_lower"]) == pytest.approx(1 / 3)  # token 2
    assert float(metrics["ppo_kl"]) == pytest.approx(-(math.log(1.5) + math.log(5.0)) / 3, rel=1e-6)


def test_log_ratio_is_clamped_before_exp():
    old = torch.zeros(1, 2)
    new = torch.tensor([[30.0, -30.0]])
    loss_mat, metrics = clipped_surrogate(new, old, torch.tensor([-1.0]), torch.ones(1, 2))
    assert loss_mat[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-6)  # r = e^20, not e^30
    assert float(metrics["ppo_kl"]) == pytest.approx(0.0, abs=1e-6)  # (-20 + 20) / 2


def test_gradient_equals_autograd_of_scalar_formula():
    new, old, adv, mask, keep = _random_case(4)
    new = new.double().requires_grad_(True)
    loss, _ = clipped_policy_loss(new, old.double(), adv, mask * keep, clip_c=CLIP_C)
    (grad,) = torch.autograd.grad(loss, new)
    # reference: per-token gradient of the scalar formula, by central finite differences
    eps = 1e-4
    m = (mask * keep).tolist()
    count = sum(map(sum, m))
    for i, t in [(0, 0), (2, 3), (3, 5), (4, 8)]:
        lp, olp, a = new[i, t].item(), old[i, t].item(), adv[i].item()
        fd = (_token_loss(lp + eps, olp, a, clip_c=CLIP_C) - _token_loss(lp - eps, olp, a, clip_c=CLIP_C)) / (2 * eps)
        assert grad[i, t].item() == pytest.approx(fd * m[i][t] / count, rel=1e-3, abs=1e-7)
