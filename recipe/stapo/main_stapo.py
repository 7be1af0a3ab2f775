"""Entry point: ``python -m recipe.stapo.main_stapo method=stapo model=qwen3_8b [overrides...]``.

A thin Hydra entry over verl's own ``run_ppo`` (like verl-recipe's DAPO): the config is
``config/stapo_trainer.yaml`` (verl's ``ppo_trainer`` plus the paper's shared settings), the
``method`` and ``model`` groups select the rest, and every key stays overridable.
"""

from __future__ import annotations

import os
from pathlib import Path

#: the module every process must import: set before verl is imported (see verl_patches/install.py)
PATCH_MODULE = "verl_patches"
CONFIG_DIR = str(Path(__file__).resolve().parent / "config")
CONFIG_NAME = "stapo_trainer"


def ensure_patch_module_env() -> None:
    """Add ``verl_patches`` to ``VERL_USE_EXTERNAL_MODULES`` (kept if the user set more modules)."""
    modules = [m for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]
    if PATCH_MODULE not in modules:
        modules.insert(0, PATCH_MODULE)
    os.environ["VERL_USE_EXTERNAL_MODULES"] = ",".join(modules)


ensure_patch_module_env()

import hydra  # noqa: E402

from recipe.stapo.config_utils import validate  # noqa: E402


def stringify_ray_env_vars(config) -> None:
    """Ray accepts only string environment variables; the YAML interpolates numbers into them."""
    from omegaconf import open_dict

    env_vars = config.ray_kwargs.ray_init.runtime_env.get("env_vars")
    if env_vars:
        with open_dict(config):
            for key in list(env_vars):
                value = env_vars[key]
                env_vars[key] = "" if value is None else str(value)


def run(config) -> None:
    """Validate ``config`` exactly as verl's ``main_ppo`` does, then train with verl's trainer."""
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    validate(config)
    stringify_ray_env_vars(config)
    if config.trainer.use_v1:
        run_ppo(config, task_runner_class=TaskRunnerV1)
    else:
        from verl.trainer.main_ppo_v0 import TaskRunner

        run_ppo(config, task_runner_class=TaskRunner)


@hydra.main(config_path="config", config_name=CONFIG_NAME, version_base=None)
def main(config) -> None:
    run(config)


if __name__ == "__main__":
    main()
