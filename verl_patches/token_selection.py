"""Which response tokens carry policy gradient, on verl's padded tensors: the rule ``token_selection``
names (:data:`stapo_core.rules.RULES`), pooled over the data-parallel group or a group of its ranks.

A selection only shrinks the mask the loss runs over, so it composes with every verl loss. At the
mini-batch scope it is folded in before verl counts the mini-batch's loss tokens, so the loss is
exactly the paper's ``sum(M L) / sum(M)`` whatever the micro-batch size or number of ranks: each rule
runs once per mini-batch on its view (:func:`select_mini_batch`) and :func:`apply_selection` folds
the mask in; inside the loss, per micro-batch: :mod:`verl_patches.losses`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from verl.utils import tensordict_utils as tu

from stapo_core.rules import S2T, RuleResult

from .layout import UNSELECTED_MASK_FIELD, multiply_like, padded_float
from .mini_batch_view import (CurrentStatistics, MiniBatchPosition, MiniBatchSelection, MiniBatchView, S2TSets,
                              read_view)
from .policy_loss_config import TokenSelectionLossConfig
from . import selection_pool

#: 1.0 when S2T's selection was applied in the update, 0.0 when it was only monitored
APPLIED_METRIC = S2T.metric_prefix + "applied"

_generators: dict[tuple[int, str], torch.Generator] = {}


def _generator(seed: int, device: torch.device) -> torch.Generator:
    """One generator per seed, device and process, created on first use (``random`` strategy
    only); on the data's device, so the draw needs no host copy."""
    key = (seed, str(device))
    if key not in _generators:
        _generators[key] = torch.Generator(device=device).manual_seed(seed)
    return _generators[key]


def select_tokens(
    cfg: TokenSelectionLossConfig,
    *,
    log_prob: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    group=None,
) -> RuleResult:
    """The tokens ``cfg.token_selection``'s rule (:data:`stapo_core.rules.RULES`) keeps.

    Args:
        cfg: the policy-loss settings (a rule selected).
        log_prob, entropy, advantages: float ``(batch, resp_len)``, padded (``advantages`` also ``(batch,)``).
        response_mask: ``(batch, resp_len)``, nonzero marks the tokens to select among.
        group: the process group to pool the statistic over (None: this process only).

    Returns:
        The rule's :class:`~stapo_core.rules.RuleResult` (``keep`` float32 ``(batch, resp_len)``), its
        ``stats`` named as metrics (``<rule's metric prefix><stat>``, the undefined ones left out).
    """
    rule = cfg.rule

    def generator() -> torch.Generator:  # one per seed and rank: ranks draw differently
        rank = torch.distributed.get_rank(group) if group is not None else 0
        return _generator(cfg.seed * 1_000_003 + rank, log_prob.device)

    result = rule.select(cfg, log_prob=log_prob, entropy=entropy, advantages=advantages, response_mask=response_mask,
                         group=group, generator=generator)
    metrics = {rule.metric_prefix + k: float(v) for k, v in result.stats.items() if not math.isnan(float(v))}
    return dataclasses.replace(result, stats=metrics)


def rollout_agreement(cfg: TokenSelectionLossConfig, selection: RuleResult, *, log_prob, entropy, advantages,
                      response_mask, group=None) -> dict[str, float]:
    """How far the current-policy statistics drifted from the rollout ones, at the selection's own
    thresholds (a diagnostic: no second selection, no pooling beyond one count).

    Args:
        cfg: the settings whose rule made ``selection``, on the current statistics.
        log_prob, entropy, advantages: the rollout statistics, float ``(batch, resp_len)``.
        response_mask: float ``(batch, resp_len)``, the tokens ``selection`` selected among.
        group: the process group ``selection`` was pooled over.

    Returns:
        ``{<rule's prefix>rollout_agreement: |A & B| / |A | B|}`` over ``group``, A the tokens
        ``selection`` dropped, B those its thresholds drop on the rollout statistics
        (:attr:`~stapo_core.rules.RuleResult.keep_at`); 1.0 when neither drops any; ``{}`` for a
        selection without thresholds (S2T's ``random``).
    """
    if selection.keep_at is None:
        return {}
    keep_rollout = selection.keep_at(log_prob=log_prob, entropy=entropy, advantages=advantages,
                                     response_mask=response_mask)
    dropped_now, dropped_rollout = response_mask * (1 - selection.keep), response_mask * (1 - keep_rollout)
    counts = torch.stack([(dropped_now * dropped_rollout).sum(), torch.maximum(dropped_now, dropped_rollout).sum()])
    if group is not None:
        torch.distributed.all_reduce(counts, group=group)
    both, either = counts.tolist()
    return {cfg.rule.metric_prefix + "rollout_agreement": 1.0 if either == 0 else both / either}


def grad_norm_metrics(*, log_prob, sum_pi_squared, response_mask, keep, candidate=None, group=None,
                      prefix: str = "s2t/") -> dict[str, float]:
    """Mean closed-form gradient norm ``sqrt(1 - 2 pi_k + sum_n pi_n^2)`` (docs/method.md, "Why these
    tokens") of the silenced, kept and kept-candidate tokens.

    Args:
        log_prob: float ``(batch, resp_len)``, the rollout log-probabilities.
        sum_pi_squared: float ``(batch, resp_len)``, verl's rollout-time ``sum_n pi_n^2``
            (``actor.calculate_sum_pi_squared=true``).
        response_mask, keep: float ``(batch, resp_len)``: the response tokens, and 1 where kept.
        candidate: bool ``(batch, resp_len)``, S2T's candidate set, or None.
        group: the process group to pool over. prefix: the metrics' prefix.

    Returns:
        ``<prefix>grad_norm_silenced``, ``<prefix>grad_norm_kept`` (every kept token) and, with
        ``candidate``, ``<prefix>grad_norm_kept_candidates`` (the rare tokens kept for their high
        entropy), pooled over ``group``; a mean over no token is left out.
    """
    norm = torch.sqrt((1.0 - 2.0 * log_prob.exp() + sum_pi_squared).clamp(min=0.0))
    inside = response_mask.float()
    sets = {"silenced": inside * (1.0 - keep), "kept": inside * keep}
    if candidate is not None:
        sets["kept_candidates"] = sets["kept"] * candidate.float()
    sums = torch.stack([t for w in sets.values() for t in ((norm * w).sum(), w.sum())])
    if group is not None:
        torch.distributed.all_reduce(sums, group=group)
    values = sums.tolist()
    return {prefix + "grad_norm_" + name: total / count
            for name, total, count in zip(sets, values[0::2], values[1::2]) if count > 0}


def _widen(cfg: TokenSelectionLossConfig, selection: RuleResult, part: torch.Tensor, response_mask: torch.Tensor,
           group=None) -> RuleResult:
    """A selection computed over ``part`` of the response tokens (the forwarded sequences of a rule
    whose ``positive_advantage_only`` holds), made the selection over all of ``response_mask``:
    every other token is kept, and the token counts (``<prefix>tokens``, ``<prefix>silenced_frac``)
    cover every response token of the pooled group."""
    prefix = cfg.rule.metric_prefix
    count = response_mask.sum().double()
    if group is not None:
        torch.distributed.all_reduce(count, group=group)
    tokens = float(count.item())
    silenced_count = selection.tokens - selection.kept
    metrics = dict(selection.stats)
    metrics[prefix + "tokens"] = tokens
    metrics[prefix + "silenced_frac"] = silenced_count / max(tokens, 1.0)
    keep = response_mask * (1.0 - part * (1.0 - selection.keep))
    return dataclasses.replace(selection, keep=keep, tokens=tokens, kept=tokens - silenced_count, stats=metrics)


def _select(cfg: TokenSelectionLossConfig, view: MiniBatchView, current: Optional[CurrentStatistics],
            group) -> tuple[RuleResult, dict]:
    """The rule of ``cfg`` on the mini-batch, pooled over ``group``, from ``current`` (else the rollout
    statistics, which :func:`~verl_patches.mini_batch_view.read_view` checked): its selection over every
    response token, and its metrics (the rule's, the drift from the rollout statistics, the gradient
    norms of its sets), each over ``group``."""
    rule = cfg.rule
    log_prob, entropy = (view.old_log_prob, view.rollout_entropy) if current is None else (current.log_prob,
                                                                                         current.entropy)
    mask, part = view.mask, view.mask
    if current is not None:
        if not bool(current.forwarded.all()) and not rule.positive_advantage_only:
            raise ValueError(f"token_selection={cfg.token_selection} needs the statistics of every sequence")
        part = mask * current.forwarded.to(mask.device, torch.float32)[:, None]
    selection = select_tokens(cfg, log_prob=log_prob, entropy=entropy, advantages=view.advantages,
                              response_mask=part, group=group)
    if current is not None and rule.positive_advantage_only:
        # the same counts everywhere, whether this rank forwarded every row or not
        selection = _widen(cfg, selection, part, mask, group)
    metrics = dict(selection.stats)
    if current is not None and view.rollout_entropy is not None and view.old_log_prob is not None:
        metrics.update(rollout_agreement(cfg, selection, log_prob=view.old_log_prob, entropy=view.rollout_entropy,
                                         advantages=view.advantages, response_mask=mask, group=group))
    if view.sum_pi_squared is not None and selection.candidate is not None and current is None:
        metrics.update(grad_norm_metrics(log_prob=log_prob, sum_pi_squared=view.sum_pi_squared, response_mask=mask,
                                         keep=selection.keep, candidate=selection.candidate, group=group,
                                         prefix=rule.metric_prefix))
    return selection, metrics


def s2t_sets(mask: torch.Tensor, selection: RuleResult) -> S2TSets:
    """S2T's sets of ``selection`` (S2T's rule, its stats named as metrics) on the tokens of ``mask``
    (float ``(batch, width)``)."""
    inside = mask != 0
    tau_h = selection.stats.get(S2T.metric_prefix + "tau_h")
    return S2TSets(mask=inside, silenced=inside & (selection.keep == 0), candidate=selection.candidate, tau_h=tau_h)


def as_s2t(cfg: TokenSelectionLossConfig, **changes) -> TokenSelectionLossConfig:
    """``cfg`` with S2T as its token selection, pooled over the whole mini-batch (the monitor's selector)."""
    return dataclasses.replace(cfg, token_selection=S2T.name, scope=None, ranks_per_pool=None,
                               update_effect_responses=0, **changes)


def select_mini_batch(view: MiniBatchView) -> MiniBatchSelection:
    """Every selection of one rank's mini-batch, computed once into ``view.selection`` (the data is
    not changed): the S2T monitor's, the run's (over ``view.pool_group``) and the token dump's."""
    cfg, current, selection = view.cfg, view.current, view.selection
    if view.selects and cfg.monitors_s2t:  # the monitor's runs never apply S2T: their forward covers every sequence
        result, metrics = _select(as_s2t(cfg), view, current if cfg.stats_from == "current" else None, view.group)
        if current is not None and not cfg.forwards_current_policy:
            metrics.update(current.metrics)  # the forward served the monitor alone
        metrics[APPLIED_METRIC] = 0.0
        selection.s2t, selection.metrics = s2t_sets(view.mask, result), metrics
    if view.selects and cfg.folds_into_mini_batch:
        result, metrics = _select(cfg, view, current, view.pool_group)
        if current is not None:
            metrics.update(current.metrics)
        selection.keep = result.keep
        selection.metrics.update(metrics)
        if cfg.applies_s2t:
            selection.metrics[APPLIED_METRIC] = 1.0
            selection.s2t = s2t_sets(view.mask, result)
    if view.dump_s2t is not None:
        selection.dump = _dump_sets(view)
    return selection


def _dump_sets(view: MiniBatchView) -> Optional[S2TSets]:
    """S2T's sets with the token dump's settings on the rollout statistics of the mini-batch: the
    mini-batch's own (applied or monitored) when they are those, else S2T run for the dump (no metric);
    None without rollout statistics."""
    settings, sets = view.dump_s2t, view.selection.s2t
    if view.old_log_prob is None or view.rollout_entropy is None:
        return None
    if sets is not None and view.cfg.strategy == settings.strategy:  # the first mini-batch's: the rollout statistics
        return sets
    result = select_tokens(settings, log_prob=view.old_log_prob, entropy=view.rollout_entropy,
                           advantages=view.advantages, response_mask=view.mask, group=view.group)
    return s2t_sets(view.mask, result)


def apply_selection(view: MiniBatchView) -> None:
    """Fold ``view.selection.keep`` into the mini-batch in place: multiply ``response_mask`` and
    ``loss_mask`` by it, set verl's ``global_batch_size`` to the sequences that keep a token
    (seq-mean modes), and keep the unselected mask for ``sequence_ratio=all_tokens``."""
    data, keep = view.data, view.selection.keep
    if keep is None:
        return
    response_mask = data["response_mask"]
    if view.cfg.sequence_ratio_over_all_tokens:
        data[UNSELECTED_MASK_FIELD] = response_mask.clone()
    keep_here = keep.to(response_mask.device)
    data["response_mask"] = multiply_like(response_mask, keep_here)
    if "loss_mask" in data:
        data["loss_mask"] = multiply_like(data["loss_mask"], keep_here)
    if tu.get(data, "global_batch_size", None) is not None:  # the seq-mean denominator, over every rank
        count = ((view.mask * keep).sum(-1) > 0).sum().double()
        if view.group is not None:
            torch.distributed.all_reduce(count, group=view.group)
        tu.assign_non_tensor(data, global_batch_size=max(int(count.item()), 1))


def fold_into_mini_batch(cfg: TokenSelectionLossConfig, data, group=None, device=None, current=None,
                         pool_group=...) -> dict[str, float]:
    """:func:`select_mini_batch`, then :func:`apply_selection` on ``data`` in place (tests, benchmarks).

    Args:
        cfg: the policy-loss settings. data: verl's TensorDict of one mini-batch.
        group: the data-parallel group. device: where the view's fields go.
        current: ``(log_prob, entropy)``, float ``(batch, resp_len)`` of every row: the current
            statistics of a step's later mini-batch (None: a step's first).
        pool_group: the run's selection pool (default :func:`verl_patches.selection_pool.pool_group`).

    Returns:
        The selections' metrics.
    """
    pool = selection_pool.pool_group(cfg, group) if pool_group is ... else pool_group
    view = read_view(data, MiniBatchPosition(1, 0 if current is None else 1), cfg, group=group, pool_group=pool,
                     device=device)
    if current is not None:
        log_prob, entropy = (padded_float(t, view.mask.shape[1], view.mask.device) for t in current)
        view.current = CurrentStatistics(log_prob, entropy, torch.ones(len(data), dtype=torch.bool), {})
    select_mini_batch(view)
    apply_selection(view)
    return view.selection.metrics
