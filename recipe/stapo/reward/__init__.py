"""Rewards of the STAPO recipe (re-exports only; each idea lives in its own module).

docs/reward.md lists the modules. Importing the package (or any of its modules) checks
``STAPO_REWARD_WORKERS`` (:func:`~recipe.stapo.reward.guard.workers_from_env`): an invalid value
stops the importing process at its start with an error naming it.
"""

from recipe.stapo.reward.answers import (
    MAX_GROUND_TRUTH_CHARS,
    ground_truth_problem,
    ground_truth_text,
    last_boxed_content,
    normalize_answer,
    symbolic_equal,
)
from recipe.stapo.reward.guard import RewardConfigError, TimeLimitedRunner
from recipe.stapo.reward.lenient import TAIL_CHARS, compute_score_lenient
from recipe.stapo.reward.strict import strict_score
from recipe.stapo.reward.dispatch import SCORE_BY_SOURCE, compute_score, math_verify_score

__all__ = [
    "MAX_GROUND_TRUTH_CHARS",
    "TAIL_CHARS",
    "RewardConfigError",
    "SCORE_BY_SOURCE",
    "TimeLimitedRunner",
    "compute_score",
    "compute_score_lenient",
    "ground_truth_problem",
    "ground_truth_text",
    "last_boxed_content",
    "math_verify_score",
    "normalize_answer",
    "strict_score",
    "symbolic_equal",
]
