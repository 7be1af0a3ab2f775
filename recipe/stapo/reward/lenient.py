"""The lenient reward: normalised-string or symbolic equality, time-bounded. Used by the evaluation.

docs/reward.md ("Lenient reward") says when an answer is correct. The symbolic stage runs in a
guard helper killed after ``timeout_s`` (:mod:`recipe.stapo.reward.guard`); a check that could not
run to its end leaves the answer *ungraded* (:class:`Graded` ``correct=None``), never wrong.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple, Optional

from recipe.stapo.reward.answers import (
    ground_truth_text,
    interval_set_mismatch,
    last_boxed_content,
    normalize_answer,
    symbolic_equal,
)
from recipe.stapo.reward.guard import UNGRADED_STATUSES, RewardConfigError, get_runner
from recipe.stapo.reward.strict import CORRECT_SCORE, WRONG_SCORE

logger = logging.getLogger(__name__)

TAIL_CHARS = 300  # only the last TAIL_CHARS characters of a response are searched for \boxed{}
DEFAULT_TIMEOUT_S = 5.0  # hard wall-clock limit (seconds) of one symbolic comparison

# what the guard runs for the symbolic stage, as symbolic_check(pred, gold, norm_pred, norm_gold)
# (a module attribute so that tests can substitute it)
symbolic_check: Callable[..., bool] = symbolic_equal

_WARM_UP = "recipe.stapo.reward.answers:warm_up_symbolic"


class Graded(NamedTuple):
    """A grader's reading of one response: ``correct`` None when the answer is *ungraded* (its
    check could not run to its end), ``pred`` None when there is no box where the grader looks,
    ``status`` ``ok`` or the :data:`~recipe.stapo.reward.guard.UNGRADED_STATUSES` value saying why."""

    correct: Optional[bool]
    pred: Optional[str]
    status: str = "ok"


def check_symbolic(runner_warm_up: str, fn: Any, args: tuple, timeout_s: float, who: str) -> tuple[Optional[bool], str]:
    """Run a grader's symbolic stage ``fn(*args)`` in the guard helpers warmed up by
    ``runner_warm_up``; ``(verdict, status)``: ``(bool, "ok")``, ``(False, "ok")`` when ``fn`` raised
    (the check ran and did not show the answers equal; logged), or ``(None, status)`` when it could
    not run to its end (:data:`~recipe.stapo.reward.guard.UNGRADED_STATUSES`)."""
    status, value = get_runner(runner_warm_up).call(fn, args, timeout_s)
    if status == "ok":
        return bool(value), "ok"
    if status in UNGRADED_STATUSES:
        if status != "timeout":
            logger.warning("%s: the symbolic check could not run (%s: %s); the answer is ungraded", who, status, value)
        return None, status
    logger.warning("%s: symbolic check failed (%s); the answers are not shown equal", who, value)
    return False, "ok"


def answers_equivalent(pred: str, gold: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Graded:
    """Whether ``pred`` (short: taken from a response tail) and ``gold`` (at most
    ``MAX_GROUND_TRUTH_CHARS`` characters) are equal after normalisation or symbolically. Raises only
    :class:`~recipe.stapo.reward.guard.RewardConfigError` (an invalid ``STAPO_REWARD_WORKERS``);
    never runs longer than about ``timeout_s`` (plus a one-off helper start)."""
    norm_pred, norm_gold = normalize_answer(pred), normalize_answer(gold)
    if not norm_pred or not norm_gold:
        return Graded(False, pred)
    if norm_pred == norm_gold:
        return Graded(True, pred)
    if interval_set_mismatch(norm_pred, norm_gold):  # math_verify alone counts (1,2) equal to {1,2}
        return Graded(False, pred)
    verdict, status = check_symbolic(_WARM_UP, symbolic_check, (pred, gold, norm_pred, norm_gold), timeout_s,
                                     "lenient grader")
    return Graded(verdict, pred, status)


def grade_answer(solution_str: Any, ground_truth: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> Graded:
    """Grade one response with the lenient grader: ``pred`` is the last box content in its final
    ``TAIL_CHARS`` characters; an unusable ground truth (None, empty...) is never matched."""
    text = solution_str if isinstance(solution_str, str) else str(solution_str)
    pred = last_boxed_content(text[-TAIL_CHARS:])
    gold = ground_truth_text(ground_truth)
    if pred is None or gold is None:
        return Graded(False, pred)
    return answers_equivalent(pred, gold, timeout_s)


def compute_score_lenient(data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None, **kwargs: Any) -> dict:
    """verl custom reward function: the lenient reward (+1 correct / -1 wrong), selected with
    ``reward.custom_reward_function.name=compute_score_lenient``.

    ``kwargs`` may hold ``timeout_s``; anything else verl passes is ignored. Returns ``{"score": +1.0
    or -1.0, "acc", "pred", "ungraded"}``: ``ungraded`` when the symbolic check could not run (scored
    -1). Raises only RewardConfigError (an invalid ``STAPO_REWARD_WORKERS``), never for an answer.
    """
    timeout_s = float(kwargs.get("timeout_s", DEFAULT_TIMEOUT_S))
    try:
        graded = grade_answer(solution_str, ground_truth, timeout_s)
    except RewardConfigError:
        raise  # a misconfigured process must stop, not score every answer -1
    except Exception as exc:  # noqa: BLE001 - a reward must never crash a worker because of an answer
        logger.warning("reward: grading failed (%s: %s); scoring -1", type(exc).__name__, exc)
        graded = Graded(False, None)
    correct = graded.correct is True
    return {"score": CORRECT_SCORE if correct else WRONG_SCORE, "acc": correct, "pred": graded.pred,
            "ungraded": graded.correct is None}
