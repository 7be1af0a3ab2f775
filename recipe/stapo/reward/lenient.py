"""The lenient reward: normalised-string or symbolic equality, time-bounded. Used by the evaluation.

A response is correct when the content of its *last* ``\\boxed{...}`` (or ``\\fbox{...}``) inside
its final :data:`TAIL_CHARS` characters equals the ground truth after normalisation
(:func:`~recipe.stapo.reward.answers.normalize_answer`: verl's DAPO normalisation plus LaTeX
spellings and list-aware commas, so that the list ``2, 3`` never equals the number 23), or, when
the strings differ, when ``math_verify`` proves the two answers equal, except that an interval (or
pair) never equals a set (``math_verify`` alone counts ``(1,2)`` equal to ``\\{1,2\\}``). The readings
of ambiguous spellings are listed in ``docs/reward.md``.

It accepts more answers than the training reward (:mod:`recipe.stapo.reward.strict`): ``0.5``
for ``\\frac12``, ``5 cm`` for ``5``, a box anywhere in the last 300 characters. The evaluation
grades with it (:mod:`recipe.stapo.eval.grade`); training can use it with
``reward.custom_reward_function.name=compute_score_lenient``.

Time bound of one grading, whatever the input: the response is cut to its last ``TAIL_CHARS``
characters and a ground truth longer than ``MAX_GROUND_TRUTH_CHARS`` never matches, so the work
done in the caller's thread (extraction, normalisation of both answers, string comparison) is on
at most ``TAIL_CHARS + MAX_GROUND_TRUTH_CHARS`` characters (tens of milliseconds at worst); the
symbolic stage, the only one without such a bound, runs in a guard helper process that is killed
after ``timeout_s`` seconds (:mod:`recipe.stapo.reward.guard`). A killed or failed check counts
the answer as wrong.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from recipe.stapo.reward.answers import (
    ground_truth_text,
    interval_set_mismatch,
    last_boxed_content,
    normalize_answer,
    symbolic_equal,
)
from recipe.stapo.reward.guard import RewardConfigError, get_runner
from recipe.stapo.reward.strict import CORRECT_SCORE, WRONG_SCORE

logger = logging.getLogger(__name__)

TAIL_CHARS = 300
"""Only the last ``TAIL_CHARS`` characters of a response are searched for ``\\boxed{}``."""

DEFAULT_TIMEOUT_S = 5.0
"""Hard wall-clock limit (seconds) of one symbolic comparison."""

symbolic_check: Callable[..., bool] = symbolic_equal
"""The function the guard runs for the symbolic stage (module attribute so tests can substitute
it); called as ``symbolic_check(pred, gold, norm_pred, norm_gold, inner_timeout_s)``."""

_UNAVAILABLE_WARNED = False
_WARM_UP = "recipe.stapo.reward.answers:warm_up_symbolic"


def answers_equivalent(pred: str, gold: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """True when ``pred`` and ``gold`` are equal after normalisation or symbolically.

    Args:
        pred: an extracted answer (short: callers take it from a response tail).
        gold: a ground truth string of at most ``MAX_GROUND_TRUTH_CHARS`` characters.
        timeout_s: hard limit of the symbolic stage.
    Raises only :class:`~recipe.stapo.reward.guard.RewardConfigError` (an invalid
    ``STAPO_REWARD_WORKERS``); never runs longer than about ``timeout_s`` (plus a one-off helper
    start).
    """
    norm_pred, norm_gold = normalize_answer(pred), normalize_answer(gold)
    if not norm_pred or not norm_gold:
        return False
    if norm_pred == norm_gold:
        return True
    if interval_set_mismatch(norm_pred, norm_gold):  # math_verify alone counts (1,2) equal to {1,2}
        return False
    inner = max(1, int(timeout_s / 3))
    status, value = get_runner(_WARM_UP).call(symbolic_check, (pred, gold, norm_pred, norm_gold, inner), timeout_s)
    if status == "err":
        logger.warning("reward: symbolic check failed (%s); counting the answer as wrong", value)
    if status == "unavailable":
        _warn_unavailable(value)
    return status == "ok" and bool(value)


def _warn_unavailable(message: str) -> None:
    global _UNAVAILABLE_WARNED
    if not _UNAVAILABLE_WARNED:
        logger.warning("reward: symbolic check disabled, no guard worker could start (%s)", message)
        _UNAVAILABLE_WARNED = True


def grade_solution(solution_str: Any, ground_truth: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[bool, Optional[str]]:
    """Grade one response with the lenient rule.

    Args:
        solution_str: the decoded response (non-strings are converted with ``str``).
        ground_truth: the reference answer (see :func:`~recipe.stapo.reward.answers.ground_truth_text`;
            an unusable one, e.g. None or empty, is never matched).
        timeout_s: hard limit of the symbolic stage.
    Returns:
        ``(correct, pred)``: ``pred`` is the last box content in the final ``TAIL_CHARS``
        characters, or None when there is none.
    """
    text = solution_str if isinstance(solution_str, str) else str(solution_str)
    pred = last_boxed_content(text[-TAIL_CHARS:])
    gold = ground_truth_text(ground_truth)
    if pred is None or gold is None:
        return False, pred
    return answers_equivalent(pred, gold, timeout_s), pred


def compute_score_lenient(data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None, **kwargs: Any) -> dict:
    """verl custom reward function: the lenient reward (+1 correct / -1 wrong).

    Select it for training with ``reward.custom_reward_function.name=compute_score_lenient``.

    Args:
        data_source: dataset name (unused).
        solution_str: decoded response text.
        ground_truth: reference answer.
        extra_info: per-row info from the parquet (unused).
        **kwargs: ``timeout_s`` (float, default ``DEFAULT_TIMEOUT_S``; settable through
            ``reward.custom_reward_function.reward_kwargs``); anything else verl passes is ignored.
    Returns:
        ``{"score": float (+1.0 or -1.0), "acc": bool, "pred": str | None}``.
    Raises:
        RewardConfigError: ``STAPO_REWARD_WORKERS`` is invalid (never for any response or ground truth).
    """
    timeout_s = float(kwargs.get("timeout_s", DEFAULT_TIMEOUT_S))
    try:
        correct, pred = grade_solution(solution_str, ground_truth, timeout_s)
    except RewardConfigError:
        raise  # a misconfigured process must stop, not score every answer -1
    except Exception as exc:  # noqa: BLE001 - a reward must never crash a worker because of an answer
        logger.warning("reward: grading failed (%s: %s); scoring -1", type(exc).__name__, exc)
        correct, pred = False, None
    return {"score": CORRECT_SCORE if correct else WRONG_SCORE, "acc": bool(correct), "pred": pred}
