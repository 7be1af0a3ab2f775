"""The one wrapper of verl's ``ppo_loss``: guards for silenced mini-batches, and the micro-batch scope.

verl's ``ppo_loss`` (``verl/workers/utils/losses.py``) hands the policy loss only ``old_log_prob``,
``log_prob``, ``advantages``, ``response_mask`` and the actor config. :func:`wrap_ppo_loss` wraps it
(same signature; installed in place of the name verl's actor binds by :mod:`verl_patches.install`;
:func:`ppo_loss_with_token_selection` is the wrap of verl's own function, for direct use):

* ``scope=mini_batch`` (the default): the keep mask was already folded into ``response_mask`` and
  into verl's token and sequence counts by :func:`verl_patches.token_selection.fold_into_mini_batch`,
  so verl's loss runs unchanged. The only guard: a mini-batch whose every token was silenced has
  ``batch_num_tokens == 0``, and the count is raised to 1 so that the all-zero masked sums give 0.
* ``scope=micro_batch``: the keep mask is computed here, per micro-batch, pooled over the
  data-parallel group's current micro-batches, from the current log-probs and entropy of
  ``model_output`` (``stats_from=current``) or the rollout ones in the batch. It is multiplied into
  the micro-batch's ``response_mask``, then verl's own loss runs, whatever its ``loss_mode``. verl
  normalises by the mini-batch's token (or sequence) count taken before the selection, so the loss
  is re-weighted by ``tokens / kept`` (``sequences / kept sequences`` for seq-mean modes) of this
  micro-batch: each micro-batch contributes the mean over its remaining tokens (sequences) times its
  share of the mini-batch. With one micro-batch per mini-batch this is exactly the mini-batch mean.

Every loss mode without token selection runs bit-identically through the wrapper (tested).
"""

from __future__ import annotations

import functools

import torch

from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils import losses as verl_losses
from verl.workers.utils.padding import no_padding_2_padding

from .config import TokenSelectionLossConfig
from .token_selection import (
    ROLLOUT_ENTROPY_FIELD,
    SEQ_MEAN_MODES,
    multiply_like,
    rollout_agreement,
    select_tokens,
    to_padded,
)


def wrap_ppo_loss(ppo_loss):
    """verl's ``ppo_loss`` with the recipe's token selection (see the module docstring)."""

    @functools.wraps(ppo_loss)
    def ppo_loss_with_token_selection(config, model_output, data, dp_group=None):
        for key in ("batch_num_tokens", "global_batch_size"):
            if tu.get_non_tensor_data(data=data, key=key, default=None) == 0:
                tu.assign_non_tensor(data, **{key: 1})
        cfg = getattr(config, "policy_loss", None)
        if not (isinstance(cfg, TokenSelectionLossConfig) and cfg.selects_in_loss):
            return ppo_loss(config, model_output, data, dp_group=dp_group)
        scale, metrics = _select_in_micro_batch(cfg, config.loss_agg_mode, model_output, data, dp_group)
        loss, verl_metrics = ppo_loss(config, model_output, data, dp_group=dp_group)
        verl_metrics.update(Metric.from_dict(metrics, aggregation=AggregationType.MEAN))
        return loss * scale, verl_metrics

    return ppo_loss_with_token_selection


#: the wrap of verl's own ``ppo_loss`` (what the patched actor calls)
ppo_loss_with_token_selection = wrap_ppo_loss(verl_losses.ppo_loss)


def _select_in_micro_batch(cfg: TokenSelectionLossConfig, loss_agg_mode: str, model_output, data, group):
    """Fold this micro-batch's keep mask into ``data["response_mask"]``; return the loss re-weighting
    and the selection's metrics."""
    response_mask = data["response_mask"]
    width = to_padded(response_mask).shape[1]
    mask = to_padded(response_mask, width)[:, :width].float()
    advantages = to_padded(data["advantages"], width)[:, :width].float()
    rollout_entropy = to_padded(data[ROLLOUT_ENTROPY_FIELD], width)[:, :width].float() if ROLLOUT_ENTROPY_FIELD in data.keys() else None
    old_log_prob = to_padded(data["old_log_probs"], width)[:, :width].float()
    if cfg.stats_from == "current":
        entropy = model_output.get("entropy", None)
        if entropy is None:
            raise RuntimeError(
                "stats_from=current with scope=micro_batch needs the update's entropy: set "
                "actor_rollout_ref.actor.calculate_entropy=true (the recipe's driver does)"
            )
        log_prob = no_padding_2_padding(model_output["log_probs"], data).detach().float()[:, :width]
        entropy = no_padding_2_padding(entropy, data).detach().float()[:, :width]
    else:
        if rollout_entropy is None:
            raise RuntimeError(f"stats_from=rollout needs the rollout entropy field {ROLLOUT_ENTROPY_FIELD!r} in the batch")
        log_prob, entropy = old_log_prob, rollout_entropy
    selection = select_tokens(cfg, log_prob=log_prob, entropy=entropy, advantages=advantages,
                              response_mask=mask, group=group)
    metrics = dict(selection.metrics)
    if cfg.stats_from == "current" and rollout_entropy is not None:
        rollout = select_tokens(cfg, log_prob=old_log_prob, entropy=rollout_entropy, advantages=advantages,
                                response_mask=mask, group=group)
        metrics.update(rollout_agreement(cfg, selection.keep, rollout.keep, mask, group))
    data["response_mask"] = multiply_like(response_mask, selection.keep.to(mask.device))
    if loss_agg_mode in SEQ_MEAN_MODES:
        counts = torch.stack([(mask.sum(-1) > 0).sum(), ((mask * selection.keep).sum(-1) > 0).sum()]).double()
        if group is not None:
            torch.distributed.all_reduce(counts, group=group)
        total, kept = counts.tolist()
    elif loss_agg_mode == "token-mean":
        total, kept = selection.tokens, selection.kept
    else:  # token-sum: no denominator to correct
        total, kept = 1.0, 1.0
    return total / max(kept, 1.0), metrics
