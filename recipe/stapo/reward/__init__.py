"""Rewards of the STAPO recipe (re-exports only; each idea lives in its own module).

docs/reward.md lists the modules. Importing the package (or any of its modules) checks
``STAPO_REWARD_WORKERS`` (:func:`~recipe.stapo.reward.guard.workers_from_env`): an invalid value
stops the importing process at its start with an error naming it.
"""

from recipe.stapo.reward.answers import (
    MAX_GROUND_TRUTH_CHARS,
    ground_truth_conversion,
    ground_truth_problem,
    ground_truth_text,
    interval_set_mismatch,
    last_boxed_content,
    normalize_answer,
    symbolic_equal,
)
from recipe.stapo.reward.guard import (
    UNGRADED_STATUSES,
    WORKERS_ENV,
    RewardConfigError,
    TimeLimitedRunner,
    get_runner,
    workers_from_env,
)
from recipe.stapo.reward.lenient import (
    DEFAULT_TIMEOUT_S,
    TAIL_CHARS,
    Graded,
    answers_equivalent,
    compute_score_lenient,
    grade_answer,
)
from recipe.stapo.reward.strict import CORRECT_SCORE, WRONG_SCORE, strict_score
from recipe.stapo.reward.dispatch import SCORE_BY_SOURCE, compute_score, math_verify_score

__all__ = [
    "CORRECT_SCORE",
    "DEFAULT_TIMEOUT_S",
    "Graded",
    "MAX_GROUND_TRUTH_CHARS",
    "TAIL_CHARS",
    "WORKERS_ENV",
    "WRONG_SCORE",
    "RewardConfigError",
    "SCORE_BY_SOURCE",
    "TimeLimitedRunner",
    "UNGRADED_STATUSES",
    "answers_equivalent",
    "compute_score",
    "compute_score_lenient",
    "get_runner",
    "grade_answer",
    "ground_truth_conversion",
    "ground_truth_problem",
    "ground_truth_text",
    "interval_set_mismatch",
    "last_boxed_content",
    "math_verify_score",
    "normalize_answer",
    "strict_score",
    "symbolic_equal",
    "workers_from_env",
]
