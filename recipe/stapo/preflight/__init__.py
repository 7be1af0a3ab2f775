"""Preflight: what would fail on the cluster (some of it hours in) or run silently wrong, refused in
the driver before Ray starts, every refusal naming the key or path and the fix (docs/preflight.md
lists every check). Importing this module imports no verl.
"""
from .paths import probe_writable
from .problem import PreflightError, Problem, Report
from .run import check, problems_of, summary
from .values import check_environment

__all__ = ["PreflightError", "Problem", "Report", "check", "check_environment", "probe_writable", "problems_of",
           "summary"]
