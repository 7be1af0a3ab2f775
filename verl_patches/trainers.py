"""What the recipe adds to verl's two PPO trainers (the driver side of a step): the legacy trainer
(``trainer.use_v1=false``, ``RayPPOTrainer``, the ``wrap_legacy_*`` wraps) and the TransferQueue trainer
(``PPOTrainer``, ``wrap_v1_*``) keep the rollout entropy and the reward's extra info in places of their
own; what each wrap changes and why: docs/verl_patches.md.
"""

from __future__ import annotations

import functools

import transfer_queue as tq
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.utils.padding import response_from_nested

from .policy_loss_config import TokenSelectionLossConfig
from .step_metrics import entropy_quantile_metrics
from .layout import ROLLOUT_ENTROPY_FIELD, SUM_PI_SQUARED_FIELD, to_padded

#: the reward's extra-info key marking a response whose answer could not be checked (recipe.stapo.reward)
UNGRADED_KEY = "ungraded"
#: the per-step training metric: how many of the step's responses were ungraded
UNGRADED_METRIC = "reward/ungraded"


def needs_rollout_entropy(config) -> bool:
    """Whether the actor needs the rollout-time entropy in its batch (``config``: the driver's
    DictConfig): only the recipe's token selection does, for its statistic (``stats_from=rollout``), for
    a step's first mini-batch at the mini-batch scope (the policy has not moved yet: the rollout
    statistics are the current ones), or for the S2T monitor."""
    s = omega_conf_to_dataclass(config.actor_rollout_ref.actor.policy_loss)
    return isinstance(s, TokenSelectionLossConfig) and (
        (s.selects_tokens and (s.statistics_source == "rollout" or s.folds_into_mini_batch)) or s.monitors_s2t)


def bypasses_old_log_prob(config) -> bool:
    """verl's rollout-correction bypass mode: old log-probs are the rollout's, none recomputed."""
    rollout_corr = config.algorithm.get("rollout_correction", None)
    return bool(rollout_corr and rollout_corr.get("bypass_mode", False))


def wrap_legacy_old_log_prob(compute_old_log_prob):
    """``RayPPOTrainer._compute_old_log_prob`` keeping the entropy as ``entropy`` in the batch."""

    @functools.wraps(compute_old_log_prob)
    def wrapped(self, batch):
        old_log_prob, mfu = compute_old_log_prob(self, batch)
        # the same tensor under a second name: verl pops "entropys" after logging its mean
        old_log_prob.batch[ROLLOUT_ENTROPY_FIELD] = old_log_prob.batch["entropys"]
        return old_log_prob, mfu

    return wrapped


def wrap_legacy_update_actor(update_actor):
    """``RayPPOTrainer._update_actor`` logging the step's entropy quantiles, and not shipping the
    kept entropy to the actor when the policy loss does not read it."""

    @functools.wraps(update_actor)
    def wrapped(self, batch):
        metrics = {}
        if ROLLOUT_ENTROPY_FIELD in batch.batch.keys():
            metrics = entropy_quantile_metrics(batch.batch[ROLLOUT_ENTROPY_FIELD], batch.batch["response_mask"])
            if not needs_rollout_entropy(self.config):
                batch.batch.pop(ROLLOUT_ENTROPY_FIELD)
        output = update_actor(self, batch)
        output.meta_info["metrics"].update(metrics)
        return output

    return wrapped


def wrap_v1_old_log_prob(compute_old_log_prob):
    """``PPOTrainer._compute_old_log_prob`` adding the step's entropy quantiles to ``metrics`` and
    honouring ``actor.calculate_sum_pi_squared``: asks the worker for it and stores it per response
    token, as ``old_log_probs``. One read of the queue serves both."""
    @functools.wraps(compute_old_log_prob)
    def wrapped(self, batch, metrics):
        wanted = self.config.actor_rollout_ref.actor.get("calculate_sum_pi_squared", False)
        if wanted:
            batch.extra_info["calculate_sum_pi_squared"] = True
        batch = compute_old_log_prob(self, batch, metrics)
        batch.extra_info["calculate_sum_pi_squared"] = False  # the update must not compute it
        if bypasses_old_log_prob(self.config):  # old_log_probs = rollout log-probs: no entropy computed
            return batch
        fields = [ROLLOUT_ENTROPY_FIELD, "response_mask"] + ([SUM_PI_SQUARED_FIELD] if wanted else [])
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        mask = to_padded(data["response_mask"])
        metrics.update(entropy_quantile_metrics(to_padded(data[ROLLOUT_ENTROPY_FIELD], mask.shape[1]), mask))
        if wanted:
            data[SUM_PI_SQUARED_FIELD] = response_from_nested(data[SUM_PI_SQUARED_FIELD], data["response_mask"])
            batch = tq.kv_batch_put(
                keys=batch.keys, partition_id=batch.partition_id, fields=data.select(SUM_PI_SQUARED_FIELD)
            )
        return batch

    return wrapped


def ungraded_metrics(values) -> dict[str, int]:
    """``{reward/ungraded: n}``, ``n`` the responses whose reward extra info says ``ungraded`` (``values``:
    one entry per response, ``None`` where a response's reward reported no such key); ``{}`` when no
    response reported it (a reward without the key, e.g. JustRL's strict one, never leaves an answer
    unchecked)."""
    reported = [v for v in values if v is not None]
    if not reported:
        return {}
    return {UNGRADED_METRIC: sum(bool(v) for v in reported)}


def wrap_legacy_data_metrics(compute_data_metrics):
    """verl's ``compute_data_metrics`` as the legacy trainer calls it once per step (on the step's whole
    batch, whose non-tensor fields hold the reward's extra info), adding :func:`ungraded_metrics`."""

    @functools.wraps(compute_data_metrics)
    def wrapped(batch, *args, **kwargs):
        metrics = compute_data_metrics(batch, *args, **kwargs)
        values = batch.non_tensor_batch.get(UNGRADED_KEY, None)
        if values is not None:
            metrics.update(ungraded_metrics(list(values)))
        return metrics

    return wrapped


def extra_info_values(extra_fields, key: str) -> list:
    """``key`` of each response's reward extra info (``extra_fields[i]["reward_extra_info"]``, as the
    TransferQueue trainer's agent loop stores it), ``None`` where absent."""
    values = []
    for fields in extra_fields:
        info = fields.get("reward_extra_info", None) if isinstance(fields, dict) else None
        values.append(info.get(key, None) if isinstance(info, dict) else None)
    return values


def wrap_v1_compute_metrics(compute_metrics):
    """``PPOTrainer._compute_metrics`` (once per step, on the step's batch, before the queue is cleared)
    adding :func:`ungraded_metrics` of the step's responses (the padding rows verl adds to divide the
    batch evenly left out), read from their ``extra_fields`` in the queue."""

    @functools.wraps(compute_metrics)
    def wrapped(self, batch, metrics, *args, **kwargs):
        result = compute_metrics(self, batch, metrics, *args, **kwargs)
        keys = [key for key, tag in zip(batch.keys, batch.tags) if not tag.get("is_padding", False)]
        if keys:
            data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
            extra_fields = data.pop("extra_fields").tolist()  # as verl's _validate reads the field
            metrics.update(ungraded_metrics(extra_info_values(extra_fields, UNGRADED_KEY)))
        return result

    return wrapped
