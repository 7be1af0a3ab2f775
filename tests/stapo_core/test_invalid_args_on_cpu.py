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
