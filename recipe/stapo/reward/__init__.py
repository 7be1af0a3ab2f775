"""Rewards of the STAPO recipe (re-exports only; each idea lives in its own module).

- :mod:`~recipe.stapo.reward.dispatch`: ``compute_score``, the function the recipe's YAML names:
  JustRL's reward for each row by its ``data_source`` (Math-Verify for the benchmarks, the strict
  reward for the rest).
- :mod:`~recipe.stapo.reward.strict`: ``strict_score``, the training reward (JustRL's: verl's
  ``math_dapo`` with strict box verification).
- :mod:`~recipe.stapo.reward.lenient`: ``compute_score_lenient`` / ``grade_answer``, normalised or
  symbolic equality, time-bounded; one of the evaluation's rule-based graders, and a training option.
- :mod:`~recipe.stapo.reward.answers`: ground-truth validation, answer extraction, normalisation.
- :mod:`~recipe.stapo.reward.guard`: the process guard (hard wall-clock limit from any thread).

Importing the package (or any of its modules) checks ``STAPO_REWARD_WORKERS``
(:func:`~recipe.stapo.reward.guard.workers_from_env`): an invalid value stops the importing process
at its start, the trainer loading its reward function or the evaluation, with an error naming it.
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
