"""Bad arguments raise ValueError naming the argument (or the tensors) at fault."""

import math

import pytest
import torch

from tests.helpers.reference_loss import aggregate_loss, clipped_policy_loss
from stapo_core import (
    entropy_from_logits,
    grad_norm_bounds,
    logit_grad_norm,
    s2t_mask,
    entropy_topk_mask,
)

BAD_FRACTIONS = [0, 1, -0.1, 1.5, 0.0, 1.0, math.nan, math.inf, True, "0.5", None]


def _s2t_args(batch=2, width=4):
    return torch.zeros(batch, width), torch.ones(batch, width), torch.ones(batch), torch.ones(batch, width)


def _loss_args():
    return torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), torch.ones(2, 3)


@pytest.mark.parametrize("value", BAD_FRACTIONS)
def test_tau_p_outside_unit_interval(value):
    with pytest.raises(ValueError, match="tau_p"):
        s2t_mask(*_s2t_args(), tau_p=value)


@pytest.mark.parametrize("value", BAD_FRACTIONS)
def test_q_outside_unit_interval(value):
    with pytest.raises(ValueError, match=r"\bq="):
        s2t_mask(*_s2t_args(), q=value)


def test_unknown_strategy_lists_the_valid_ones():
    with pytest.raises(ValueError, match="strategy") as err:
        s2t_mask(*_s2t_args(), strategy="lowest_entropy")
    for name in ("low_entropy", "high_entropy", "random", "full"):
        assert name in str(err.value)


@pytest.mark.parametrize("field,index", [("log_prob", 0), ("entropy", 1), ("response_mask", 3)])
def test_s2t_shape_mismatch_names_the_tensors(field, index):
    args = list(_s2t_args())
    args[index] = torch.zeros(2, 5) if field != "response_mask" else torch.ones(3, 4)
    with pytest.raises(ValueError, match="shape mismatch") as err:
        s2t_mask(*args)
    assert field in str(err.value) or "response_mask" in str(err.value)


def test_s2t_bad_advantages_shape():
    args = list(_s2t_args())
    args[2] = torch.ones(3)
    with pytest.raises(ValueError, match="advantages"):
        s2t_mask(*args)


def test_s2t_response_mask_must_be_2d():
    with pytest.raises(ValueError, match="response_mask"):
        s2t_mask(torch.zeros(4), torch.zeros(4), torch.ones(4), torch.ones(4))


@pytest.mark.parametrize("ratio", [0, -0.2, 1.5, math.nan, None])
def test_top_entropy_ratio(ratio):
    with pytest.raises(ValueError, match="ratio"):
        entropy_topk_mask(torch.rand(2, 3), torch.ones(2, 3), ratio=ratio)


def test_top_entropy_shape_mismatch():
    with pytest.raises(ValueError, match="entropy.*response_mask"):
        entropy_topk_mask(torch.rand(2, 3), torch.ones(2, 4))


@pytest.mark.parametrize("agg", ["token-sum", "mean", "", None])
def test_unknown_agg(agg):
    with pytest.raises(ValueError, match="agg"):
        clipped_policy_loss(*_loss_args(), agg=agg)
    with pytest.raises(ValueError, match="agg"):
        aggregate_loss(torch.zeros(2, 3), torch.ones(2, 3), agg)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_low": math.nan}, "clip_low"),
        ({"clip_high": -0.01}, "clip_high"),
        ({"clip_high": math.inf}, "clip_high"),
        ({"clip_c": 1.0}, "clip_c"),
        ({"clip_c": 0.5}, "clip_c"),
        ({"clip_c": math.nan}, "clip_c"),
    ],
)
def test_clip_values_out_of_range(kwargs, name):
    with pytest.raises(ValueError, match=name):
        clipped_policy_loss(*_loss_args(), **kwargs)


def test_loss_shape_mismatch_names_the_tensor():
    new, old, adv, mask = _loss_args()
    with pytest.raises(ValueError, match="old_log_prob"):
        clipped_policy_loss(new, torch.zeros(2, 4), adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        clipped_policy_loss(new, old, torch.ones(3), mask)


@pytest.mark.parametrize("chunk_size", [0, -1, 1.5, True])
def test_chunk_size(chunk_size):
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(torch.zeros(2, 3), chunk_size=chunk_size)
    with pytest.raises(ValueError, match="chunk_size"):
        logit_grad_norm(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), chunk_size=chunk_size)


def test_logit_grad_norm_target():
    with pytest.raises(ValueError, match="target"):
        logit_grad_norm(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="target"):
        logit_grad_norm(torch.zeros(2, 3), torch.zeros(2))
    with pytest.raises(ValueError, match=r"outside \[0, 3\)"):
        logit_grad_norm(torch.zeros(2, 3), torch.tensor([0, 3]))


def test_integer_logits():
    with pytest.raises(ValueError, match="logits"):
        entropy_from_logits(torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("vocab_size", [1, 0, 2.0, True])
def test_vocab_size(vocab_size):
    with pytest.raises(ValueError, match="vocab_size"):
        grad_norm_bounds(torch.zeros(2), torch.zeros(2), vocab_size)


# ------------------------------------------------------------------------------------------------
# impossible statistics: a log-probability above 0, an entropy below 0 (beyond float rounding)
# ------------------------------------------------------------------------------------------------


def _batch(gen_seed=0, batch=4, width=12):
    gen = torch.Generator().manual_seed(gen_seed)
    log_prob = -(torch.rand(batch, width, generator=gen) * 9)  # log p in (-9, 0]
    entropy = torch.rand(batch, width, generator=gen) * 3
    return log_prob, entropy, torch.ones(batch), torch.ones(batch, width)


def test_probabilities_given_for_log_probabilities_are_refused_as_such():
    """exp(p) >= 1 > tau_p: S2T found no candidate and silenced nothing, without a word."""
    from stapo_core import s2t_candidates

    log_prob, entropy, adv, mask = _batch()
    probs = log_prob.exp()
    above = int((probs > 1e-3).sum())
    with pytest.raises(ValueError, match=rf"s2t_mask: log_prob has {above} value\(s\) above 0.001 inside response_mask: every "
                                         r"value lies in \[0, 1\] and none is negative: these are probabilities"):
        s2t_mask(probs, entropy, adv, mask)
    with pytest.raises(ValueError, match=r"s2t_candidates: .*these are probabilities p, not log p"):
        s2t_candidates(probs, adv, mask)
    with pytest.raises(ValueError, match="these are probabilities"):  # bfloat16 probabilities too
        s2t_mask(probs.bfloat16(), entropy, adv, mask)


def test_a_positive_log_probability_among_negative_ones_is_refused():
    log_prob, entropy, adv, mask = _batch()
    log_prob[1, 3] = 0.5
    with pytest.raises(ValueError, match=r"log_prob has 1 value\(s\) above 0.001 .*a log-probability is <= 0"):
        s2t_mask(log_prob, entropy, adv, mask)
    log_prob[1, 3] = 3.0  # above 1: not a probability either
    with pytest.raises(ValueError, match="a log-probability is <= 0"):
        s2t_mask(log_prob, entropy, adv, mask)


@pytest.mark.parametrize("func", ["s2t_mask", "entropy_topk_mask"])
def test_a_negative_entropy_is_refused_beyond_float_rounding(func):
    log_prob, entropy, adv, mask = _batch()

    def call(ent):
        return s2t_mask(log_prob, ent, adv, mask) if func == "s2t_mask" else entropy_topk_mask(ent, mask)

    reference = call(entropy)
    rounding = entropy.clone()
    rounding[0, 0], rounding[2, 5] = -1e-7, -4e-4  # what float32 arithmetic leaves of a zero entropy
    call(rounding)
    impossible = entropy.clone()
    impossible[0, 0], impossible[3, 1] = -2.0, -0.01
    with pytest.raises(ValueError, match=rf"{func}: entropy has 2 value\(s\) below -0.001 inside response_mask: an "
                                         r"entropy H = -sum_v p_v log p_v is >= 0"):
        call(impossible)
    assert reference is not None


def test_the_tolerance_follows_the_inputs_precision():
    """bfloat16 keeps 8 bits: an entropy of -0.1 in it is rounding (tolerance 0.125), in float32 it is not."""
    from stapo_core.checks import rounding_tolerance

    assert rounding_tolerance(torch.float32) == 1e-3 and rounding_tolerance(torch.float64) == 1e-3
    assert rounding_tolerance(torch.bfloat16) == 0.125 and rounding_tolerance(torch.float16) == pytest.approx(0.015625)
    log_prob, entropy, adv, mask = _batch()
    entropy[0, 0] = -0.1
    s2t_mask(log_prob, entropy.bfloat16(), adv, mask)
    entropy_topk_mask(entropy.bfloat16(), mask)
    with pytest.raises(ValueError, match="below -0.001"):
        s2t_mask(log_prob, entropy, adv, mask)
    lp = log_prob.clone()
    lp[0, 0] = 1e-7  # float rounding of log p = 0
    s2t_mask(lp, entropy.abs(), adv, mask)


def test_impossible_values_outside_the_response_mask_are_padding():
    log_prob, entropy, adv, mask = _batch()
    log_prob[0, -1], entropy[0, -1], mask[0, -1] = 5.0, -5.0, 0.0
    s2t_mask(log_prob, entropy, adv, mask)
    entropy_topk_mask(entropy, mask)
