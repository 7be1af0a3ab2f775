"""Answers: what a ground truth may be, where a response's answer is, and how answers are normalised.

Pure functions, no processes and no timers, each bounded by the length of its input. verl (which
imports torch) loads only inside ``normalize_answer``, never in the guard's helpers.
"""

from __future__ import annotations

import math
import re
import unicodedata
from decimal import Decimal
from typing import Any, Optional

MAX_GROUND_TRUTH_CHARS = 1000
"""Longest ground truth (characters) that can match an answer: a longer one is almost certainly a
worked solution (MATH-500's longest answer has 159 characters), and the bound bounds the time of
the normalisation, which is quadratic in the length."""

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
    ("\\varnothing", "\\emptyset"),
    ("\u2205", "\\emptyset"),  # the character ∅
)


def without_invisible(text: str) -> str:
    """``text`` without its invisible format characters (Unicode category Cf: zero-width space,
    byte-order mark, soft hyphen, ...), so that ``"6\u200b"`` reads as ``6``."""
    if text.isascii():
        return text
    return "".join(char for char in text if unicodedata.category(char) != "Cf")


def plain_digits_and_spaces(text: str) -> str:
    """``text`` with every decimal digit (Unicode Nd: ``５``, ``٥`` -> ``5``) and full-width ASCII form
    (``，`` -> ``,``) in ASCII, and every space separator (Unicode Zs) as a plain space, so that
    ``1\u00a0000`` reads as ``1 000``. Other characters stay."""
    if text.isascii():
        return text
    out = []
    for char in text:
        if "\uff01" <= char <= "\uff5e":
            out.append(chr(ord(char) - 0xFEE0))
        elif unicodedata.category(char) == "Zs":
            out.append(" ")
        elif unicodedata.category(char) == "Nd":
            out.append(str(unicodedata.decimal(char)))
        else:
            out.append(char)
    return "".join(out)


def _unbox(value: Any) -> Any:
    """A numpy scalar or 0-d array as the Python value it stands for, a 1-d array as a list of its
    cells; anything else unchanged."""
    if getattr(value, "dtype", None) is None or isinstance(value, str):
        return value
    return value.item() if getattr(value, "ndim", 0) == 0 else list(value)


def _number_text(value: float) -> str:
    """A finite float as its shortest plain decimal (``1e-07`` -> ``"0.0000001"``), a float a float32
    holds exactly with the float32's digits (a parquet ``float`` cell: ``0.10000000149011612`` ->
    ``"0.1"``)."""
    if value == 0:
        return "0"
    import numpy  # a second's import at most, only for a float ground truth

    text = repr(value)
    single = numpy.float32(value) if abs(value) < 3.4e38 else None  # beyond: no float32
    if single is not None and float(single) == value and len(str(single)) < len(text):
        text = str(single)
    text = format(Decimal(text), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def _scalar_ground_truth(value: Any) -> tuple[Optional[str], Optional[str]]:
    """``(text, None)`` for a string or a finite number, else ``(None, why)``."""
    value = _unbox(value)
    if isinstance(value, str):
        return without_invisible(value), None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, f"a value of type {type(value).__name__} ({value!r:.40}), not a string or number"
    if isinstance(value, float) and not math.isfinite(value):
        return None, f"a non-finite number ({value!r})"
    if isinstance(value, int) and value.bit_length() > 4 * MAX_GROUND_TRUTH_CHARS:  # > 10**1000
        return None, f"an integer of more than MAX_GROUND_TRUTH_CHARS={MAX_GROUND_TRUTH_CHARS} digits"
    return (str(value) if isinstance(value, int) else _number_text(value)), None


def _list_item_text(text: str) -> str:
    """One element of a longer list as it is joined: surrounding spaces and ``$`` removed."""
    return text.strip().strip("$").strip()


def ground_truth_conversion(value: Any) -> tuple[Optional[str], Optional[str]]:
    """``(text, None)`` for a usable ground truth, ``(None, why)`` otherwise: the one rule the
    rewards (:func:`ground_truth_text`) and the data preparation share, tabled in docs/reward.md
    ("Ground truths in the data"): a string without its invisible characters, a number in plain
    decimal, a list joined with ``", "``."""
    value = _unbox(value)
    if isinstance(value, (list, tuple)):
        if not value:
            return None, "an empty list"
        if len(value) == 1:
            value = _unbox(value[0])
            if isinstance(value, (list, tuple)):
                return None, f"a list inside a list ({value!r:.40})"
        else:
            return _list_ground_truth(value)
    text, why = _scalar_ground_truth(value)
    if text is None:
        return None, why
    return _checked_text(text)


def _list_ground_truth(values: list | tuple) -> tuple[Optional[str], Optional[str]]:
    """Several elements joined with ``", "`` (see :func:`ground_truth_conversion`)."""
    texts = []
    for item in map(_unbox, values):
        if isinstance(item, (list, tuple)):
            return None, f"a list inside a list ({item!r:.40})"
        text, why = _scalar_ground_truth(item)
        if text is None:
            return None, why
        if not _list_item_text(text):
            return None, f"a list with an empty element ({text!r:.40})"
        texts.append(_list_item_text(text))
    return _checked_text(", ".join(texts))


def _checked_text(text: str) -> tuple[Optional[str], Optional[str]]:
    """``(text, None)`` with invisible characters removed, or ``(None, why)`` for an empty, too long
    or not-Unicode text."""
    surrogate = unicode_problem(text)
    if surrogate:
        return None, surrogate
    text = without_invisible(text)
    if not text.strip():
        return None, "an empty text"
    if len(text) > MAX_GROUND_TRUTH_CHARS:
        return None, f"{len(text)} characters, more than MAX_GROUND_TRUTH_CHARS={MAX_GROUND_TRUTH_CHARS}"
    return text, None


def unicode_problem(text: str) -> Optional[str]:
    """Why ``text`` is not valid Unicode (a lone surrogate, e.g. from a JSON ``"\\ud800"`` escape,
    which no file can store as UTF-8), or None when it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"a lone surrogate (U+{ord(text[exc.start]):04X}) at character {exc.start + 1}, not valid Unicode text"
    return None


def ground_truth_text(value: Any) -> Optional[str]:
    """A row's ``reward_model.ground_truth`` as a string by :func:`ground_truth_conversion`'s rule,
    or None when no answer can ever match it."""
    return ground_truth_conversion(value)[0]


def ground_truth_problem(value: Any) -> Optional[str]:
    """Why ``value`` is not a usable ground truth (:func:`ground_truth_conversion`'s reason), or None."""
    why = ground_truth_conversion(value)[1]
    return None if why is None else f"ground truth is {why}"


def last_boxed_content(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; None
    when there is no box or the last box is never closed (``"\\boxed{12"``). Linear in ``len(text)``."""
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


_SPACED_COMMA = "\ue000"
"""Stands for a comma followed by white space while verl's normalisation runs (a private-use
character, which verl's rules never touch and its digits-only test does not count as a comma)."""
_BARE_COMMA = "\ue001"
"""Stands for a comma not followed by white space while verl's normalisation runs."""
_SPACED_COMMA_RE = re.compile(r",(?=\s)")
_AND_RE = re.compile(r"(?:,\s*)?\\text\{\s*and\s*\}")
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:" + _BARE_COMMA + r"\d{3})+(?:\.\d+)?")
_E_NOTATION_RE = re.compile(r"[-+]?\d+(?:\.\d*)?[eE][-+]?\d{1,3}")
MAX_E_NOTATION_EXPONENT = 300
"""A number in e-notation (``1e6``, ``2.5E-3``) is written out in plain digits when its exponent is at
most this in absolute value (so the plain form has at most about this many digits)."""


def _plain_number(text: str) -> str:
    """``text`` in plain decimal digits when it is one number in e-notation (``1e6`` -> ``1000000``,
    ``1e-3`` -> ``0.001``, ``2.5e3`` -> ``2500``), else ``text`` unchanged."""
    if not _E_NOTATION_RE.fullmatch(text):
        return text
    number = Decimal(text)
    if abs(number.as_tuple().exponent) > MAX_E_NOTATION_EXPONENT:
        return text
    plain = format(number, "f")
    plain = plain.rstrip("0").rstrip(".") if "." in plain else plain
    return "0" if plain in ("-0", "+0", "") else plain.lstrip("+")


def normalize_answer(answer: str) -> str:
    """verl's DAPO / Minerva normalisation of a final answer, plus LaTeX-spelling folding and
    list-aware commas (each step, and why the commas differ from verl's: docs/reward.md, "Lenient
    reward"). Quadratic in ``len(answer)`` at worst; callers pass at most
    :data:`MAX_GROUND_TRUTH_CHARS` characters. The result may be empty."""
    # verl (seconds) loads on the first answer normalized, not when the reward module is imported
    from verl.utils.reward_score.math_dapo import normalize_final_answer

    final = plain_digits_and_spaces(without_invisible(answer)).replace(_SPACED_COMMA, "").replace(_BARE_COMMA, "")
    for before, after in _LATEX_SPELLINGS:
        final = final.replace(before, after)
    final = final.replace("{,}", "")  # verl's rule for LaTeX's thousands separator, before commas are hidden
    final = _AND_RE.sub(_SPACED_COMMA, final)  # verl reads "\text{and}" as a comma: a list separator
    final = _SPACED_COMMA_RE.sub(_SPACED_COMMA, final).replace(",", _BARE_COMMA)
    final = _plain_number(normalize_final_answer(final).rstrip(".").strip())
    if _THOUSANDS_RE.fullmatch(final):
        return final.replace(_BARE_COMMA, "")
    return final.replace(_SPACED_COMMA, ", ").replace(_BARE_COMMA, ", ")


def interval_set_mismatch(norm_pred: str, norm_gold: str) -> bool:
    """True when one normalised answer is an interval (or pair) ``(a,b)`` / ``[a,b]`` / ``(a,b]`` /
    ``[a,b)`` and the other a set ``\\{...\\}``: different objects, although ``math_verify``
    counts ``(1,2)`` equal to ``\\{1,2\\}``. Linear in the lengths."""
    shapes = {_shape(norm_pred), _shape(norm_gold)}
    return shapes == {"interval", "set"}


def _shape(norm: str) -> str:
    """``"set"`` for ``\\{...\\}``, ``"interval"`` for an opening ``(``/``[`` whose match is the last
    character with exactly one top-level comma between them, ``""`` otherwise."""
    if norm.startswith("\\{") and norm.endswith("\\}"):
        return "set"
    if len(norm) < 5 or norm[0] not in "([" or norm[-1] not in ")]":
        return ""
    depth, commas = 0, 0
    for pos, char in enumerate(norm):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0 and pos != len(norm) - 1:
                return ""  # the first bracket closes early: "(1,2),(3,4)"
        elif char == "," and depth == 1:
            commas += 1
    return "interval" if depth == 0 and commas == 1 else ""


def symbolic_equal(pred: str, gold: str, norm_pred: str, norm_gold: str) -> bool:
    """``math_verify`` equivalence of two answers, tried on the raw and on the normalised forms.

    Runs in a guard helper, whose limit is the only one (``math_verify``'s own, running out, would
    read as "not equal"); the normalised forms are passed in so that a helper never imports verl.
    Returns False on any parse error.
    """
    # math_verify (sympy, seconds) loads on the first lenient check
    from math_verify import parse, verify

    for gold_text, pred_text in ((gold, pred), (norm_gold, norm_pred)):
        if not gold_text or not pred_text:
            continue
        try:
            gold_parsed = parse("\\boxed{" + gold_text + "}", parsing_timeout=None)
            pred_parsed = parse("\\boxed{" + pred_text + "}", parsing_timeout=None)
            if gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=None):
                return True
        except Exception:  # noqa: BLE001 - any failure of the symbolic stage means "not shown equal"
            continue
    return False


def warm_up_symbolic() -> None:
    """Import ``math_verify`` and sympy and run one comparison (a guard helper's warm-up, so that
    seconds of imports on a busy machine never count against an answer's time limit)."""
    symbolic_equal("0.5", "\\frac{1}{2}", "0.5", "\\frac{1}{2}")
