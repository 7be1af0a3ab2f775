"""Preflight: what would fail on the cluster (some of it hours in) or run silently wrong, refused in
the driver before Ray starts, every refusal naming the key or path and the fix (docs/preflight.md
lists every check).

:func:`check` runs on a config whose interpolations are resolved and whose local paths are absolute
(:func:`recipe.stapo.driver.prepare` calls it, so ``--check`` / ``STAPO_DRY_RUN=check`` and a real
launch run the same checks, the latter also in a submitted job's own driver on the head node). With
``LAUNCH=submit`` a path the launching machine cannot see is a note, not a refusal.

Importing this module imports no verl.
"""
from .paths import probe_writable
from .problem import PreflightError, Problem, Report
from .run import check, problems_of, summary
from .values import check_environment

__all__ = ["PreflightError", "Problem", "Report", "check", "check_environment", "probe_writable", "problems_of",
           "summary"]
