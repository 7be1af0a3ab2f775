"""The recipe's policy losses, registered with verl, and the one wrapper of verl's ``ppo_loss``.

verl's ``ppo_loss`` (``verl/workers/utils/losses.py``) hands a policy loss only ``old_log_prob``,
``log_prob``, ``advantages``, ``response_mask`` and the actor config: the current entropy, the
rollout entropy and the data-parallel group never reach it. :func:`ppo_loss_with_token_fields`
wraps it (same signature, installed in place of verl's by :mod:`verl_patches.install`) and exposes
those three to the policy loss for the duration of the call through :func:`current_token_fields`.
Every built-in loss mode runs unchanged through the wrapper.

Registered losses (``actor_rollout_ref.actor.policy_loss.loss_mode``):

* ``stapo``: the clipped surrogate of JustRL/DAPO with S2T (paper eq. for J with mask M).
* ``entropy_topk``: 20-Entropy: only the top ``entropy_top_ratio`` highest-entropy tokens.

With ``scope=mini_batch`` the mask was already folded into ``response_mask`` (and into verl's
token count) by :func:`verl_patches.token_selection.fold_into_mini_batch`; the loss is then the
plain clipped surrogate over that mask. With ``scope=micro_batch`` the mask is computed here, pooled
over the data-parallel group's current micro-batch, and the token-mean is taken over the remaining
tokens of that micro-batch, weighted by the micro-batch's share of the mini-batch's tokens (see
README, "Where the S2T statistic lives").
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch

from stapo_core import clipped_surrogate
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss
from verl.utils import tensordict_utils as tu
from verl.workers.utils import losses as verl_losses
from verl.workers.utils.padding import no_padding_2_padding

from .config import S2TPolicyLossConfig
from .token_selection import ROLLOUT_ENTROPY_FIELD, select_tokens, to_padded

#: verl's own ppo_loss, captured once at import (before anything replaces the module attribute)
verl_ppo_loss = verl_losses.ppo_loss


@dataclass(frozen=True)
class TokenFields:
    """What the policy loss can see beyond verl's arguments, for one micro-batch.

    entropy: current-policy entropy ``(batch, resp_len)`` (with grad), or None when the actor does
        not compute it (``actor.calculate_entropy=False`` and ``entropy_coeff=0``).
    rollout_entropy: rollout-time entropy ``(batch, resp_len)``, or None when absent.
    dp_group: the data-parallel process group (None on a single process).
    """

    entropy: Optional[torch.Tensor]
    rollout_entropy: Optional[torch.Tensor]
    dp_group: Any


_token_fields: contextvars.ContextVar[Optional[TokenFields]] = contextvars.ContextVar("stapo_token_fields", default=None)


@contextmanager
def token_fields(fields: TokenFields):
    token = _token_fields.set(fields)
    try:
        yield
    finally:
        _token_fields.reset(token)


def current_token_fields() -> Optional[TokenFields]:
    """The :class:`TokenFields` of the micro-batch whose loss is being computed, or None."""
    return _token_fields.get()


def ppo_loss_with_token_fields(config, model_output, data, dp_group=None):
    """verl's ``ppo_loss`` with entropy, rollout entropy and dp group visible to the policy loss.

    One guard: a mini-batch whose every token was silenced has ``batch_num_tokens == 0`` and verl's
    token-mean would be 0/0; the count is raised to 1, so the (all-zero) masked sums give loss 0.
    """
    if tu.get_non_tensor_data(data=data, key="batch_num_tokens", default=None) == 0:
        tu.assign_non_tensor(data, batch_num_tokens=1)
    entropy = model_output.get("entropy", None)
    if entropy is not None:
        entropy = no_padding_2_padding(entropy, data)
    rollout_entropy = None
    if ROLLOUT_ENTROPY_FIELD in data.keys():
        width = to_padded(data["response_mask"]).shape[1]
        rollout_entropy = to_padded(data[ROLLOUT_ENTROPY_FIELD], width)
    with token_fields(TokenFields(entropy=entropy, rollout_entropy=rollout_entropy, dp_group=dp_group)):
        return verl_ppo_loss(config, model_output, data, dp_group=dp_group)


# --------------------------------------------------------------------------------------------
# registered policy losses
# --------------------------------------------------------------------------------------------


def _s2t_config(config) -> S2TPolicyLossConfig:
    cfg = config.policy_loss
    if not isinstance(cfg, S2TPolicyLossConfig):
        raise TypeError(
            f"policy loss {cfg.get('loss_mode')!r} needs actor_rollout_ref.actor.policy_loss._target_="
            "verl_patches.config.S2TPolicyLossConfig (the recipe's method=stapo|entropy20 configs set it)"
        )
    return cfg


def _statistics(cfg: S2TPolicyLossConfig, log_prob, old_log_prob):
    """``(log_prob, entropy, dp_group)`` the mask is computed from, for ``scope=micro_batch``."""
    fields = current_token_fields()
    if fields is None:
        raise RuntimeError(
            "scope=micro_batch needs verl_patches' ppo_loss wrapper: is VERL_USE_EXTERNAL_MODULES=verl_patches set?"
        )
    if cfg.stats_from == "current":
        if fields.entropy is None:
            raise RuntimeError(
                "stats_from=current needs the current entropy: set actor_rollout_ref.actor.calculate_entropy=True"
            )
        return log_prob, fields.entropy, fields.dp_group
    if fields.rollout_entropy is None:
        raise RuntimeError(f"stats_from=rollout needs the rollout entropy field {ROLLOUT_ENTROPY_FIELD!r} in the batch")
    return old_log_prob, fields.rollout_entropy, fields.dp_group


def _rollout_agreement(cfg, selection, old_log_prob, advantages, response_mask, group) -> dict[str, float]:
    """How far current-policy statistics drift from rollout ones on this micro-batch (diagnostic).

    ``s2t/rollout_agreement``: |A & B| / |A | B| of the tokens dropped by the current-statistics mask
    (A) and by the rollout-statistics mask (B) (1.0 when both drop nothing); identical on the first
    mini-batch of a step, where the policy is the rollout policy. Logged only when the rollout
    entropy is in the batch.
    """
    fields = current_token_fields()
    if fields is None or fields.rollout_entropy is None:
        return {}
    rollout = select_tokens(
        cfg,
        log_prob=old_log_prob.detach().float(),
        entropy=fields.rollout_entropy.float(),
        advantages=advantages.float(),
        response_mask=response_mask,
        group=group,
    )
    dropped_now, dropped_rollout = response_mask * (1 - selection.keep), response_mask * (1 - rollout.keep)
    counts = torch.stack([(dropped_now * dropped_rollout).sum(), torch.maximum(dropped_now, dropped_rollout).sum()])
    if group is not None:
        torch.distributed.all_reduce(counts, group=group)
    both, either = counts.tolist()
    return {"s2t/rollout_agreement": 1.0 if either == 0 else both / either}


def _selective_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights):
    """Shared body of ``stapo`` and ``entropy_topk`` (they differ only in the token selection)."""
    cfg = _s2t_config(config)
    clip_low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    clip_high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    loss_mat, pg_metrics = clipped_surrogate(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        clip_low=clip_low,
        clip_high=clip_high,
        clip_c=config.get("clip_ratio_c", 3.0),
    )
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights
    metrics = {f"actor/{k}": v.item() for k, v in pg_metrics.items()}
    loss_mask = response_mask.float()
    scale = 1.0
    if cfg.resolved_scope == "micro_batch":
        stats_log_prob, entropy, group = _statistics(cfg, log_prob, old_log_prob)
        selection = select_tokens(
            cfg,
            log_prob=stats_log_prob.detach().float(),
            entropy=entropy.detach().float(),
            advantages=advantages.float(),
            response_mask=loss_mask,
            group=group,
        )
        metrics.update(selection.metrics)
        if cfg.stats_from == "current":
            metrics.update(_rollout_agreement(cfg, selection, old_log_prob, advantages, loss_mask, group))
        loss_mask = loss_mask * selection.keep
        if loss_agg_mode == "token-mean":
            # verl divides by all loss tokens of the mini-batch; re-weight this micro-batch so that
            # it contributes the mean over its remaining tokens, times its share of the tokens.
            scale = selection.tokens / max(selection.kept, 1.0)
    loss = agg_loss(loss_mat=loss_mat, loss_mask=loss_mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info)
    return loss * scale, metrics


@register_policy_loss("stapo")
def compute_policy_loss_stapo(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """STAPO: clipped surrogate (clip [1-clip_ratio_low, 1+clip_ratio_high], dual clip) over S2T's
    remaining tokens, ``J = sum(M L) / sum(M)`` with ``M`` from :func:`stapo_core.s2t_mask`."""
    return _selective_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)


@register_policy_loss("entropy_topk")
def compute_policy_loss_entropy_topk(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """20-Entropy (Wang et al. 2025): the clipped surrogate over the top ``entropy_top_ratio``
    highest-entropy response tokens (:func:`stapo_core.top_entropy_mask`), mean over those tokens."""
    return _selective_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
