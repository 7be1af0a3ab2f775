"""A training reward that leaves every other response ungraded, for the trainer runs that check the
per-step count ``reward/ungraded`` (tests/e2e/test_ungraded_e2e_on_cpu.py).

A response whose decoded text has an odd number of characters is reported ``"ungraded": true`` with
the score :data:`UNGRADED_SCORE`, a value no graded response gets, so the count of each step can be
read back independently from the step's rollout dump (``trainer.rollout_data_dir``); the others are
graded by the recipe's default reward (JustRL's, +1 / -1).
"""

from __future__ import annotations

from typing import Any

from recipe.stapo.reward import compute_score as graded_score

#: the score of an ungraded response (graded ones score +1 or -1)
UNGRADED_SCORE = -0.5


def is_ungraded(solution_str: str) -> bool:
    return len(solution_str) % 2 == 1


def compute_score(data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None, **kwargs: Any) -> dict:
    if is_ungraded(str(solution_str)):
        return {"score": UNGRADED_SCORE, "acc": False, "pred": None, "ungraded": True}
    return {**graded_score(data_source, solution_str, ground_truth, extra_info), "ungraded": False}
