"""Where PPO mini-batches enter the actor, and what the recipe does to each before and after its update.

verl's ``TrainingWorker.train_batch`` trains on one mini-batch; the recipe's selection must happen
before verl counts the mini-batch's loss tokens, and the update's effect is measured around the
update itself, so :func:`wrap_train_batch` (installed by :mod:`verl_patches.install`) runs
:func:`before_update` first and :func:`after_update` last, their metrics joining verl's. This module is
imported when its patch is applied, possibly inside ``import verl`` (``VERL_USE_EXTERNAL_MODULES``) after
the patch's target is imported: the verl modules it uses are loaded by then.
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
from .policy_loss_config import policy_loss_of
from .selection_pool import pool_group
from .token_dump import hook as token_dump
from .token_selection import apply_selection, select_mini_batch


def engine_device(engine):
    """The device the engine trains on: where its parameters are (in train mode they are loaded)."""
    module = getattr(engine, "module", None)
    if module is not None:
        for param in module.parameters():
            return param.device
    return get_device_id()


@dataclass
class PendingUpdate:
    """What :func:`before_update` hands to :func:`after_update` across verl's update of one mini-batch:
    the view, the probe, the rows of it the update effect reads (None: off), the token dump's phase 1."""

    view: MiniBatchView
    probe: Optional[update_effect.Probe] = None
    effect_rows: Optional[list] = None
    dump: Optional[token_dump.PendingDump] = None


def before_update(worker, data) -> tuple[dict, Optional[PendingUpdate]]:
    """Everything the recipe does to one mini-batch before verl trains on it, in order: its view, the
    current-policy forward, every selection and the fold, the token dump's scoring, the probe of the
    update. Returns its metrics and what :func:`after_update` needs (None for a mini-batch the recipe
    has nothing to do with)."""
    if not isinstance(data, TensorDict):
        return {}, None
    position, cfg = position_of(worker, data), policy_loss_of(worker)
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
        pending.effect_rows = update_effect.choose_rows(view.selection.s2t, cfg.update_effect_responses)
    if dumps:
        pending.dump = token_dump.score_mini_batch(worker, view)
    if pending.effect_rows is not None or pending.dump is not None:  # the same on every rank: the probe is collective
        rows = pending.effect_rows or []
        dumped = pending.dump.picked if pending.dump is not None else []
        pending.probe = update_effect.probe_before(worker, view, rows + [row for row in dumped if row not in rows])
    return view.selection.metrics, pending


def after_update(worker, pending: Optional[PendingUpdate]) -> dict:
    """Everything the recipe does to one mini-batch after verl trained on it: the probe's second
    forward, the update effect (its step metrics with the step's last mini-batch) and the token dump's
    records. Returns their metrics."""
    if pending is None:
        return {}
    metrics: dict = {}
    view = pending.view
    update_effect.probe_after(worker, pending.probe)
    if view.selects and view.cfg.measures_update_effect:
        if pending.effect_rows is not None:
            update_effect.add_update_effect(worker, pending.probe, pending.effect_rows, view.selection.s2t)
        if view.position.last:
            metrics.update(update_effect.step_metrics(worker, group=view.group, device=view.device))
    if pending.dump is not None:
        metrics.update(token_dump.finish_mini_batch(worker, pending.dump, pending.probe))
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
