"""A reference clipped policy-gradient surrogate (PPO / DAPO / JustRL) and its aggregation, written
from the paper's equations independently of verl: the tests check verl's loss under the recipe's
token selection against it.

Per token (docs/method.md, "Objective"), with r = pi_theta / pi_old = exp(log_prob - old_log_prob):

    L_{i,t} = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)            (loss = negated objective)

and, with the dual clip (Ye et al. 2020, as verl's ``vanilla`` loss) for A < 0:

    L_{i,t} = min(max(-r A, -clip(r) A), -clip_c A).

The log-ratio is clamped to [-20, 20] before ``exp``, as verl does. Aggregations:

* ``token-mean``: sum(L M) / sum(M). STAPO's mean over the remaining tokens is
  ``loss_mask = response_mask * keep`` (keep from :func:`stapo_core.s2t_mask`).
* ``seq-mean-token-mean``: mean over sequences with sum_t M > 0 of sum_t(L M) / sum_t M.
* ``seq-mean-token-sum``: mean over sequences with sum_t M > 0 of sum_t(L M).

An empty mask gives a loss of exactly 0.0 that still depends on ``log_prob`` (zero gradient).
Masked-out positions never contribute, even when they hold non-finite values in the forward pass.
"""

from __future__ import annotations

from typing import Optional

import torch

from stapo_core.checks import check_token_tensors, is_number, token_advantages

#: aggregation modes of :func:`aggregate_loss`
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

#: bound of |log_prob - old_log_prob| before exp, as verl
LOG_RATIO_CLAMP = 20.0


def _check_clip(clip_low, clip_high, clip_c) -> None:
    if not is_number(clip_low) or not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low={clip_low!r} is invalid: expected a number in [0, 1) (so that 1 - clip_low > 0)")
    if not is_number(clip_high) or clip_high < 0.0:
        raise ValueError(f"clip_high={clip_high!r} is invalid: expected a finite number >= 0")
    if clip_c is not None and (not is_number(clip_c) or clip_c <= 1.0):
        raise ValueError(f"clip_c={clip_c!r} is invalid: expected None (no dual clip) or a finite number > 1")


def _check_agg(agg) -> None:
    if agg not in AGG_MODES:
        raise ValueError(f"agg={agg!r} is invalid: expected one of {list(AGG_MODES)}")


def _masked_sum(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """sum(values * mask) over ``dim`` (all dims if None); positions with mask == 0 contribute 0
    even when ``values`` is non-finite there."""
    weighted = torch.where(mask != 0, values * mask, torch.zeros_like(values))
    return weighted.sum() if dim is None else weighted.sum(dim)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(values * mask) / max(sum(mask), 1): 0-dim, 0.0 for an empty mask (never NaN)."""
    return _masked_sum(values, mask) / mask.sum().clamp(min=1.0)


def clipped_surrogate(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: Optional[float] = None,
) -> tuple[torch.Tensor, dict]:
    """Per-token clipped surrogate loss and its clipping metrics (no aggregation).

    Args:
        log_prob: ``(batch, resp_len)`` current log pi_theta (carries the gradient).
        old_log_prob: ``(batch, resp_len)`` log pi_old.
        advantages: ``(batch, resp_len)`` or ``(batch,)``.
        loss_mask: ``(batch, resp_len)`` weights (0/1) of the tokens in the metrics.
        clip_low, clip_high: eps_low in [0, 1), eps_high >= 0: ratio clipped to [1-eps_low, 1+eps_high].
        clip_c: dual-clip constant > 1 for A < 0, or None.

    Returns:
        ``(loss_mat, metrics)``: ``loss_mat`` float32 ``(batch, resp_len)`` (L_{i,t}, negated
        objective); ``metrics`` 0-dim detached float32 tensors over ``loss_mask``:
        ``pg_clipfrac`` (fraction where the clip of the ratio is active), ``pg_clipfrac_lower``
        (fraction where the dual clip is active), ``ppo_kl`` (mean of old_log_prob - log_prob,
        after the clamp).
    """
    _check_clip(clip_low, clip_high, clip_c)
    check_token_tensors("clipped_surrogate", loss_mask, "loss_mask", log_prob=log_prob, old_log_prob=old_log_prob)
    adv = token_advantages("clipped_surrogate", advantages, loss_mask, "loss_mask").float()
    mask = loss_mask.float()
    log_ratio = torch.clamp(log_prob.float() - old_log_prob.float(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # r

    unclipped = -adv * ratio  # -r A
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # -clip(r) A
    loss = torch.maximum(unclipped, clipped)  # -min(r A, clip(r) A)
    clip_active = clipped > unclipped
    dual_active = torch.zeros_like(clip_active)
    if clip_c is not None:
        dual_bound = -adv * clip_c  # -clip_c A
        dual_active = (adv < 0) & (loss > dual_bound)
        loss = torch.where(adv < 0, torch.minimum(loss, dual_bound), loss)

    metrics = {
        "pg_clipfrac": _masked_mean(clip_active.float(), mask).detach(),
        "pg_clipfrac_lower": _masked_mean(dual_active.float(), mask).detach(),
        "ppo_kl": _masked_mean(-log_ratio, mask).detach(),
    }
    return loss, metrics


def aggregate_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, agg: str = "token-mean") -> torch.Tensor:
    """Aggregate a ``(batch, resp_len)`` loss matrix over ``loss_mask`` (see module docstring).

    Args:
        loss_mat: ``(batch, resp_len)`` float.
        loss_mask: ``(batch, resp_len)`` weights (0/1).
        agg: one of :data:`AGG_MODES`.

    Returns:
        0-dim float32 loss; 0.0 (finite, still attached to ``loss_mat``) when the mask is empty.
    """
    _check_agg(agg)
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(
            f"aggregate_loss: shape mismatch: loss_mat {tuple(loss_mat.shape)} vs loss_mask {tuple(loss_mask.shape)}"
        )
    mask = loss_mask.float()
    if agg == "token-mean":
        return _masked_mean(loss_mat, mask)
    tokens = mask.sum(-1)  # (batch,)
    seq_sum = _masked_sum(loss_mat, mask, dim=-1)  # (batch,)
    seq_loss = seq_sum / tokens.clamp(min=1.0) if agg == "seq-mean-token-mean" else seq_sum
    return _masked_mean(seq_loss, (tokens > 0).float())  # sequences with no token excluded


def clipped_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: Optional[float] = None,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate aggregated over ``loss_mask``: :func:`clipped_surrogate` + :func:`aggregate_loss`.

    STAPO's objective J = sum(M L) / sum(M) is ``agg="token-mean"`` with
    ``loss_mask = response_mask * keep``.

    Returns:
        ``(loss, metrics)``: 0-dim float32 loss to minimise, metrics as in :func:`clipped_surrogate`.
    """
    _check_agg(agg)
    loss_mat, metrics = clipped_surrogate(
        log_prob, old_log_prob, advantages, loss_mask, clip_low=clip_low, clip_high=clip_high, clip_c=clip_c
    )
    return aggregate_loss(loss_mat, loss_mask, agg), metrics


__all__ = ["AGG_MODES", "aggregate_loss", "clipped_policy_loss", "clipped_surrogate"]
