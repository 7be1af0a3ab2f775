"""Where PPO mini-batches enter the actor: their position in the step, and what the recipe does there.

verl's ``TrainingWorker.train_mini_batch`` splits a step's batch into mini-batches and calls
``TrainingWorker.train_batch`` once per mini-batch, flagging the last one with
``update_lr_scheduler=True``. :func:`wrap_train_batch` (installed by :mod:`verl_patches.install`)
runs before verl's ``train_batch``:

1. :func:`verl_patches.mini_batch_position.position_of` computes the mini-batch's position in
   its step once, on the worker itself (each worker object keeps its own count, so a second model
   worker in the same process, e.g. a critic, cannot shift the actor's);
2. with token selection at the mini-batch scope, the keep mask is folded into the mini-batch
   (:func:`verl_patches.token_selection.fold_into_mini_batch`), from the rollout statistics on the
   first mini-batch of a step and, with ``stats_from=current``, from one no-grad forward of the
   current policy on each later one (:func:`verl_patches.current_stats.current_policy_statistics`);
3. with the token dump on, the first mini-batch's candidate tokens are written
   (:func:`verl_patches.token_dump.hook.dump_mini_batch`);
4. the metrics of 2 and 3 join the ones verl returns for the mini-batch.
"""

from __future__ import annotations

import functools

from .mini_batch_position import position_of

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


def before_update(worker, data) -> dict:
    """Everything the recipe does to one mini-batch before verl trains on it; returns its metrics."""
    from tensordict import TensorDict

    from .config import TokenSelectionLossConfig
    from .current_stats import current_policy_statistics
    from .token_dump import hook as token_dump, settings as token_dump_settings
    from .token_selection import fold_into_mini_batch

    if not isinstance(data, TensorDict):
        return {}
    position = position_of(worker, data)
    cfg = policy_loss_config(worker)
    response_mask = data.get("response_mask", None)  # before any token is silenced
    metrics: dict = {}
    if isinstance(cfg, TokenSelectionLossConfig) and cfg.folds_into_mini_batch:
        group, device = worker.engine.get_data_parallel_group(), engine_device(worker.engine)
        current = None
        if cfg.forwards_current_policy and not position.first:
            current = current_policy_statistics(worker, data, cfg, group=group, device=device)
        metrics = fold_into_mini_batch(cfg, data, group=group, device=device, current=current)
    if token_dump_settings.enabled():
        metrics.update(token_dump.dump_mini_batch(worker, data, response_mask, cfg, position))
    return metrics


def wrap_train_batch(train_batch):
    """``TrainingWorker.train_batch`` running :func:`before_update` first and returning its metrics
    with verl's."""
    from verl.utils import tensordict_utils as tu

    @functools.wraps(train_batch)  # keeps verl's dispatch attributes
    def wrapped(self, data, *args, **kwargs):
        metrics = before_update(self, data)
        output = train_batch(self, data, *args, **kwargs)
        if metrics and output is not None:
            merged = dict(tu.get(output, "metrics"))
            merged.update(metrics)
            tu.assign_non_tensor(output, metrics=merged)
        return output

    return wrapped
