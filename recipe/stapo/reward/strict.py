"""The training reward: JustRL's, i.e. verl's own ``math_dapo.compute_score`` with strict box verification.

:func:`strict_score` is what :func:`recipe.stapo.reward.dispatch.compute_score` (the function the
recipe's YAML names) gives every training row and every row that is not a benchmark's.

verl 0.9.1's ``verl.utils.reward_score.math_dapo.compute_score(solution_str, ground_truth,
strict_box_verify=True)`` keeps the last 300 characters of the response, takes the last
``\\boxed{...}`` inside their final 100 characters and compares its content with the ground truth
by exact string equality: +1.0 when equal, -1.0 otherwise (no box, box earlier in the response,
``\\fbox``, ``0.5`` against ``1/2``, ``\\dfrac`` against ``\\frac``, an extra space...). No
normalisation, no symbolic check. This module calls that function; it adds only one rule:

* a ground truth that :func:`recipe.stapo.reward.answers.ground_truth_text` rejects (None, empty,
  whitespace only, not a string or number, longer than ``MAX_GROUND_TRUTH_CHARS``) is never
  matched: -1.0. verl alone would score +1.0 for ``None`` against a response without a box (its
  "no box" ``None`` equals the ``None`` ground truth) and for ``""`` against ``\\boxed{}``.

A ground truth that is not a string is converted to one first, by the rule the data preparation
writes with (:func:`recipe.stapo.reward.answers.ground_truth_conversion`): ``12`` -> ``"12"``,
``0.5`` -> ``"0.5"``, ``[1, 2]`` -> ``"1, 2"`` (verl would compare a string with a number or a list
and never match). The data preparation writes strings, for which the result is verl's, unchanged.

Time: verl's function only ever looks at 300 characters of the response and compares two strings,
so a call takes microseconds whatever the input's length; no helper process is involved, and the
paper's reward never depends on one.

verl 0.9.1's reward managers call the configured function with ``data_source=...,
solution_str=..., ground_truth=..., extra_info=..., **reward_kwargs`` and log every key of the
returned dict as ``reward_extra_info``.
"""

from __future__ import annotations

import logging
from typing import Any

from recipe.stapo.reward.answers import ground_truth_text

logger = logging.getLogger(__name__)

CORRECT_SCORE = 1.0
WRONG_SCORE = -1.0


def strict_score(solution_str: Any, ground_truth: Any) -> dict:
    """JustRL's strict DAPO reward (+1 correct / -1 wrong).

    Args:
        solution_str: decoded response text (a non-string is converted with ``str``).
        ground_truth: reference answer (see :func:`~recipe.stapo.reward.answers.ground_truth_text`).
    Returns:
        ``{"score": float (+1.0 or -1.0), "acc": bool, "pred": str | None}``: verl's result; ``pred``
        is the content of the box verl found. Never raises.
    """
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
