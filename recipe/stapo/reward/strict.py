"""The training reward: JustRL's, i.e. verl's own ``math_dapo.compute_score`` with strict box verification.

docs/reward.md spells out what verl's function compares. This module adds one
rule: a ground truth that :func:`recipe.stapo.reward.answers.ground_truth_text` rejects is never
matched (verl alone would score +1.0 for ``None`` against a response without a box), and a
non-string one is converted first by the data preparation's rule
(:func:`recipe.stapo.reward.answers.ground_truth_conversion`).
"""

from __future__ import annotations

import logging
from typing import Any

from recipe.stapo.reward.answers import ground_truth_text

logger = logging.getLogger(__name__)

CORRECT_SCORE = 1.0
WRONG_SCORE = -1.0


def strict_score(solution_str: Any, ground_truth: Any) -> dict:
    """JustRL's strict DAPO reward: verl's ``{"score": +1.0 or -1.0, "acc", "pred"}``, ``pred`` the
    content of the box verl found. Never raises."""
    # verl (seconds) loads on the first score, in the reward worker, not when the module is imported
    from verl.utils.reward_score.math_dapo import compute_score as verl_math_dapo_score

    text = solution_str if isinstance(solution_str, str) else str(solution_str)
    gold = ground_truth_text(ground_truth)
    try:
        result = verl_math_dapo_score(text, gold, strict_box_verify=True) if gold is not None else None
    except Exception as exc:  # noqa: BLE001 - a reward must never crash a worker
        logger.warning("reward: grading failed (%s: %s); scoring -1", type(exc).__name__, exc)
        result = None
    if result is None:
        return {"score": WRONG_SCORE, "acc": False, "pred": None}
    return {"score": float(result["score"]), "acc": bool(result["acc"]), "pred": result["pred"]}
