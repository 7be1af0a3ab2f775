"""Degenerate batches: empty masks, everything silenced, no candidates, non-finite inputs, bf16."""

import math

import pytest
import torch

from stapo_core import STRATEGIES, s2t_mask, entropy_topk_mask
from tests.helpers.reference_loss import AGG_MODES, clipped_policy_loss

RARE = math.log(1e-4)


def _batch(batch=3, width=6, log_prob=RARE, adv=1.0, mask=1.0, dtype=torch.float32):
    return (
        torch.full((batch, width), log_prob, dtype=dtype),
        torch.linspace(0.1, 2.0, batch * width).reshape(batch, width).to(dtype),
        torch.full((batch,), adv, dtype=dtype),
        torch.full((batch, width), mask, dtype=dtype),
    )


def _assert_finite_zero_loss_with_grad(loss_mask, agg):
    log_prob = torch.randn(*loss_mask.shape, requires_grad=True)
    adv = torch.ones(loss_mask.shape[0])
    loss, metrics = clipped_policy_loss(log_prob, log_prob.detach() - 0.1, adv, loss_mask, agg=agg)
    assert float(loss.detach()) == 0.0
    assert all(math.isfinite(float(v)) for v in metrics.values())
    (grad,) = torch.autograd.grad(loss, log_prob)  # the graph is intact
    assert torch.all(grad == 0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_empty_response_mask(strategy):
    result = s2t_mask(*_batch(mask=0.0), strategy=strategy, generator=torch.Generator().manual_seed(0))
    assert torch.all(result.keep == 0)
    assert result.stats["tokens"] == 0 and result.stats["candidates"] == 0 and result.stats["silenced"] == 0
    assert result.stats["silenced_frac"] == 0.0 and math.isnan(result.stats["tau_h"])
    assert math.isnan(result.stats["entropy_silenced_mean"])
    assert math.isnan(result.stats["entropy_kept_candidates_mean"])


@pytest.mark.parametrize("agg", AGG_MODES)
def test_loss_with_empty_mask_is_zero_and_finite(agg):
    _assert_finite_zero_loss_with_grad(torch.zeros(3, 5), agg)


def test_zero_sized_batch():
    for strategy in STRATEGIES:
        result = s2t_mask(*_batch(batch=0), strategy=strategy)
        assert result.keep.shape == (0, 6) and result.stats["tokens"] == 0
    assert entropy_topk_mask(torch.zeros(0, 4), torch.zeros(0, 4)).shape == (0, 4)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_every_token_silenced_gives_zero_finite_loss(agg):
    log_prob, entropy, adv, mask = _batch()
    result = s2t_mask(log_prob, entropy, adv, mask, strategy="full")
    assert result.stats["silenced"] == result.stats["tokens"] == 18 and result.stats["silenced_frac"] == 1.0
    assert torch.all(result.keep == 0)
    _assert_finite_zero_loss_with_grad(mask * result.keep, agg)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("adv", [0.0, -1.0])
def test_no_positive_advantage_silences_nothing(strategy, adv):
    log_prob, entropy, adv_t, mask = _batch(adv=adv)
    result = s2t_mask(log_prob, entropy, adv_t, mask, strategy=strategy, generator=torch.Generator().manual_seed(0))
    assert torch.equal(result.keep, mask) and result.stats["candidates"] == 0 and result.stats["silenced"] == 0


def test_all_equal_entropies_silence_nothing_under_low_entropy():
    log_prob, _, adv, mask = _batch()
    result = s2t_mask(log_prob, torch.full_like(log_prob, 0.7), adv, mask)
    assert result.stats["tau_h"] == pytest.approx(0.7) and result.stats["silenced"] == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("field", ["log_prob", "entropy", "advantages"])
def test_non_finite_inside_mask_raises(field, bad):
    log_prob, entropy, adv, mask = _batch()
    {"log_prob": log_prob, "entropy": entropy, "advantages": adv}[field][1] = bad
    with pytest.raises(ValueError, match=f"non-finite.*{field}"):
        s2t_mask(log_prob, entropy, adv, mask)


def test_non_finite_outside_mask_is_ignored():
    log_prob, entropy, adv, mask = _batch()
    mask[0, :2] = 0.0
    clean = s2t_mask(log_prob, entropy, adv, mask)
    log_prob[0, 0], entropy[0, 1] = math.nan, math.inf
    dirty = s2t_mask(log_prob, entropy, adv, mask)
    assert torch.equal(clean.keep, dirty.keep) and clean.stats == dirty.stats


def test_top_entropy_non_finite_inside_mask_raises():
    entropy = torch.rand(2, 5)
    entropy[1, 1] = math.nan
    with pytest.raises(ValueError, match="non-finite.*entropy"):
        entropy_topk_mask(entropy, torch.ones(2, 5))


def test_top_entropy_empty_mask_and_full_ratio():
    entropy = torch.rand(3, 4)
    assert torch.all(entropy_topk_mask(entropy, torch.zeros(3, 4)) == 0)
    mask = (torch.arange(12).reshape(3, 4) % 3 != 0).float()
    assert torch.equal(entropy_topk_mask(entropy, mask, ratio=1.0), mask)


def test_top_entropy_exactly_k_with_ties_in_flat_order():
    entropy = torch.tensor([[1.0, 2.0, 2.0], [2.0, 0.5, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # the masked 2.0 never counts
    # N = 5, k = ceil(0.5 * 5) = 3: the three tokens of entropy 2.0 inside the mask
    assert entropy_topk_mask(entropy, mask, ratio=0.5).tolist() == [[0, 1, 0], [1, 0, 1]]
    # k = ceil(0.4 * 5) = 2: ties at 2.0 broken in row-major order
    assert entropy_topk_mask(entropy, mask, ratio=0.4).tolist() == [[0, 1, 0], [1, 0, 0]]
    # float error of 0.2 * 15 = 3.0000000000000004 does not add a token
    assert entropy_topk_mask(torch.rand(3, 5), torch.ones(3, 5), ratio=0.2).sum() == 3


def test_bf16_everywhere():
    log_prob, entropy, adv, mask = _batch(dtype=torch.bfloat16)
    result = s2t_mask(log_prob, entropy, adv, mask, q=0.5)
    assert result.keep.dtype == torch.float32 and result.stats["silenced"] == 9  # half of 18 distinct values
    keep = entropy_topk_mask(entropy, mask)
    assert keep.dtype == torch.float32 and keep.sum() == math.ceil(0.2 * 18)
    new = log_prob.clone().requires_grad_(True)
    loss, _ = clipped_policy_loss(new, log_prob - 0.05, adv, mask * result.keep)
    assert loss.dtype == torch.float32 and math.isfinite(float(loss.detach()))
    (grad,) = torch.autograd.grad(loss, new)
    assert grad.dtype == torch.bfloat16 and torch.all(torch.isfinite(grad.float()))
