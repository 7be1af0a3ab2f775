"""Where PPO mini-batches enter the actor: their position in the step, and what the recipe does there.

verl's ``TrainingWorker.train_mini_batch`` splits a step's batch into mini-batches and calls
``TrainingWorker.train_batch`` once per mini-batch, flagging the last one with
``update_lr_scheduler=True``. :func:`wrap_train_batch` (installed by :mod:`verl_patches.install`)
runs :func:`before_update` before verl's ``train_batch`` and :func:`after_update` after it:

1. :func:`verl_patches.mini_batch_position.position_of` computes the mini-batch's position in
   its step once, on the worker itself (each worker object keeps its own count, so a second model
   worker in the same process, e.g. a critic, cannot shift the actor's);
2. with token selection at the mini-batch scope, the keep mask is folded into the mini-batch
   (:func:`verl_patches.token_selection.fold_into_mini_batch`), from the rollout statistics on the
   first mini-batch of a step and, with ``stats_from=current``, from one no-grad forward of the
   current policy on each later one (:func:`verl_patches.current_stats.current_policy_statistics`);
3. with ``s2t_monitor`` in a run that does not apply S2T, S2T's selection is computed on the same
   statistics and logged, not applied (:func:`verl_patches.s2t_monitor.monitor_mini_batch`), on
   the mini-batch as it came (before 2 folds another selection into it);
4. with ``update_effect_responses > 0``, the responses holding S2T's silenced (or would-be-silenced)
   tokens and kept candidates are forwarded before the update and again after it
   (:mod:`verl_patches.update_effect`); the step's metrics come with its last mini-batch;
5. with the token dump on, the first mini-batch's sampled responses are scored before the update
   and again after it, then written (:mod:`verl_patches.token_dump.hook`);
6. the metrics of 2-5 join the ones verl returns for the mini-batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from .mini_batch_position import MiniBatchPosition, position_of


def policy_loss_config(worker):
    """The worker's policy-loss settings, read from the loss function verl bound (None for a
    worker without one, e.g. a critic)."""
    loss_fn = getattr(worker, "loss_fn", None)
    config = getattr(loss_fn, "keywords", {}).get("config") if loss_fn is not None else None
    return getattr(config, "policy_loss", None)


def engine_device(engine):
    """The device the engine trains on: where its parameters are (in train mode they are loaded)."""
    module = getattr(engine, "module", None)
    if module is not None:
        for param in module.parameters():
            return param.device
    from verl.utils.device import get_device_id

    return get_device_id()


@dataclass
class PendingUpdate:
    """What :func:`before_update` hands to :func:`after_update` across verl's update of one mini-batch."""

    position: MiniBatchPosition
    cfg: object = None
    measurement: object = None
    dump: object = None


def _statistics_forward(cfg, position: MiniBatchPosition) -> bool:
    """This mini-batch needs the current policy's statistics: for the fold (STAPO's Algorithm 1) or
    for the monitor with ``stats_from=current``, on every mini-batch of a step but the first."""
    return not position.first and (cfg.forwards_current_policy or cfg.monitor_forwards_current_policy)


def before_update(worker, data) -> tuple[dict, Optional[PendingUpdate]]:
    """Everything the recipe does to one mini-batch before verl trains on it; returns its metrics
    and what :func:`after_update` needs (None for a batch the recipe does not handle)."""
    import torch
    from tensordict import TensorDict

    from . import s2t_monitor, update_effect
    from .config import TokenSelectionLossConfig
    from .current_stats import current_policy_statistics
    from .token_dump import hook as token_dump, settings as token_dump_settings
    from .token_selection import fold_into_mini_batch

    if not isinstance(data, TensorDict):
        return {}, None
    position = position_of(worker, data)
    cfg = policy_loss_config(worker)
    pending = PendingUpdate(position, cfg)
    response_mask = data.get("response_mask", None)  # before any token is silenced
    metrics: dict = {}
    if isinstance(cfg, TokenSelectionLossConfig):
        group, device = worker.engine.get_data_parallel_group(), engine_device(worker.engine)
        current = None
        if _statistics_forward(cfg, position):
            current = current_policy_statistics(worker, data, cfg, group=group, device=device)
        sets = None
        if cfg.monitors_s2t:  # before any fold: on the mini-batch's own mask
            # the monitor's runs never apply S2T, so their forward covers every sequence
            metrics, sets = s2t_monitor.monitor_mini_batch(
                cfg, data, group=group, device=device,
                current=(current.log_prob, current.entropy) if current is not None and cfg.stats_from == "current" else None)
        if cfg.folds_into_mini_batch:
            fold_current = current if cfg.forwards_current_policy else None
            metrics.update(fold_into_mini_batch(cfg, data, group=group, device=device, current=fold_current))
            if cfg.applies_s2t:
                metrics[s2t_monitor.APPLIED_METRIC] = 1.0
                if cfg.measures_update_effect:
                    # rows not forwarded (no positive advantage) hold NaN: p = 1 there, never a candidate
                    sets = s2t_monitor.applied_sets(
                        cfg, data, response_mask, device=device,
                        current=None if fold_current is None else (torch.nan_to_num(fold_current.log_prob, nan=0.0),
                                                                   fold_current.entropy))
        if cfg.measures_update_effect and sets is not None:
            pending.measurement = update_effect.measure_before(worker, data, sets, cfg.update_effect_responses,
                                                               group=group, device=device)
    if token_dump_settings.enabled():
        pending.dump = token_dump.score_mini_batch(worker, data, response_mask, cfg, position)
    return metrics, pending


def after_update(worker, pending: Optional[PendingUpdate]) -> dict:
    """Everything the recipe does to one mini-batch after verl trained on it; returns its metrics:
    the update effect (the step's, on its last mini-batch) and the token dump's."""
    from . import update_effect
    from .token_dump import hook as token_dump

    if pending is None:
        return {}
    metrics: dict = {}
    cfg = pending.cfg
    if getattr(cfg, "measures_update_effect", False) and getattr(cfg, "s2t_selection_before_update", False):
        update_effect.measure_after(worker, pending.measurement)
        if pending.position.last:
            metrics.update(update_effect.step_metrics(worker, group=worker.engine.get_data_parallel_group(),
                                                      device=engine_device(worker.engine)))
    if pending.dump is not None:
        metrics.update(token_dump.finish_mini_batch(worker, pending.dump))
    return metrics


def wrap_train_batch(train_batch):
    """``TrainingWorker.train_batch`` running :func:`before_update` first and :func:`after_update`
    last, and returning their metrics with verl's."""
    from verl.utils import tensordict_utils as tu

    @functools.wraps(train_batch)  # keeps verl's dispatch attributes
    def wrapped(self, data, *args, **kwargs):
        metrics, pending = before_update(self, data)
        output = train_batch(self, data, *args, **kwargs)
        metrics.update(after_update(self, pending))
        if metrics and output is not None:
            merged = dict(tu.get(output, "metrics"))
            merged.update(metrics)
            tu.assign_non_tensor(output, metrics=merged)
        return output

    return wrapped
