"""Where PPO mini-batches enter the actor, and what the recipe does to each before and after its update.

:func:`wrap_train_batch` (installed by :mod:`verl_patches.install`) runs :func:`before_update` before
verl's ``TrainingWorker.train_batch`` and :func:`after_update` after it. Before the update:

1. the mini-batch's position in its step is counted on the worker itself, and the mini-batch is read
   once into its view (:mod:`verl_patches.mini_batch_view`), which every step below reads;
2. with ``stats_from=current``, each mini-batch after a step's first gets one no-grad forward of the
   current policy (:func:`verl_patches.current_stats.current_policy_statistics`) for the run's
   selection or for the S2T monitor;
3. every selection of the mini-batch is computed once and the run's keep mask is folded into it at the
   mini-batch scope (:mod:`verl_patches.token_selection`): the rule runs once per mini-batch, pooled over
   the data-parallel group or this rank's group of ``ranks_per_pool`` ranks (:mod:`verl_patches.selection_pool`);
4. with ``update_effect_responses > 0``, the responses holding S2T's silenced (or would-be-silenced)
   tokens and kept candidates are forwarded (:mod:`verl_patches.update_effect`);
5. with the token dump on, the first mini-batch's sampled responses are scored
   (:mod:`verl_patches.token_dump.hook`).

After the update, 4 and 5 forward the same responses again; the update effect's step metrics come
with the step's last mini-batch. The metrics of 2-5 join the ones verl returns for the mini-batch.

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
from .current_stats import current_policy_statistics
from .mini_batch_view import MiniBatchView, position_of, read_view, selects
from .selection_pool import pool_group
from .token_dump import hook as token_dump
from .token_selection import apply_selection, select_mini_batch


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

    view: MiniBatchView
    measurement: object = None
    dump: object = None


def before_update(worker, data) -> tuple[dict, Optional[PendingUpdate]]:
    """Everything the recipe does to one mini-batch before verl trains on it; returns its metrics
    and what :func:`after_update` needs (None for a mini-batch the recipe has nothing to do with)."""
    if not isinstance(data, TensorDict):
        return {}, None
    position, cfg = position_of(worker, data), policy_loss_config(worker)
    dumps = token_dump.dumps(worker, position)
    if not (dumps or selects(cfg)):
        return {}, None
    engine = worker.engine
    group = engine.get_data_parallel_group()
    view = read_view(data, position, cfg, group=group, pool_group=pool_group(cfg, group), device=engine_device(engine))
    view.dump_s2t = token_dump.s2t_settings(cfg) if dumps else None
    pending = PendingUpdate(view)
    if view.forwards_current_policy:
        view.current = current_policy_statistics(worker, view)
    select_mini_batch(view)
    apply_selection(view)
    if view.selects and cfg.measures_update_effect and view.selection.s2t is not None:
        pending.measurement = update_effect.measure_before(worker, view)
    if dumps:
        pending.dump = token_dump.score_mini_batch(worker, view)
    return view.selection.metrics, pending


def after_update(worker, pending: Optional[PendingUpdate]) -> dict:
    """Everything the recipe does to one mini-batch after verl trained on it; returns its metrics:
    the update effect (the step's, on its last mini-batch) and the token dump's."""
    if pending is None:
        return {}
    metrics: dict = {}
    view = pending.view
    if view.selects and view.cfg.measures_update_effect:
        update_effect.measure_after(worker, pending.measurement)
        if view.position.last:
            metrics.update(update_effect.step_metrics(worker, group=view.group, device=view.device))
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
