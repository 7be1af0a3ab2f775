"""S2T's token sets of a mini-batch, applied (STAPO) or only monitored (any other run).

* :func:`monitor_mini_batch` (``s2t_monitor=true`` in a run whose ``token_selection`` is not
  ``s2t``): S2T's selection of the mini-batch, computed exactly as STAPO computes it (same
  ``tau_p``, ``q``, ``strategy`` and ``stats_from``, the quantile pooled over the mini-batch and the
  data-parallel group) but not applied: the mask the update uses is untouched. Its metrics are
  STAPO's (``s2t/candidates``, ``s2t/silenced``, ``s2t/tau_h``, ``s2t/grad_norm_*``, ...): what
  STAPO would have silenced in this run.
* :func:`applied_sets`: the same sets in a STAPO run, read from the fold that applied them.

Both return :class:`S2TSets`, what the update-effect measurement (:mod:`verl_patches.update_effect`)
needs, and the metric ``s2t/applied`` says which it was (1: S2T silenced the tokens in the update,
0: monitored only).

Cost of the monitor: the selection itself (the mask, one small all-gather of the candidates'
entropies, one host read) on the statistics the mini-batch already carries with
``stats_from=rollout`` (no forward); with ``stats_from=current``, one no-grad forward of each
mini-batch after the first through verl's inference pass, as STAPO's Algorithm 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from stapo_core import s2t_candidates

from .config import TokenSelectionLossConfig
from .token_selection import (
    ROLLOUT_ENTROPY_FIELD,
    S2T_METRIC_PREFIX,
    SUM_PI_SQUARED_FIELD,
    check_statistics_fields,
    grad_norm_metrics,
    rollout_agreement,
    select_tokens,
    to_padded,
)

#: 1.0 when S2T's selection was applied in the update, 0.0 when it was only monitored
APPLIED_METRIC = S2T_METRIC_PREFIX + "applied"


@dataclass(frozen=True)
class S2TSets:
    """S2T's token sets of one rank's mini-batch: bool ``(batch, resp_len)``, padded, on one device.

    mask: the response tokens (before any token was silenced); silenced: the tokens S2T silenced
    (or, monitoring, would silence); candidate: its candidate set (``A > 0``, ``p < tau_p``).
    ``silenced`` lies inside ``candidate``, which lies inside ``mask``.
    """

    mask: torch.Tensor
    silenced: torch.Tensor
    candidate: torch.Tensor

    @property
    def kept_candidates(self) -> torch.Tensor:
        """The candidates S2T keeps (their entropy is high: exploration)."""
        return self.candidate & ~self.silenced


def _as_s2t(cfg: TokenSelectionLossConfig) -> TokenSelectionLossConfig:
    """``cfg`` with S2T as its token selection at the mini-batch scope (the monitor's selector)."""
    return dataclasses.replace(cfg, token_selection="s2t", scope=None, update_effect_responses=0)


def monitor_mini_batch(cfg: TokenSelectionLossConfig, data, *, group=None, device=None,
                       current: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> tuple[dict, S2TSets]:
    """S2T's selection of one mini-batch, computed and not applied (``data`` is not changed).

    Args:
        cfg: the run's policy-loss settings (``monitors_s2t``).
        data: the rank's mini-batch TensorDict (padded or jagged per-token fields).
        group: the data-parallel group the quantile is pooled over. device: where to compute.
        current: ``(log_prob, entropy)`` of the policy being updated (padded), used instead of the
            rollout statistics when given (``stats_from=current``, mini-batches after the first).

    Returns:
        ``(metrics, sets)``: STAPO's ``s2t/*`` metrics (plus ``s2t/applied = 0``) and the sets.
    """
    check_statistics_fields(data, current, "the S2T monitor (s2t_monitor=true)")
    width = to_padded(data["response_mask"]).shape[1]

    def field(name: str) -> torch.Tensor:
        return to_padded(data[name], width)[:, :width].to(device).float()

    mask, advantages = field("response_mask"), field("advantages")
    if current is None:
        log_prob, entropy = field("old_log_probs"), field(ROLLOUT_ENTROPY_FIELD)
    else:
        log_prob, entropy = (to_padded(t, width)[:, :width].to(device).float() for t in current)
    s2t = _as_s2t(cfg)
    selection = select_tokens(s2t, log_prob=log_prob, entropy=entropy, advantages=advantages, response_mask=mask,
                              group=group)
    metrics = dict(selection.metrics)
    if current is not None and "old_log_probs" in data and ROLLOUT_ENTROPY_FIELD in data:
        rollout = select_tokens(s2t, log_prob=field("old_log_probs"), entropy=field(ROLLOUT_ENTROPY_FIELD),
                                advantages=advantages, response_mask=mask, group=group)
        metrics.update(rollout_agreement(s2t, selection.keep, rollout.keep, mask, group))
    if SUM_PI_SQUARED_FIELD in data and current is None:
        metrics.update(grad_norm_metrics(log_prob=log_prob, sum_pi_squared=field(SUM_PI_SQUARED_FIELD),
                                         response_mask=mask, keep=selection.keep, candidate=selection.candidate,
                                         group=group))
    metrics[APPLIED_METRIC] = 0.0
    inside = mask != 0
    return metrics, S2TSets(mask=inside, silenced=inside & (selection.keep == 0), candidate=selection.candidate)


def applied_sets(cfg: TokenSelectionLossConfig, data, response_mask: torch.Tensor, *, device=None,
                 current: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> S2TSets:
    """The sets S2T applied to a mini-batch, after :func:`verl_patches.token_selection.fold_into_mini_batch`.

    ``response_mask``: the mask before the fold (``data["response_mask"]`` is the folded one);
    ``current``: the statistics the fold used when they were the current policy's (else the rollout
    ``old_log_probs``). Silenced: inside the original mask, outside the folded one. Candidates:
    :func:`stapo_core.s2t_candidates` on the fold's statistics.
    """
    width = to_padded(response_mask).shape[1]

    def padded(t: torch.Tensor) -> torch.Tensor:
        return to_padded(t, width)[:, :width].to(device)

    mask = padded(response_mask) != 0
    folded = padded(data["response_mask"]) != 0
    log_prob = padded(current[0] if current is not None else data["old_log_probs"]).float()
    candidate = s2t_candidates(log_prob, padded(data["advantages"]).float(), mask, tau_p=cfg.tau_p)
    return S2TSets(mask=mask, silenced=mask & ~folded, candidate=candidate)
