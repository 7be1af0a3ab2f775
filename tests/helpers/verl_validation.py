"""verl's own validation of a composed config alone, no file read: what the preflight runs
(:func:`recipe.stapo.preflight.verl_config.check_verl_configs`) without its path and data checks, for
tests that compose configs whose files do not exist here."""

from __future__ import annotations

from omegaconf import DictConfig

from recipe.stapo.preflight import PreflightError, Problem
from recipe.stapo.preflight.verl_config import check_verl_configs


def validate(config: DictConfig) -> None:
    """Raise :class:`PreflightError` naming every problem verl's validation finds in ``config``."""
    found: list[Problem] = []
    check_verl_configs(config, found)
    if found:
        raise PreflightError(found)
