"""Answers: what a ground truth may be, where a response's answer is, and how answers are normalised.

Pure functions, no processes and no timers (the guard is :mod:`recipe.stapo.reward.guard`). Every
function here takes time bounded by the length of its input; the rewards only ever pass them a
ground truth of at most :data:`MAX_GROUND_TRUTH_CHARS` characters and a response tail of at most a
few hundred characters, which is what bounds the work done outside the guard.

verl is imported inside the functions that need it (``normalize_answer``), not at import time: a
bare ``import verl`` also imports torch (seconds, hundreds of MB), which the guard's helper
processes and the data preparation never need.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Optional

MAX_GROUND_TRUTH_CHARS = 1000
"""Longest ground truth (characters) that can match an answer.

A longer one is rejected by the data preparation and never matches in any reward: final answers of
math problems are short (the longest in MATH-500 has 159 characters), and a long text is almost
certainly a worked solution put in the answer field by mistake. The bound also bounds the time of
normalising a ground truth (the normalisation's regular expressions are quadratic in the length).
"""

_BOX_OPENERS = ("\\boxed{", "\\fbox{")

# LaTeX display variants of one value, folded before verl's normalisation (our addition: verl's
# lists do not contain them).
_LATEX_SPELLINGS = (
    ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"),
    ("\\left", ""),
    ("\\right", ""),
    ("\\displaystyle", ""),
    ("\\!", ""),
    ("\\,", ""),
    ("°", ""),
    ("\\%", ""),
    ("%", ""),
)


# ----------------------------------------------------------------------------------------------
# ground truth
# ----------------------------------------------------------------------------------------------
def ground_truth_text(value: Any) -> Optional[str]:
    """The ground truth as a string, or None when no answer can ever match it.

    Accepted: a string; an int or a finite float (``5.0`` -> ``"5"``); a one-or-more element
    list / tuple / numpy array, read as its first element (verl may hand over array cells).
    Unmatchable (None is returned): None, an empty container, any other type (bool, dict, bytes,
    ...), NaN / infinity, an empty or whitespace-only string, a string longer than
    :data:`MAX_GROUND_TRUTH_CHARS`. The returned string is the value itself, not stripped: the
    strict training reward compares it exactly.

    Args:
        value: the ``reward_model.ground_truth`` cell of a row.
    Returns:
        str (1..MAX_GROUND_TRUTH_CHARS characters, not only whitespace) or None.
    """
    if hasattr(value, "tolist") and not isinstance(value, str):  # numpy arrays and scalars
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if not value:
            return None
        value = value[0]
        if hasattr(value, "tolist") and not isinstance(value, str):
            value = value.tolist()
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        value = int(value) if value.is_integer() else value
    if isinstance(value, int):
        value = str(value)
    if not isinstance(value, str):
        return None
    if not value.strip() or len(value) > MAX_GROUND_TRUTH_CHARS:
        return None
    return value


def ground_truth_problem(value: Any) -> Optional[str]:
    """Why ``value`` is not a usable ground truth (a short message), or None when it is.

    The reasons mirror :func:`ground_truth_text`; the data preparation reports them per row.
    """
    if ground_truth_text(value) is not None:
        return None
    if value is None:
        return "ground truth is missing (None)"
    if isinstance(value, str):
        if len(value) > MAX_GROUND_TRUTH_CHARS:
            return f"ground truth has {len(value)} characters, more than MAX_GROUND_TRUTH_CHARS={MAX_GROUND_TRUTH_CHARS}"
        return "ground truth is empty"
    if isinstance(value, float):
        return f"ground truth is not a finite number ({value!r})"
    return f"ground truth of unsupported type {type(value).__name__}"


# ----------------------------------------------------------------------------------------------
# extraction and normalisation (the lenient reward and the evaluation)
# ----------------------------------------------------------------------------------------------
def last_boxed_content(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced.

    Args:
        text: any string.
    Returns:
        The content between the outer braces, or None when there is no box or the last box is
        never closed (``"\\boxed{12"``). Linear in ``len(text)``.
    """
    start = max(text.rfind(opener) for opener in _BOX_OPENERS)
    if start < 0:
        return None
    open_at = text.index("{", start)
    depth = 0
    for pos in range(open_at, len(text)):
        char = text[pos]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : pos]
    return None


def normalize_answer(answer: str) -> str:
    """verl's DAPO / Minerva normalisation of a final answer, plus LaTeX-spelling folding.

    Three steps: fold display variants (``\\dfrac``/``\\tfrac`` -> ``\\frac``, ``\\left``/``\\right``,
    ``\\,``, degree and percent signs); verl's own
    ``verl.utils.reward_score.math_dapo.normalize_final_answer`` (right-hand side of ``=``, units and
    words, ``\\text{}``, dollars, spaces, ``\\frac12`` -> ``\\frac{1}{2}``, integer thousands
    separators); finally drop a trailing period (``7.`` -> ``7``, then separators again).

    Time: quadratic in ``len(answer)`` in the worst case (verl's regular expressions); callers pass
    at most :data:`MAX_GROUND_TRUTH_CHARS` characters.

    Args:
        answer: a raw answer string (content of a box or a ground truth).
    Returns:
        The normalised string (may be empty).
    """
    from verl.utils.reward_score.math_dapo import normalize_final_answer

    final = answer
    for before, after in _LATEX_SPELLINGS:
        final = final.replace(before, after)
    final = normalize_final_answer(final).rstrip(".").strip()
    if final.replace(",", "").isdigit():
        final = final.replace(",", "")
    return final


# ----------------------------------------------------------------------------------------------
# symbolic equivalence (runs inside a guard helper process)
# ----------------------------------------------------------------------------------------------
def symbolic_equal(pred: str, gold: str, norm_pred: str, norm_gold: str, inner_timeout_s: int = 2) -> bool:
    """``math_verify`` equivalence of two answers, tried on the raw and on the normalised forms.

    Meant to run in a guard helper's main thread, where ``math_verify``'s signal-based
    ``inner_timeout_s`` works; the guard adds the hard limit. The normalised forms are passed in
    (computed by the caller) so that a helper never imports verl. Returns False on any parse error.
    """
    from math_verify import parse, verify

    main_thread = threading.current_thread() is threading.main_thread()
    kwargs = {"parsing_timeout": inner_timeout_s if main_thread else None}
    verify_timeout = inner_timeout_s if main_thread else None
    for gold_text, pred_text in ((gold, pred), (norm_gold, norm_pred)):
        if not gold_text or not pred_text:
            continue
        try:
            gold_parsed = parse("\\boxed{" + gold_text + "}", **kwargs)
            pred_parsed = parse("\\boxed{" + pred_text + "}", **kwargs)
            if gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=verify_timeout):
                return True
        except Exception:  # noqa: BLE001 - any failure of the symbolic stage means "not shown equal"
            continue
    return False


def warm_up_symbolic() -> None:
    """Import ``math_verify`` and sympy and run one comparison (a guard helper's warm-up, so that
    seconds of imports on a busy machine never count against an answer's time limit)."""
    symbolic_equal("0.5", "\\frac{1}{2}", "0.5", "\\frac{1}{2}")
