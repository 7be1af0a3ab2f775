"""Install the recipe's patches into verl 0.9.1. Idempotent; run by ``import verl_patches``.

How the patches reach every process (driver, task runner, Ray workers): the environment variable
``VERL_USE_EXTERNAL_MODULES=verl_patches``, which ``import verl`` reads in every process and
imports. ``recipe.stapo.main_stapo`` sets it in the driver (local Ray workers inherit it) and the
recipe YAML passes it to remote workers through ``ray_kwargs.ray_init.runtime_env.env_vars``. The
config class ``verl_patches.config.TokenSelectionLossConfig`` (named by ``_target_``) imports this
package again wherever a config is built, which is harmless.

What is patched, each at one place and never by editing verl's files:

1. ``verl.workers.engine_workers.ppo_loss`` -> ``ppo_loss_with_token_selection``: verl's loss, with
   the micro-batch-scope selection and the guards for silenced mini-batches
   (:mod:`verl_patches.losses`; verl binds this module-level name in ``init_model``).
2. ``TrainingWorker.train_batch`` (called once per mini-batch): folds the S2T / 20-Entropy mask
   into ``response_mask`` and ``loss_mask`` before verl counts the mini-batch's loss tokens, when
   the policy loss asks for ``scope=mini_batch`` (with ``stats_from=current``, after one no-grad
   forward of the mini-batch under the current policy, from the second mini-batch of a step on);
   its metrics join the step's actor metrics. When the token dump is on
   (``recipe.token_dump.dir``), it also writes the candidate tokens of a few sampled responses
   (:mod:`verl_patches.token_dump`).
3. (removed: the recipe registers no policy loss; token selection composes with verl's own.)
4. ``RayPPOTrainer._compute_old_log_prob`` (legacy trainer): keeps a copy of the rollout-time
   entropy in the batch as ``entropy`` (the legacy trainer drops ``entropys`` after logging it; the
   TransferQueue trainer already keeps ``entropy``).
5. ``PPOTrainer._compute_old_log_prob`` (TransferQueue trainer): logs the step's entropy
   quantiles (:mod:`verl_patches.step_metrics`) for every method, and honours verl's
   ``actor.calculate_sum_pi_squared`` as the legacy trainer does, so the actor can log the
   closed-form gradient norm of silenced vs kept tokens and kept candidates (``actor/s2t/grad_norm_*``).
6. ``TrainingWorker.set_loss_fn``: with ``stats_from=current`` and no entropy bonus, the engine
   computes the update's entropy without autograd (it is only S2T's statistic).
7. ``RayPPOTrainer._update_actor`` (legacy trainer): logs the step's entropy quantiles for every
   method, then drops the kept entropy from the batch unless the policy loss needs it in the actor.
"""

from __future__ import annotations

import functools
import math

import torch

from .step_metrics import entropy_quantile_metrics

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    from verl.workers import engine_workers

    from . import losses

    engine_workers.ppo_loss = losses.ppo_loss_with_token_selection
    engine_workers.TrainingWorker.train_batch = _with_mini_batch_selection(engine_workers.TrainingWorker.train_batch)
    engine_workers.TrainingWorker.set_loss_fn = _with_statistic_only_entropy(engine_workers.TrainingWorker.set_loss_fn)
    _patch_legacy_trainer()
    _patch_v1_trainer()
    _installed = True


def _policy_loss_config(worker):
    """The actor's policy-loss config, read from the loss function verl bound (or None)."""
    loss_fn = getattr(worker, "loss_fn", None)
    config = getattr(loss_fn, "keywords", {}).get("config") if loss_fn is not None else None
    return getattr(config, "policy_loss", None)


def _engine_device(engine):
    """The device the engine trains on: where its parameters are (in train mode they are loaded)."""
    module = getattr(engine, "module", None)
    if module is not None:
        for param in module.parameters():
            return param.device
    from verl.utils.device import get_device_id

    return get_device_id()


def _with_statistic_only_entropy(set_loss_fn):
    """With ``stats_from=current`` the actor computes the entropy in the update only as S2T's
    statistic (``entropy_coeff == 0``): compute it without autograd, which otherwise keeps every
    chunk's float32 softmax over the vocabulary for a backward that contributes nothing
    (benchmarks/README.md: 2.6x -> 1.0x peak memory of the loss path, ~1.9x -> ~1.3x time)."""
    if getattr(set_loss_fn, "_stapo_wrapped", False):
        return set_loss_fn

    @functools.wraps(set_loss_fn)  # keeps verl's dispatch attributes
    def wrapped(self, loss_fn, *args, **kwargs):
        result = set_loss_fn(self, loss_fn, *args, **kwargs)
        config = getattr(loss_fn, "keywords", {}).get("config")
        if statistic_only_entropy(config):
            engine = self.engine
            if not getattr(engine.compute_entropy_from_logits, "_stapo_no_grad", False):
                no_grad_entropy = torch.no_grad()(engine.compute_entropy_from_logits)
                no_grad_entropy._stapo_no_grad = True
                engine.compute_entropy_from_logits = no_grad_entropy
        return result

    wrapped._stapo_wrapped = True
    return wrapped


def statistic_only_entropy(actor_config) -> bool:
    """True when the update's entropy serves only S2T's current statistics (no entropy bonus)."""
    from .config import TokenSelectionLossConfig

    policy_loss = getattr(actor_config, "policy_loss", None)
    return (
        isinstance(policy_loss, TokenSelectionLossConfig)
        and policy_loss.needs_update_entropy
        and actor_config.entropy_coeff == 0
    )


def _with_mini_batch_selection(train_batch):
    from tensordict import TensorDict

    from verl.utils import tensordict_utils as tu

    from .config import TokenSelectionLossConfig
    from .token_dump import hook as token_dump, settings as token_dump_settings
    from .token_dump.scoring import MiniBatchTracker
    from .token_selection import fold_into_mini_batch

    if getattr(train_batch, "_stapo_wrapped", False):
        return train_batch
    tracker = MiniBatchTracker()

    @functools.wraps(train_batch)  # keeps verl's dispatch attributes
    def wrapped(self, data, *args, **kwargs):
        cfg = _policy_loss_config(self)
        metrics = {}
        if isinstance(data, TensorDict):
            response_mask = data.get("response_mask", None)  # before any token is silenced
            first = tracker.observe(bool(tu.get(data, "update_lr_scheduler", True)))
            if isinstance(cfg, TokenSelectionLossConfig) and cfg.folds_into_mini_batch:
                current = None
                if cfg.forwards_current_policy and not first:
                    current = current_policy_statistics(self, data)
                metrics = fold_into_mini_batch(
                    cfg, data, group=self.engine.get_data_parallel_group(), device=_engine_device(self.engine),
                    current=current,
                )
            if token_dump_settings.enabled():
                metrics.update(token_dump.dump_mini_batch(self, data, response_mask, cfg))
        output = train_batch(self, data, *args, **kwargs)
        if metrics and output is not None:
            merged = dict(tu.get(output, "metrics"))
            merged.update(metrics)
            tu.assign_non_tensor(output, metrics=merged)
        return output

    wrapped._stapo_wrapped = True
    return wrapped


def current_policy_statistics(worker, data) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_prob, entropy)`` of the mini-batch's response tokens under the policy being updated:
    one no-grad forward through verl's own inference path (``TrainingWorker.infer_batch``, the pass
    that computes the old log-probs, with its micro-batch and token-budget settings), on a shallow
    copy of the mini-batch so that nothing verl adds to it leaks into the update. Returned padded
    ``(batch, max_response_len)``, as verl's loss sees them."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    view = data.copy()
    engine_config = worker.engine_config
    micro = engine_config.infer_micro_batch_size_per_gpu or len(data)
    tu.assign_non_tensor(  # the inference pass's settings (a micro-batch size that divides the mini-batch)
        view, calculate_entropy=True, compute_loss=False, use_dynamic_bsz=engine_config.use_dynamic_bsz,
        max_token_len_per_gpu=engine_config.infer_max_token_len_per_gpu,
        micro_batch_size_per_gpu=math.gcd(int(micro), len(data)),
    )
    output = worker.infer_batch(view)
    return no_padding_2_padding(output["log_probs"], data), no_padding_2_padding(output["entropy"], data)


def _patch_legacy_trainer() -> None:
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from .token_selection import ROLLOUT_ENTROPY_FIELD

    original = RayPPOTrainer._compute_old_log_prob
    if getattr(original, "_stapo_wrapped", False):
        return

    @functools.wraps(original)
    def compute_old_log_prob(self, batch):
        old_log_prob, mfu = original(self, batch)
        # the same tensor under a second name: verl pops "entropys" after logging its mean
        old_log_prob.batch[ROLLOUT_ENTROPY_FIELD] = old_log_prob.batch["entropys"]
        return old_log_prob, mfu

    original_update = RayPPOTrainer._update_actor

    @functools.wraps(original_update)
    def update_actor(self, batch):
        metrics = {}
        if ROLLOUT_ENTROPY_FIELD in batch.batch.keys():
            metrics = entropy_quantile_metrics(batch.batch[ROLLOUT_ENTROPY_FIELD], batch.batch["response_mask"])
            if not _needs_rollout_entropy(self.config):
                batch.batch.pop(ROLLOUT_ENTROPY_FIELD)  # baselines: do not ship it to the actor
        output = original_update(self, batch)
        output.meta_info["metrics"].update(metrics)
        return output

    compute_old_log_prob._stapo_wrapped = True
    RayPPOTrainer._compute_old_log_prob = compute_old_log_prob
    RayPPOTrainer._update_actor = update_actor


def _patch_v1_trainer() -> None:
    import transfer_queue as tq

    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.workers.utils.padding import response_from_nested

    from .token_selection import ROLLOUT_ENTROPY_FIELD, SUM_PI_SQUARED_FIELD, to_padded

    original = PPOTrainer._compute_old_log_prob
    if getattr(original, "_stapo_wrapped", False):
        return

    @functools.wraps(original)
    def compute_old_log_prob(self, batch, metrics):
        """Adds the step's entropy quantiles to ``metrics``, and honours
        ``actor.calculate_sum_pi_squared`` (the legacy trainer does, the v1 one does not): asks the
        worker for it and stores it per response token, as ``old_log_probs``. One read of the
        queue serves both."""
        wanted = self.config.actor_rollout_ref.actor.get("calculate_sum_pi_squared", False)
        if wanted:
            batch.extra_info["calculate_sum_pi_squared"] = True
        batch = original(self, batch, metrics)
        batch.extra_info["calculate_sum_pi_squared"] = False  # the update must not compute it
        if _bypasses_old_log_prob(self.config):  # old_log_probs = rollout log-probs: no entropy computed
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

    compute_old_log_prob._stapo_wrapped = True
    PPOTrainer._compute_old_log_prob = compute_old_log_prob


def _bypasses_old_log_prob(config) -> bool:
    """verl's rollout-correction bypass mode: old log-probs are the rollout's, none recomputed."""
    rollout_corr = config.algorithm.get("rollout_correction", None)
    return bool(rollout_corr and rollout_corr.get("bypass_mode", False))


def _needs_rollout_entropy(config) -> bool:
    """The driver's question to the policy-loss settings (it holds them as a DictConfig): does the
    actor need the rollout-time entropy in its batch? Only the recipe's token selection does."""
    from verl.utils.config import omega_conf_to_dataclass

    from .config import TokenSelectionLossConfig

    settings = omega_conf_to_dataclass(config.actor_rollout_ref.actor.policy_loss)
    return isinstance(settings, TokenSelectionLossConfig) and settings.needs_rollout_entropy
