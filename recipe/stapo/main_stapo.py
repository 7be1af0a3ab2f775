"""Entry point: ``python -m recipe.stapo.main_stapo method=stapo model=qwen3_8b [overrides...]``.

A thin Hydra entry over verl's own ``run_ppo`` (like verl-recipe's DAPO): the config is
``config/stapo_trainer.yaml`` (verl's ``ppo_trainer`` plus the paper's shared settings), the
``method`` and ``model`` groups select the rest, and every key stays overridable. What the driver
does to the config before verl gets it is :func:`recipe.stapo.driver.prepare`.

Check a config without starting Ray (seconds): add ``--check`` or set ``STAPO_DRY_RUN=1``; the
command then runs the preflight on the whole composed config (docs/preflight.md: paths, names,
numbers, GPU memory), prints what it would run and exits. Without it the same preflight runs before
Ray starts, and a refused config stops the driver with every problem listed (exit status 1).
"""

from __future__ import annotations

import os
import sys

from recipe.stapo.driver import (CONFIG_DIR, CONFIG_NAME, MODELS, PreflightError, check_environment,
                                 ensure_patch_module_env, override_problems, prepare)
from recipe.stapo.preflight import summary
from recipe.stapo.methods import METHODS

ensure_patch_module_env()  # before verl is imported: local Ray workers inherit it

import hydra  # noqa: E402

CHECK_FLAG = "--check"
HELP_FLAGS = ("--help", "-h")


def usage() -> str:
    """The command's short help: what it takes, the methods and models, where every key is documented
    (Hydra's own ``--help`` would compose and print the whole config, over a thousand lines)."""
    return f"""usage: python -m recipe.stapo.main_stapo method=<method> model=<model> [key=value ...] [--check]

Trains with verl's PPO trainer under the paper's settings (recipe/stapo/config/stapo_trainer.yaml,
which starts from verl's ppo_trainer); every key stays a Hydra override.

  method=   {', '.join(METHODS)}   (recipe/stapo/config/method/)
  model=    {', '.join(MODELS)}   (recipe/stapo/config/model/)
  --check   run every check that can be made before Ray starts, print what would run, and stop
            (the same as STAPO_DRY_RUN=check; docs/preflight.md)
  --cfg job print the whole composed config and stop (Hydra); --hydra-help: Hydra's own options

The recipe's keys (actor_rollout_ref.actor.policy_loss.*): docs/method.md; metrics: docs/metrics.md;
launching on a cluster: docs/cluster.md; the run scripts run_scripts/qwen3_*_*.sh are these overrides.
"""


def run(config, check: bool = False) -> None:
    """Prepare ``config`` in the driver, then train with verl's trainer (``check``: stop before Ray)."""
    # verl (seconds to import) loads only when a run starts, not for --help
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    prepare(config)
    if check:
        print(f"[stapo] config OK (nothing started):\n{summary(config)}")
        return
    print(f"[stapo] starting:\n{summary(config)}")
    if config.trainer.use_v1:
        run_ppo(config, task_runner_class=TaskRunnerV1)
    else:
        from verl.trainer.main_ppo_v0 import TaskRunner  # only the legacy trainer needs it

        run_ppo(config, task_runner_class=TaskRunner)


def check_requested(argv: list[str], environ=os.environ) -> bool:
    """True for ``--check`` in ``argv`` (removed from it, Hydra would refuse it) or ``STAPO_DRY_RUN=1``."""
    flag = CHECK_FLAG in argv
    while CHECK_FLAG in argv:
        argv.remove(CHECK_FLAG)
    return flag or environ.get("STAPO_DRY_RUN", "0") not in ("", "0")


def main() -> None:
    if any(flag in sys.argv[1:] for flag in HELP_FLAGS):
        print(usage(), end="")
        return
    check = check_requested(sys.argv)
    refused = override_problems(sys.argv[1:])  # before Hydra records the overrides (or names no fix for them)
    if refused:
        print("[stapo] override refused (nothing was started):\n" + "\n".join(f"  - {r}" for r in refused),
              file=sys.stderr)
        raise SystemExit(1)
    early = check_environment()  # what `import verl` inside Hydra's config loading reads: a failure there names nothing
    if early:
        print(f"[stapo] {PreflightError(early)}", file=sys.stderr)
        raise SystemExit(1)

    @hydra.main(config_path=CONFIG_DIR, config_name=CONFIG_NAME, version_base=None)
    def entry(config) -> None:
        try:
            run(config, check=check)
        except PreflightError as e:  # the list of problems is the whole message: no traceback
            print(f"[stapo] {e}", file=sys.stderr)
            raise SystemExit(1) from None

    entry()


if __name__ == "__main__":
    main()
