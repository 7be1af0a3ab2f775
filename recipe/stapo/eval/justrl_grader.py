"""JustRL's rule-based answer grader, the first stage of the ``justrl`` grading protocol (docs/eval.md).

JustRL's ``grade_answer_verl`` (docs/eval.md tables how it differs from the lenient grader); its
sympy stage runs in guard helpers of its own under a hard time limit (JustRL's has none): a check
that cannot run to its end leaves the answer ungraded, never wrong.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from recipe.stapo.reward.lenient import Graded, check_symbolic

_UNITS = (
    "degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
    "year", "foot", "feet", "inch", "yard",
)


def boxed_answer(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` of ``text`` (braces counted from the last ``\\boxed``),
    or None: no ``\\boxed``, the box never closes, or ``\\boxed`` is not directly followed by ``{``."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    depth = 0
    for end in range(start, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                box = text[start : end + 1]
                return box[len("\\boxed{") : -1] if box.startswith("\\boxed{") else None
    return None


def mathd_equal(pred: str, gold: str) -> bool:
    """Equal after the MATH (Hendrycks) answer normalisation."""
    # verl (seconds) loads on the first answer graded, not when the grader module is imported
    from verl.utils.reward_score.prime_math.math_normalize import normalize_answer

    return normalize_answer(gold) == normalize_answer(pred)


def sympy_normalize(expr: str) -> str:
    """The sympy stage's normalisation, as JustRL's grader writes it: strip an enclosing
    ``\\text{}``, dollar and percent signs, words for 10^6/9/12, listed units and degree marks, one
    pair of enclosing braces, ``,\\!`` separators; integral floats become integers; LaTeX is turned
    into text; spaces and leftover braces are deleted; lower case; integers canonical."""
    # verl (seconds) loads on the first answer graded, not when the grader module is imported
    from verl.utils.reward_score.prime_math import (
        _inject_implicit_mixed_number,
        _is_float,
        _is_int,
        _parse_latex,
        _str_is_int,
        _str_to_int,
    )

    found = re.search(r"^\\text\{(?P<text>.+?)\}$", expr)
    if found is not None:
        expr = found.group("text")
    for old, new in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                     ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")):
        expr = expr.replace(old, new)
    for unit in _UNITS:
        expr = re.sub(f"{unit}(es)?(s)? *(\\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr[:1] == "{" and expr[-1:] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    if _is_float(expr) and _is_int(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        try:
            expr = _parse_latex(expr)
        except Exception:  # noqa: BLE001 - unparsable LaTeX stays as written, as in the reference
            pass
    expr = re.sub("- *", "-", expr)
    expr = _inject_implicit_mixed_number(expr)
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _str_is_int(expr):
        expr = str(_str_to_int(expr))
    return expr


def sympy_equal(pred: str, gold: str) -> bool:
    """The sympy stage, run in a guard helper process: both answers normalised (:func:`sympy_normalize`)
    are equal strings, or split into tuple elements that pair up, each pair equal as written when both
    are fractions, wrong when exactly one is an integer, else equal when sympy simplifies their
    difference to 0."""
    # verl (seconds) loads on the first answer graded, not when the grader module is imported
    from verl.utils.reward_score.prime_math import _is_frac, _str_is_int, are_equal_under_sympy, split_tuple

    simplify_equal = getattr(are_equal_under_sympy, "__wrapped__", are_equal_under_sympy)  # the guard bounds the time
    norm_gold, norm_pred = sympy_normalize(gold), sympy_normalize(pred)
    if norm_gold == norm_pred:
        return True
    if not norm_pred:
        return False
    gold_elems, pred_elems = split_tuple(norm_gold), split_tuple(norm_pred)
    if len(gold_elems) > 1 and (norm_gold[0] != norm_pred[0] or norm_gold[-1] != norm_pred[-1]):
        return False
    if len(gold_elems) != len(pred_elems):
        return False
    for g, p in zip(gold_elems, pred_elems):
        if _is_frac(g) and _is_frac(p):
            same = g == p
        elif _str_is_int(g) != _str_is_int(p):
            same = False
        else:
            same = bool(simplify_equal(g, p))
        if not same:
            return False
    return True


def warm_up() -> None:
    """Import sympy and verl's grader and run one comparison (a guard helper's warm-up)."""
    sympy_equal("\\frac{1}{2}", "0.5")


WARM_UP = f"{__name__}:warm_up"  # the warm-up of this grader's guard helpers (their runner's key)


def grade_answer(solution_str: Any, ground_truth: Any, timeout_s: float) -> Graded:
    """Grade one response with JustRL's grader: ``pred`` is the last box's content; ``correct`` None
    when the sympy stage could not run to its end. Raises only
    :class:`~recipe.stapo.reward.guard.RewardConfigError` (an invalid ``STAPO_REWARD_WORKERS``)."""
    text = solution_str if isinstance(solution_str, str) else str(solution_str)
    gold = "" if ground_truth is None else str(ground_truth)
    if not gold:
        return Graded(False, boxed_answer(text))
    if "\\boxed" in gold:
        gold = boxed_answer(gold)
    pred = boxed_answer(text)
    if pred is None or gold is None:
        return Graded(False, pred)
    if mathd_equal(pred, gold):
        return Graded(True, pred)
    verdict, status = check_symbolic(WARM_UP, sympy_equal, (pred, gold), timeout_s, "justrl grader")
    return Graded(verdict, pred, status)
