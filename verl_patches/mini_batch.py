"""Where PPO mini-batches enter the actor: their position in the step, and what the recipe does there.

verl's ``TrainingWorker.train_mini_batch`` splits a step's batch into mini-batches and calls
``TrainingWorker.train_batch`` once per mini-batch, flagging the last one with
``update_lr_scheduler=True``. :func:`wrap_train_batch` (installed by :mod:`verl_patches.install`)
runs :func:`before_update` before verl's ``train_batch`` and :func:`after_update` after it:

1. :func:`verl_patches.mini_batch_position.position_of` computes the mini-batch's position in
   its step once, on the worker itself (each worker object keeps its own count, so a second model
   worker in the same process, e.g. a critic, cannot shift the actor's);
2. with ``stats_from=current``, each mini-batch after a step's first gets one no-grad forward of the
   current policy (:func:`verl_patches.current_stats.current_policy_statistics`) for the run's
   selection or for the S2T monitor;
3. every selection of the mini-batch is computed once
   (:func:`verl_patches.mini_batch_selection.select_mini_batch`): the run's keep mask, folded into
   the mini-batch at the mini-batch scope, and S2T's sets (applied by STAPO, or monitored);
4. with ``update_effect_responses > 0``, the responses holding S2T's silenced (or would-be-silenced)
   tokens and kept candidates are forwarded before the update and again after it
   (:mod:`verl_patches.update_effect`); the step's metrics come with its last mini-batch;
5. with the token dump on, the first mini-batch's sampled responses are scored before the update
   and again after it, then written (:mod:`verl_patches.token_dump.hook`);
6. the metrics of 2-5 join the ones verl returns for the mini-batch.

This module is imported when its patch is applied, which can be inside ``import verl`` itself
(``VERL_USE_EXTERNAL_MODULES``), after the patch's target (verl's engine workers) is imported: the
verl modules the recipe's modules 2-5 use are loaded by then.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id

from . import update_effect
from .policy_loss_config import TokenSelectionLossConfig
from .current_stats import current_policy_statistics
from .mini_batch_position import MiniBatchPosition, position_of
from .mini_batch_selection import apply_selection, select_mini_batch
from .token_dump import hook as token_dump, settings as token_dump_settings


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
    if not isinstance(data, TensorDict):
        return {}, None
    position = position_of(worker, data)
    cfg = policy_loss_config(worker)
    pending = PendingUpdate(position, cfg)
    response_mask = data.get("response_mask", None)  # before any token is silenced
    metrics: dict = {}
    selection = None
    if isinstance(cfg, TokenSelectionLossConfig) and (cfg.folds_into_mini_batch or cfg.monitors_s2t):
        group, device = worker.engine.get_data_parallel_group(), engine_device(worker.engine)
        current = None
        if _statistics_forward(cfg, position):
            current = current_policy_statistics(worker, data, cfg, group=group, device=device)
        selection = select_mini_batch(cfg, data, group=group, device=device, current=current)
        apply_selection(cfg, data, selection, group)
        metrics = selection.metrics
        if cfg.measures_update_effect and selection.s2t is not None:
            pending.measurement = update_effect.measure_before(worker, data, selection.s2t, cfg.update_effect_responses,
                                                               group=group, device=device)
    if token_dump_settings.enabled():
        pending.dump = token_dump.score_mini_batch(worker, data, response_mask, cfg, position,
                                                   s2t=selection.s2t if selection is not None else None)
    return metrics, pending


def after_update(worker, pending: Optional[PendingUpdate]) -> dict:
    """Everything the recipe does to one mini-batch after verl trained on it; returns its metrics:
    the update effect (the step's, on its last mini-batch) and the token dump's."""
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
