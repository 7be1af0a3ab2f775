"""S2T mask (stapo_core.s2t_mask) on hand-built batches, each condition checked on its own."""

import math
import pytest
import torch

from tests.helpers.dist_utils import SyncRecorder
from stapo_core import STRATEGIES, quantile_sorted_padded, s2t_candidates, s2t_mask

RARE = math.log(1e-4)  # log-prob of a token that passes p < tau_p for the default tau_p
COMMON = math.log(0.5)


def _row(values, dtype=torch.float32):
    return torch.tensor([values], dtype=dtype)


def _boolean_reference(log_prob, entropy, advantages, mask, tau_p, q, strategy):
    """The S2T mask written the obvious way (boolean indexing, torch.quantile)."""
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(log_prob)
    cand = (mask != 0) & (adv > 0) & (log_prob.float().exp() < tau_p)
    ent = entropy.float()
    if cand.sum() == 0:
        return (mask != 0).float(), math.nan
    if strategy == "low_entropy":
        tau = torch.quantile(ent[cand], q)
        silenced = cand & (ent < tau)
    elif strategy == "high_entropy":
        tau = torch.quantile(ent[cand], 1 - q)
        silenced = cand & (ent > tau)
    else:
        tau, silenced = torch.tensor(math.nan), cand
    return ((mask != 0) & ~silenced).float(), float(tau)


# ------------------------------------------------------------------------------------------
# the sync-free quantile
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 1001])
@pytest.mark.parametrize("q", [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.999, 1.0])
def test_quantile_sorted_padded_equals_torch_quantile(n, q):
    gen = torch.Generator().manual_seed(n)
    values = torch.randn(n, generator=gen) * 3
    padded = torch.cat([values, torch.full((17,), math.inf)])
    got = quantile_sorted_padded(torch.sort(padded).values, torch.tensor(n), q)
    assert torch.equal(got, torch.quantile(values, q))


def test_quantile_sorted_padded_without_values_is_nan():
    assert math.isnan(quantile_sorted_padded(torch.full((5,), math.inf), torch.tensor(0), 0.75))
    assert math.isnan(quantile_sorted_padded(torch.zeros(0), torch.tensor(0), 0.75))


# ------------------------------------------------------------------------------------------
# the candidate set, one condition at a time (strategy "full" silences exactly the candidates)
# ------------------------------------------------------------------------------------------


def test_advantage_zero_or_negative_is_not_a_candidate():
    log_prob = torch.full((3, 4), RARE)
    entropy = torch.ones(3, 4)
    mask = torch.ones(3, 4)
    advantages = torch.tensor([1.0, 0.0, -1.0])
    result = s2t_mask(log_prob, entropy, advantages, mask, strategy="full")
    assert torch.equal(result.keep, torch.tensor([[0.0] * 4, [1.0] * 4, [1.0] * 4]))
    assert result.stats["candidates"] == 4 and result.stats["silenced"] == 4


def test_probability_threshold_is_strict():
    p = torch.tensor(0.002, dtype=torch.float32)
    lp_edge = torch.log(p)
    tau_p = float(torch.exp(lp_edge))  # exactly the float32 probability of lp_edge
    lp_below = torch.nextafter(lp_edge, torch.tensor(-math.inf))
    lp_above = torch.nextafter(lp_edge, torch.tensor(math.inf))
    assert float(torch.exp(lp_below)) < tau_p and float(torch.exp(lp_above)) > tau_p  # preconditions
    log_prob = torch.stack([lp_edge, lp_below, lp_above]).reshape(1, 3)
    result = s2t_mask(log_prob, torch.ones(1, 3), torch.ones(1), torch.ones(1, 3), tau_p=tau_p, strategy="full")
    assert result.keep.tolist() == [[1.0, 0.0, 1.0]]  # p == tau_p kept, p just below silenced


def test_candidates_alone_are_s2t_masks_candidate_set():
    """``s2t_candidates`` (the set the update effect reads for STAPO) is exactly the candidate set
    ``s2t_mask`` splits, on the strict threshold's edge too, for per-token and per-sequence advantages."""
    gen = torch.Generator().manual_seed(3)
    log_prob = (torch.randn(6, 20, generator=gen) * 4 - 6).clamp(max=0.0)  # a log-probability is <= 0
    tau_p = float(torch.exp(log_prob[0, 0]))  # a token exactly on the threshold (p == tau_p: not a candidate)
    mask = (torch.rand(6, 20, generator=gen) < 0.8).float()
    for advantages in (torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0, 1.0]), torch.randn(6, 20, generator=gen)):
        want = s2t_mask(log_prob, torch.rand(6, 20, generator=gen), advantages, mask, tau_p=tau_p).candidate
        got = s2t_candidates(log_prob, advantages, mask, tau_p=tau_p)
        assert torch.equal(got, want) and got.dtype == torch.bool and want.any()
    assert not bool(s2t_candidates(log_prob, torch.ones(6), mask, tau_p=tau_p)[0, 0])
    with pytest.raises(ValueError, match="tau_p"):
        s2t_candidates(log_prob, torch.ones(6), mask, tau_p=1.5)
    with pytest.raises(ValueError, match="shape mismatch"):
        s2t_candidates(log_prob[:, :3], torch.ones(6), mask, tau_p=0.002)


def test_token_outside_response_mask_is_never_candidate_nor_kept():
    log_prob = torch.full((1, 4), RARE)
    mask = _row([1, 1, 0, 0])
    for strategy in STRATEGIES:
        gen = torch.Generator().manual_seed(0)
        result = s2t_mask(log_prob, torch.rand(1, 4), torch.ones(1), mask, strategy=strategy, generator=gen)
        assert result.keep[0, 2:].tolist() == [0.0, 0.0]
        assert result.stats["candidates"] == 2 and result.stats["tokens"] == 2


def test_advantages_per_token_equal_per_sequence():
    gen = torch.Generator().manual_seed(1)
    log_prob = (torch.randn(5, 30, generator=gen) * 4 - 6).clamp(max=0.0)
    entropy = torch.rand(5, 30, generator=gen) * 2
    mask = (torch.rand(5, 30, generator=gen) > 0.3).float()
    adv = torch.randn(5, generator=gen)
    a = s2t_mask(log_prob, entropy, adv, mask, tau_p=0.01)
    b = s2t_mask(log_prob, entropy, adv[:, None].expand(5, 30).clone(), mask, tau_p=0.01)
    assert torch.equal(a.keep, b.keep) and a.stats == b.stats


# ------------------------------------------------------------------------------------------
# the entropy threshold
# ------------------------------------------------------------------------------------------


def _quantile_batch():
    """Row 0: five candidates with entropies 0.1 .. 2.0; row 1: common tokens; row 2: A < 0."""
    entropy = torch.tensor([[0.1, 0.5, 0.9, 1.3, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.01, 0.02, 0.03, 0.04]])
    log_prob = torch.tensor([[RARE] * 5, [COMMON] * 5, [RARE] * 5])
    advantages = torch.tensor([1.0, 1.0, -1.0])
    return log_prob, entropy, advantages, torch.ones(3, 5)


def test_low_entropy_hand_example_and_strict_threshold():
    log_prob, entropy, advantages, mask = _quantile_batch()
    result = s2t_mask(log_prob, entropy, advantages, mask, q=0.75)
    # rank 0.75 * (5 - 1) = 3 -> tau_h = 1.3 exactly; 1.3 itself is kept (H < tau_h is strict)
    assert result.stats["tau_h"] == float(torch.tensor(1.3))
    assert result.stats["tau_h"] == float(torch.quantile(entropy[0], 0.75))
    assert result.keep.tolist() == [[0, 0, 0, 1, 1], [1] * 5, [1] * 5]
    assert result.stats["candidates"] == 5 and result.stats["silenced"] == 3 and result.stats["tokens"] == 15
    assert result.stats["silenced_frac"] == pytest.approx(3 / 15)
    assert result.stats["entropy_silenced_mean"] == pytest.approx((0.1 + 0.5 + 0.9) / 3)
    assert result.stats["entropy_kept_candidates_mean"] == pytest.approx((1.3 + 2.0) / 2)


def test_low_entropy_interpolated_threshold():
    log_prob, entropy, advantages, mask = _quantile_batch()
    result = s2t_mask(log_prob, entropy, advantages, mask, q=0.6)
    # rank 0.6 * 4 = 2.4 -> 0.9 + 0.4 * (1.3 - 0.9) = 1.06
    assert result.stats["tau_h"] == pytest.approx(1.06, abs=1e-6)
    assert result.stats["tau_h"] == float(torch.quantile(entropy[0], 0.6))
    assert result.keep[0].tolist() == [0, 0, 0, 1, 1]


def test_high_entropy_hand_example():
    log_prob, entropy, advantages, mask = _quantile_batch()
    result = s2t_mask(log_prob, entropy, advantages, mask, q=0.75, strategy="high_entropy")
    # quantile at 1 - q = 0.25: rank 1 -> 0.5; silenced H > 0.5 (strict)
    assert result.stats["tau_h"] == float(torch.tensor(0.5))
    assert result.keep.tolist() == [[1, 1, 0, 0, 0], [1] * 5, [1] * 5]


def test_single_candidate_is_not_silenced_by_entropy_strategies():
    log_prob = _row([RARE, COMMON, COMMON])
    for strategy in ("low_entropy", "high_entropy"):
        result = s2t_mask(log_prob, _row([0.3, 0.1, 0.2]), torch.ones(1), torch.ones(1, 3), strategy=strategy)
        assert result.stats["tau_h"] == float(torch.tensor(0.3)) and result.stats["silenced"] == 0


@pytest.mark.parametrize("strategy", ["low_entropy", "high_entropy", "full"])
@pytest.mark.parametrize("q", [0.1, 0.5, 0.75])
def test_matches_boolean_indexing_reference_on_random_batches(strategy, q):
    gen = torch.Generator().manual_seed(int(q * 100))
    log_prob = (torch.randn(8, 64, generator=gen) * 3 - 7).clamp(max=0.0)
    entropy = torch.rand(8, 64, generator=gen) * 4
    mask = (torch.rand(8, 64, generator=gen) > 0.2).float()
    adv = torch.randn(8, generator=gen)
    result = s2t_mask(log_prob, entropy, adv, mask, tau_p=0.003, q=q, strategy=strategy)
    keep, tau = _boolean_reference(log_prob, entropy, adv, mask, 0.003, q, strategy)
    assert torch.equal(result.keep, keep)
    assert (math.isnan(tau) and math.isnan(result.stats["tau_h"])) or result.stats["tau_h"] == tau


def test_bf16_inputs_equal_float32_of_the_same_values():
    gen = torch.Generator().manual_seed(3)
    log_prob = (torch.randn(4, 40, generator=gen) * 3 - 7).clamp(max=0.0).bfloat16()
    entropy = (torch.rand(4, 40, generator=gen) * 3).bfloat16()
    adv = torch.randn(4, generator=gen).bfloat16()
    mask = torch.ones(4, 40, dtype=torch.bool)
    a = s2t_mask(log_prob, entropy, adv, mask, tau_p=0.01)
    b = s2t_mask(log_prob.float(), entropy.float(), adv.float(), mask, tau_p=0.01)
    assert a.keep.dtype == torch.float32 and torch.equal(a.keep, b.keep) and a.stats == b.stats


# ------------------------------------------------------------------------------------------
# random strategy
# ------------------------------------------------------------------------------------------


def _random_batch(n_rows=50, width=400):
    gen = torch.Generator().manual_seed(11)
    log_prob = torch.where(torch.rand(n_rows, width, generator=gen) < 0.5, RARE, COMMON)
    adv = torch.where(torch.arange(n_rows) % 5 == 0, -1.0, 1.0)
    return log_prob, torch.rand(n_rows, width, generator=gen), adv, torch.ones(n_rows, width)


def test_random_is_reproducible_with_a_seeded_generator():
    batch = _random_batch()
    a = s2t_mask(*batch, q=0.3, strategy="random", generator=torch.Generator().manual_seed(5))
    b = s2t_mask(*batch, q=0.3, strategy="random", generator=torch.Generator().manual_seed(5))
    c = s2t_mask(*batch, q=0.3, strategy="random", generator=torch.Generator().manual_seed(6))
    assert torch.equal(a.keep, b.keep) and not torch.equal(a.keep, c.keep)
    assert math.isnan(a.stats["tau_h"])


@pytest.mark.parametrize("q", [0.1, 0.75])
def test_random_silences_a_q_fraction_of_candidates_only(q):
    log_prob, entropy, adv, mask = _random_batch()
    result = s2t_mask(log_prob, entropy, adv, mask, q=q, strategy="random", generator=torch.Generator().manual_seed(0))
    candidate = (adv[:, None] > 0) & (log_prob.exp() < 0.002)
    assert torch.all(result.keep[~candidate] == 1)  # never touches non-candidates
    n = int(candidate.sum())
    silenced = int((result.keep[candidate] == 0).sum())
    assert result.stats["candidates"] == n and result.stats["silenced"] == silenced
    sigma = math.sqrt(q * (1 - q) / n)
    assert abs(silenced / n - q) < 6 * sigma  # binomial frequency, 6 sigma


# ------------------------------------------------------------------------------------------
# host syncs
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_single_process_call_syncs_once_on_a_small_tensor(strategy):
    gen = torch.Generator().manual_seed(2)
    shape = (6, 50)
    args = (
        (torch.randn(*shape, generator=gen) * 3 - 7).clamp(max=0.0),
        torch.rand(*shape, generator=gen),
        torch.randn(shape[0], generator=gen),
        torch.ones(*shape),
    )
    recorder = SyncRecorder()
    with recorder:
        result = s2t_mask(*args, tau_p=0.01, strategy=strategy, generator=torch.Generator().manual_seed(0))
    assert result.stats["candidates"] > 0  # the batch exercises the quantile
    assert len(recorder.calls) == 1, recorder.calls
    assert recorder.calls[0][1] < shape[0] * shape[1]  # only the small stats vector reaches the host
    assert recorder.boolean_indexing == 0


def test_inputs_with_grad_are_detached():
    log_prob = torch.full((2, 3), RARE, requires_grad=True)
    entropy = torch.rand(2, 3, requires_grad=True)
    result = s2t_mask(log_prob, entropy, torch.ones(2), torch.ones(2, 3))
    assert not result.keep.requires_grad and result.stats["candidates"] == 6
