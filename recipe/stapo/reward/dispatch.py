"""The recipe's verl reward function: JustRL's reward for each row, chosen by its ``data_source``.

As JustRL's verl fork: the benchmarks' rows get Math-Verify (:data:`SCORE_BY_SOURCE`, run in a guard
helper's main thread because its time limits are signal-based), every other row the strict reward
(docs/reward.md, "Which reward a row gets").
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
    """``(score, pred)`` of JustRL's Math-Verify check, run in a guard helper: ``math_metric`` with
    the gold read as LaTeX from ``\\boxed{gold}`` and the whole ``solution`` as an expression or
    LaTeX; 1.0 or 0.0 (also on any failure, ``math_verify``'s own time limits included), and the
    first reading of the solution (None when there is none)."""
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
    """JustRL's validation reward: ``{"score": 1.0 or 0.0, "acc": bool, "pred": str | None}``
    (:func:`math_verify_match`); a check past :data:`MATH_VERIFY_TIMEOUT_S` scores JustRL's
    timeout score, 0.0. Never raises for any answer."""
    gold = ground_truth_text(ground_truth)
    if gold is None:
        return {"score": 0.0, "acc": False, "pred": None}
    status, value = get_runner(_WARM_UP).call(_MATH_VERIFY, (str(solution_str), gold), MATH_VERIFY_TIMEOUT_S)
    if status != "ok":
        logger.warning("Math-Verify reward: the check did not finish (%s: %s); scoring 0", status, value)
        value = (0.0, None)
    return {"score": value[0], "acc": value[0] > 0, "pred": value[1]}


SCORE_BY_SOURCE = {name: math_verify_score for name in ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")}
"""``data_source`` -> reward for the rows that do not get the strict reward: the benchmarks of
:data:`recipe.stapo.data.prepare.BENCHMARK_SPECS`."""


def compute_score(data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None, **kwargs: Any) -> dict:
    """verl custom reward function: the reward :data:`SCORE_BY_SOURCE` names for ``data_source``,
    else the strict training reward (+1 / -1). Every row returns the keys ``score``, ``acc`` and
    ``pred``, so a batch of several sources gathers one set of extra info; ``extra_info`` and
    anything else verl passes (``reward_router_address``, ...) are ignored."""
    return SCORE_BY_SOURCE.get(data_source, strict_score)(solution_str, ground_truth)
