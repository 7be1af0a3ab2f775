"""The CPU path: tiny offline assets (:mod:`.assets`) and verl's real trainer run on CPU with them
(:mod:`.trainer`). Re-exports only."""

from recipe.stapo.driver import METHODS
from recipe.stapo.metrics import METRICS_FILE, read_metrics

from .trainer import CPURun, cpu_env, cpu_overrides, run_cpu_trainer, trainer_command

__all__ = ["CPURun", "METHODS", "METRICS_FILE", "cpu_env", "cpu_overrides", "read_metrics", "run_cpu_trainer",
           "trainer_command"]
