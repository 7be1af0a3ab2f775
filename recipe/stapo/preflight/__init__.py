"""The preflight (docs/preflight.md): what would fail on the cluster, refused before Ray. Imports no verl."""
from .problem import PreflightError, Problem, Report
from .run import check, problems_of, summary
from .values import check_environment

__all__ = ["PreflightError", "Problem", "Report", "check", "check_environment", "problems_of", "summary"]
