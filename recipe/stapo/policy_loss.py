"""The policy-loss settings of a composed config, built once: the dataclass verl builds in every
worker (``verl_patches.policy_loss_config.TokenSelectionLossConfig``), whose properties say which selection
runs where, which extra forwards and entropies a run needs. The driver's config handling, the
preflight and the memory model all read these decisions from it."""

from __future__ import annotations

import functools

from omegaconf import DictConfig, OmegaConf

POLICY_LOSS = "actor_rollout_ref.actor.policy_loss"


def settings_of(config: DictConfig):
    """``TokenSelectionLossConfig`` of ``config``'s policy-loss block, or None for a block without
    token selection (verl's own ``PolicyLossConfig``, or none). ``ValueError`` with the dataclass's
    message (naming the key) when the block is invalid."""
    policy_loss = OmegaConf.select(config, POLICY_LOSS)
    if policy_loss is None or not str(policy_loss.get("_target_", "")).endswith("TokenSelectionLossConfig"):
        return None
    try:
        block = OmegaConf.to_yaml(policy_loss, resolve=True)
    except Exception as e:  # noqa: BLE001  (an interpolation that does not resolve)
        raise ValueError(f"{POLICY_LOSS}: {e}") from None
    return _build(block)


@functools.lru_cache(maxsize=16)
def _build(block: str):
    """One dataclass per distinct block (its resolved YAML): built once however often it is asked."""
    # importing this module imports no verl: the driver (recipe.stapo.driver) imports it before VERL_USE_EXTERNAL_MODULES is set
    from verl.utils.config import omega_conf_to_dataclass

    try:
        return omega_conf_to_dataclass(OmegaConf.create(block))
    except Exception as e:  # noqa: BLE001  (hydra wraps the dataclass's ValueError naming the key)
        raise ValueError(str(e.__cause__ or e)) from None
