"""What the recipe adds to verl's two PPO trainers (the driver side of a step).

Both trainers compute the rollout policy's log-probs and entropies once per step (the
"old log-prob" pass). The recipe reads that pass's entropy for every method (per-step entropy
quantiles, :mod:`verl_patches.step_metrics`) and ships it to the actor where token selection uses
the rollout statistics:

* legacy trainer (``trainer.use_v1=false``, ``RayPPOTrainer``): :func:`wrap_legacy_old_log_prob`
  keeps a copy of the entropy (verl drops ``entropys`` after logging its mean) and
  :func:`wrap_legacy_update_actor` logs the quantiles, then drops the copy unless the actor needs it;
* TransferQueue trainer (``trainer.use_v1=true``, ``PPOTrainer``, which keeps ``entropy`` itself):
  :func:`wrap_v1_old_log_prob` logs the quantiles and honours ``actor.calculate_sum_pi_squared``
  as the legacy trainer does (for the closed-form gradient-norm metrics ``actor/s2t/grad_norm_*``).
"""

from __future__ import annotations

import functools

import transfer_queue as tq
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.utils.padding import response_from_nested

from .policy_loss_config import TokenSelectionLossConfig
from .step_metrics import entropy_quantile_metrics
from .layout import ROLLOUT_ENTROPY_FIELD, SUM_PI_SQUARED_FIELD, to_padded


def needs_rollout_entropy(config) -> bool:
    """The driver's question to the policy-loss settings (it holds them as a DictConfig): does the
    actor need the rollout-time entropy in its batch? Only the recipe's token selection does."""
    settings = omega_conf_to_dataclass(config.actor_rollout_ref.actor.policy_loss)
    return isinstance(settings, TokenSelectionLossConfig) and settings.needs_rollout_entropy


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
