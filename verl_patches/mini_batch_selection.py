"""One PPO mini-batch, one selection: every mask the recipe needs before the update, computed once.

:func:`select_mini_batch` reads the mini-batch's statistics once (the rollout ones, or the current
policy's from :mod:`verl_patches.current_stats`) and computes, into one
:class:`MiniBatchSelection`:

* the run's selection (``scope=mini_batch``): its rule's keep mask, which :func:`apply_selection`
  folds into ``response_mask`` and ``loss_mask`` before verl counts the mini-batch's loss tokens,
  so verl's own ``batch_num_tokens`` (the token-mean denominator, all-reduced over data-parallel
  ranks) counts only the tokens that remain: the loss is exactly the paper's ``sum(M L) / sum(M)``
  over the mini-batch, whatever the micro-batch size or the number of ranks. For the seq-mean
  modes, verl's sequence count becomes the count of sequences that keep a token;
* S2T's token sets (:class:`S2TSets`): the ones the run applies (STAPO), or, with ``s2t_monitor``
  in a run that does not apply S2T, the ones STAPO would have silenced, computed exactly as STAPO
  computes them (same ``tau_p``, ``q``, ``strategy`` and ``stats_from``, pooled over the mini-batch
  and the data-parallel group) and not applied. The update effect and the token dump read them.

``actor/s2t/applied`` says which the S2T metrics describe (1: applied, 0: monitored only).

With statistics from a forward of part of the mini-batch (a rule whose ``positive_advantage_only``
holds, e.g. S2T: the sequences with a positive advantage), the rule runs over those sequences'
tokens and every other token is kept.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch
from verl.utils import tensordict_utils as tu

from stapo_core.rules import S2T, RuleResult, get_rule

from .policy_loss_config import TokenSelectionLossConfig
from .layout import multiply_like, to_padded
from .token_selection import (
    ROLLOUT_ENTROPY_FIELD,
    SUM_PI_SQUARED_FIELD,
    UNSELECTED_MASK_FIELD,
    CurrentStatistics,
    check_statistics_fields,
    grad_norm_metrics,
    rollout_agreement,
    select_tokens,
    widen_selection,
)

#: 1.0 when S2T's selection was applied in the update, 0.0 when it was only monitored
APPLIED_METRIC = S2T.metric_prefix + "applied"


@dataclass(frozen=True)
class S2TSets:
    """S2T's token sets of one rank's mini-batch: bool ``(batch, resp_len)``, padded, on one device.

    mask: the response tokens (before any token was silenced); silenced: the tokens S2T silenced
    (or, monitoring, would silence); candidate: its candidate set (``A > 0``, ``p < tau_p``).
    ``silenced`` lies inside ``candidate``, which lies inside ``mask``. tau_h: S2T's entropy
    threshold of the mini-batch (None when undefined: no candidate, or a strategy without one).
    """

    mask: torch.Tensor
    silenced: torch.Tensor
    candidate: torch.Tensor
    tau_h: Optional[float] = None

    @property
    def kept_candidates(self) -> torch.Tensor:
        """The candidates S2T keeps (their entropy is high: exploration)."""
        return self.candidate & ~self.silenced


@dataclass
class MiniBatchSelection:
    """Everything selected in one rank's mini-batch before its update.

    mask: float32 ``(batch, resp_len)``, the response mask as the mini-batch came. keep: the run's
    keep mask (like ``mask``) to fold into the mini-batch, None when the run selects nothing here.
    s2t: S2T's sets, applied or monitored (None when neither). metrics: every selection metric.
    """

    mask: torch.Tensor
    keep: Optional[torch.Tensor] = None
    s2t: Optional[S2TSets] = None
    metrics: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _Statistics:
    """The mini-batch's padded fields, read once: float32 ``(batch, resp_len)`` on the compute device."""

    mask: torch.Tensor
    advantages: torch.Tensor
    rollout: Optional[tuple[torch.Tensor, torch.Tensor]]  # (old_log_probs, rollout entropy) when present
    sum_pi_squared: Optional[torch.Tensor]


def _read(data, device) -> _Statistics:
    width = to_padded(data["response_mask"]).shape[1]

    def padded(name: str) -> torch.Tensor:
        return to_padded(data[name], width)[:, :width].to(device).float()

    rollout = None
    if "old_log_probs" in data and ROLLOUT_ENTROPY_FIELD in data:
        rollout = (padded("old_log_probs"), padded(ROLLOUT_ENTROPY_FIELD))
    return _Statistics(padded("response_mask"), padded("advantages"), rollout,
                       padded(SUM_PI_SQUARED_FIELD) if SUM_PI_SQUARED_FIELD in data else None)


def _as_current(current, batch: int) -> Optional[CurrentStatistics]:
    """``current`` as :class:`CurrentStatistics` (a ``(log_prob, entropy)`` pair covers every row)."""
    if current is None or isinstance(current, CurrentStatistics):
        return current
    log_prob, entropy = current
    return CurrentStatistics(log_prob, entropy, torch.ones(batch, dtype=torch.bool), {})


def _select(cfg: TokenSelectionLossConfig, stats: _Statistics, current: Optional[CurrentStatistics], group,
            device) -> tuple[RuleResult, dict]:
    """The rule of ``cfg`` on the mini-batch: its selection over every response token, and its metrics
    (the rule's, the drift from the rollout selection, the gradient norms of its sets)."""
    rule = get_rule(cfg.token_selection)
    mask, part = stats.mask, stats.mask
    if current is None:
        log_prob, entropy = stats.rollout
    else:
        width = mask.shape[1]
        log_prob, entropy = (to_padded(t, width)[:, :width].to(device).float() for t in (current.log_prob, current.entropy))
        if not bool(current.forwarded.all()) and not rule.positive_advantage_only:
            raise ValueError(f"token_selection={cfg.token_selection} needs the statistics of every sequence")
        part = mask * current.forwarded.to(mask.device, torch.float32)[:, None]
    selection = select_tokens(cfg, log_prob=log_prob, entropy=entropy, advantages=stats.advantages,
                              response_mask=part, group=group)
    if current is not None and rule.positive_advantage_only:
        # the same counts everywhere, whether this rank forwarded every row or not
        selection = widen_selection(cfg, selection, part, mask, group)
    metrics = dict(selection.stats)
    if current is not None and stats.rollout is not None:
        rollout = select_tokens(cfg, log_prob=stats.rollout[0], entropy=stats.rollout[1], advantages=stats.advantages,
                                response_mask=mask, group=group)
        metrics.update(rollout_agreement(cfg, selection.keep, rollout.keep, mask, group))
    if stats.sum_pi_squared is not None and selection.candidate is not None and current is None:
        metrics.update(grad_norm_metrics(log_prob=log_prob, sum_pi_squared=stats.sum_pi_squared, response_mask=mask,
                                         keep=selection.keep, candidate=selection.candidate, group=group,
                                         prefix=rule.metric_prefix))
    return selection, metrics


def _s2t_sets(mask: torch.Tensor, selection: RuleResult) -> S2TSets:
    inside = mask != 0
    tau_h = selection.stats.get(S2T.metric_prefix + "tau_h")
    return S2TSets(mask=inside, silenced=inside & (selection.keep == 0), candidate=selection.candidate, tau_h=tau_h)


def as_s2t(cfg: TokenSelectionLossConfig) -> TokenSelectionLossConfig:
    """``cfg`` with S2T as its token selection at the mini-batch scope (the monitor's selector)."""
    return dataclasses.replace(cfg, token_selection=S2T.name, scope=None, update_effect_responses=0)


def select_mini_batch(cfg: TokenSelectionLossConfig, data, *, group=None, device=None,
                      current=None) -> MiniBatchSelection:
    """Every selection of one rank's mini-batch ``data`` (not changed), computed once.

    Args:
        cfg: the run's policy-loss settings.
        data: the rank's mini-batch TensorDict (padded or jagged per-token fields), as it came.
        group: the data-parallel group the statistics are pooled over (the mini-batch is the union
            of every rank's part). device: where to compute (the engine's device: collectives over
            verl's data-parallel group may only accept device tensors); the mini-batch stays put.
        current: the current policy's statistics (:class:`CurrentStatistics`, or a ``(log_prob,
            entropy)`` pair covering every row, padded ``(batch, resp_len)``); None: the rollout
            ones (``old_log_probs`` and the ``entropy`` field kept by :mod:`verl_patches.trainers`).
    """
    stats, current = None, _as_current(current, len(data))
    result = None
    if cfg.monitors_s2t:  # the monitor's runs never apply S2T, so their forward covers every sequence
        check_statistics_fields(data, current, "the S2T monitor (s2t_monitor=true)")
        stats = _read(data, device)
        monitor_current = current if cfg.stats_from == "current" else None
        selection, metrics = _select(as_s2t(cfg), stats, monitor_current, group, device)
        if monitor_current is not None and not cfg.forwards_current_policy:
            metrics.update(monitor_current.metrics)  # the forward served the monitor alone
        metrics[APPLIED_METRIC] = 0.0
        result = MiniBatchSelection(stats.mask, s2t=_s2t_sets(stats.mask, selection), metrics=metrics)
    if cfg.folds_into_mini_batch:
        check_statistics_fields(data, current, "token selection (scope=mini_batch)")
        stats = stats or _read(data, device)
        selection, metrics = _select(cfg, stats, current, group, device)
        if current is not None:
            metrics.update(current.metrics)
        result = result or MiniBatchSelection(stats.mask)
        result.keep = selection.keep
        result.metrics.update(metrics)
        if cfg.applies_s2t:
            result.metrics[APPLIED_METRIC] = 1.0
            result.s2t = _s2t_sets(stats.mask, selection)
    return result if result is not None else MiniBatchSelection(to_padded(data["response_mask"]).float())


def apply_selection(cfg: TokenSelectionLossConfig, data, selection: MiniBatchSelection, group=None) -> None:
    """Fold ``selection.keep`` into the mini-batch ``data`` in place: multiply ``response_mask`` and
    ``loss_mask`` by it, set verl's ``global_batch_size`` to the sequences that keep a token
    (seq-mean modes), and keep the unselected mask for ``sequence_ratio=all_tokens``."""
    if selection.keep is None:
        return
    response_mask = data["response_mask"]
    if cfg.sequence_ratio_over_all_tokens:
        data[UNSELECTED_MASK_FIELD] = response_mask.clone()
    keep = selection.keep.to(response_mask.device)
    data["response_mask"] = multiply_like(response_mask, keep)
    if "loss_mask" in data:
        data["loss_mask"] = multiply_like(data["loss_mask"], keep)
    _count_remaining_sequences(data, selection.mask * selection.keep, group)


def fold_into_mini_batch(cfg: TokenSelectionLossConfig, data, group=None, device=None, current=None) -> dict[str, float]:
    """:func:`select_mini_batch` then :func:`apply_selection`; returns the metrics."""
    selection = select_mini_batch(cfg, data, group=group, device=device, current=current)
    apply_selection(cfg, data, selection, group)
    return selection.metrics


def _count_remaining_sequences(data, kept: torch.Tensor, group) -> None:
    """Set verl's ``global_batch_size`` (the seq-mean denominator) to the number of sequences of the
    mini-batch, over every rank, that keep at least one token."""
    if tu.get(data, "global_batch_size", None) is None:
        return
    count = (kept.sum(-1) > 0).sum().double()
    if group is not None:
        torch.distributed.all_reduce(count, group=group)
    tu.assign_non_tensor(data, global_batch_size=max(int(count.item()), 1))
