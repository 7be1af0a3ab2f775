"""Compose and validate the recipe's Hydra config without starting anything (tests, scripts)."""

from __future__ import annotations

from typing import Sequence

from omegaconf import DictConfig

METHODS = ("grpo", "entropy20", "justrl", "stapo")
MODELS = ("qwen3_1_7b", "qwen3_8b", "qwen3_14b")


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """The config ``python -m recipe.stapo.main_stapo <overrides>`` would run with.

    Raises ``ValueError`` naming the group for an unknown ``method=`` or ``model=``.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import MissingConfigException

    from recipe.stapo.main_stapo import CONFIG_DIR, CONFIG_NAME

    for override in overrides:
        for group, valid in (("method", METHODS), ("model", MODELS)):
            if override.startswith(group + "=") and override.split("=", 1)[1] not in valid:
                raise ValueError(f"unknown {group} {override.split('=', 1)[1]!r}: expected one of {list(valid)}")
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
            return hydra_compose(config_name=CONFIG_NAME, overrides=list(overrides))
    except MissingConfigException as e:
        raise ValueError(str(e)) from e


def validate(config: DictConfig) -> None:
    """verl's own validation (as in ``verl.trainer.main_ppo.main``): instantiates the actor config
    dataclass, so S2T settings are checked here, in the driver, before any worker starts."""
    from hydra.errors import InstantiationException

    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    try:
        validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    except InstantiationException as e:
        if isinstance(e.__cause__, ValueError):  # a bad value in a config dataclass: show its own message
            raise ValueError(str(e.__cause__)) from None
        raise
