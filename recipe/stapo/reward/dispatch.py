"""The recipe's verl reward function: JustRL's reward for each row, chosen by its ``data_source``.

JustRL's verl fork picks a row's reward by its data source (``default_compute_score`` in its
``verl/utils/reward_score/__init__.py``): its training rows (``math_dapo``) get the strict DAPO
reward, its validation benchmarks (``AIME24``, ``AIME25``, ``AMC23``) Math-Verify. The recipe does
the same through one table, :data:`SCORE_BY_SOURCE`: the benchmarks the data preparation writes
(their ``data_source`` is the benchmark's name) get :func:`math_verify_score`, every other row
(training ``math_dapo``, the tiny task's ``stapo_tiny_addition``, any other) the strict reward
(:func:`recipe.stapo.reward.strict.strict_score`).

Math-Verify as JustRL calls it (its ``reward_score/math_verify.py``): ``math_metric`` with the
gold read as LaTeX from ``\\boxed{ground truth}`` and the whole response read as an expression or
LaTeX, 1.0 when some reading of the response equals the gold, else 0.0 (also on a parse error or
one of ``math_verify``'s own time limits, 5 s per parse and per comparison). Those limits are
signal-based, which works only in a process's main thread, and verl 0.9.1 calls rewards from
executor threads; so the check runs in a guard helper's main thread (:mod:`recipe.stapo.reward.guard`)
with a hard limit of :data:`MATH_VERIFY_TIMEOUT_S` on top. A check that does not end in time scores
JustRL's ``timeout_score``, 0.0 (logged). Every row returns the same keys, ``score``, ``acc`` and
``pred``, so that verl can gather one batch's extra info whatever its sources.

verl entry point: ``reward.custom_reward_function.path=pkg://recipe.stapo.reward``,
``.name=compute_score`` (the recipe's default).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from recipe.stapo.reward.answers import ground_truth_text
from recipe.stapo.reward.guard import get_runner
from recipe.stapo.reward.lenient import _WARM_UP  # the lenient grader's helpers: math_verify and sympy loaded
from recipe.stapo.reward.strict import strict_score

logger = logging.getLogger(__name__)

MATH_VERIFY_TIMEOUT_S = 30.0
"""Hard limit (seconds) of one Math-Verify check, above ``math_verify``'s own limits."""

_MATH_VERIFY = "recipe.stapo.reward.dispatch:math_verify_match"


def math_verify_match(solution: str, gold: str) -> tuple[float, Optional[str]]:
    """``(score, pred)`` of JustRL's Math-Verify check (runs in a guard helper's main thread).

    Args:
        solution: the whole response.
        gold: the ground truth text.
    Returns:
        1.0 or 0.0, and the first reading of the response (None when there is none or the check failed).
    """
    # math_verify (sympy, seconds) loads in the helper, on its warm-up
    from math_verify.metric import math_metric
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    check = math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                        pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))
    try:
        score, texts = check(["\\boxed{" + gold + "}"], [solution])
    except Exception:  # noqa: BLE001 - JustRL's reading: any failure (its own time limits included) scores 0
        return 0.0, None
    return float(score), (texts[1][0] if texts and texts[1] else None)


def math_verify_score(solution_str: Any, ground_truth: Any) -> dict:
    """JustRL's validation reward: Math-Verify, 1.0 correct / 0.0 wrong.

    Returns:
        ``{"score": 1.0 or 0.0, "acc": bool, "pred": str | None}``; never raises for any answer.
    """
    gold = ground_truth_text(ground_truth)
    if gold is None:
        return {"score": 0.0, "acc": False, "pred": None}
    text = solution_str if isinstance(solution_str, str) else str(solution_str)
    status, value = get_runner(_WARM_UP).call(_MATH_VERIFY, (text, gold), MATH_VERIFY_TIMEOUT_S)
    if status != "ok":
        logger.warning("Math-Verify reward: the check did not finish (%s: %s); scoring 0", status, value)
        value = (0.0, None)
    return {"score": value[0], "acc": value[0] > 0, "pred": value[1]}


SCORE_BY_SOURCE = {name: math_verify_score for name in ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")}
"""``data_source`` -> reward for the rows that do not get the strict reward: the benchmarks of
:data:`recipe.stapo.data.prepare.BENCHMARK_SPECS`."""


def compute_score(data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None, **kwargs: Any) -> dict:
    """verl custom reward function: the reward :data:`SCORE_BY_SOURCE` names for ``data_source``,
    else the strict training reward (+1 / -1).

    Args:
        data_source: the row's ``data_source``.
        solution_str: decoded response text.
        ground_truth: reference answer (see :func:`~recipe.stapo.reward.answers.ground_truth_text`).
        extra_info: per-row info from the parquet (unused).
        **kwargs: anything else verl passes (``reward_router_address``, ...) is ignored.
    Returns:
        ``{"score", "acc", "pred"}`` (see :func:`strict_score`, :func:`math_verify_score`).
    """
    return SCORE_BY_SOURCE.get(data_source, strict_score)(solution_str, ground_truth)
