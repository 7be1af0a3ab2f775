"""The two kinds of record of the spurious-token dump, and their validation.

A record is a JSON object; ``kind`` tells the two apart and extra keys are allowed and kept. Each
kind's fields are listed in a table below, field -> check, in the order they are checked; a check
returns the normalised value (ints stay ints, numbers become floats) or raises
:class:`RecordError` naming the field. Floats must be finite; ``tau_h`` and ``entropy_split`` may
be null.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from ..checks import is_number

#: quadrant names: (low|high) probability x (low|high) entropy
QUADRANTS = ("lowp_lowh", "lowp_highh", "highp_lowh", "highp_highh")


class RecordError(ValueError):
    """A record that does not follow the schema (the message names the field)."""


Check = Callable[[str, Any], Any]


def _integer(minimum: int) -> Check:
    def check(key: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecordError(f"field {key!r} must be an integer, got {value!r}")
        if value < minimum:
            raise RecordError(f"field {key!r} must be >= {minimum}, got {value}")
        return value

    return check


def _number(low: Optional[float] = None, high: Optional[float] = None, *, nullable: bool = False) -> Check:
    def check(key: str, value) -> Optional[float]:
        if value is None and nullable:
            return None
        if not is_number(value):
            raise RecordError(f"field {key!r} must be a finite number{' or null' if nullable else ''}, got {value!r}")
        if (low is not None and value < low) or (high is not None and value > high):
            raise RecordError(f"field {key!r} must lie in [{low}, {high}], got {value!r}")
        return float(value)

    return check


def _text(key: str, value) -> str:
    if not isinstance(value, str):
        raise RecordError(f"field {key!r} must be a string, got {value!r}")
    return value


def _flag(key: str, value) -> bool:
    if not isinstance(value, bool):
        raise RecordError(f"field {key!r} must be true or false, got {value!r}")
    return value


def _top5(key: str, value) -> list:
    if not isinstance(value, list) or len(value) > 5:
        raise RecordError(f"field {key!r} must be a list of at most 5 [token, prob] pairs, got {value!r}")
    out = []
    for i, pair in enumerate(value):
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2 or not isinstance(pair[0], str)
                or isinstance(pair[1], bool) or not isinstance(pair[1], (int, float))
                or not 0.0 <= pair[1] <= 1.0):
            raise RecordError(f"field {key!r}[{i}] must be [token string, probability in [0, 1]], got {pair!r}")
        out.append([pair[0], float(pair[1])])
    return out


def _checked(rec: Mapping, fields: Mapping[str, Check]) -> dict:
    """``{field: check(field, rec.get(field))}`` in the table's order."""
    return {key: check(key, rec.get(key)) for key, check in fields.items()}


#: the statistics of one quadrant: its token count, the sum of their closed-form gradient norms and
#: the sum of their log-probability changes across the update (null when not measured)
_QUADRANT_FIELDS = {"count": _integer(minimum=0), "grad_norm_sum": _number(low=0.0),
                    "dlogp_sum": _number(nullable=True)}


def _quadrants(key: str, value) -> dict:
    if not isinstance(value, Mapping) or set(value) != set(QUADRANTS):
        got = sorted(value) if isinstance(value, Mapping) else value
        raise RecordError(f"field {key!r} must map exactly {list(QUADRANTS)} to stats, got {got!r}")
    out = {}
    for name in QUADRANTS:
        stats = value[name]
        if not isinstance(stats, Mapping):
            raise RecordError(f"field '{key}.{name}' must be {{'count': int, 'grad_norm_sum': float, "
                              f"'dlogp_sum': float or null}}, got {stats!r}")
        try:
            out[name] = _checked(stats, _QUADRANT_FIELDS)
        except RecordError as exc:
            raise RecordError(f"{key}.{name}: {exc}") from None
    return out


#: fields of both kinds
_COMMON_FIELDS = {
    "step": _integer(minimum=0),
    "method": _text,
    "uid": _text,
    "response_index": _integer(minimum=0),
    "advantage": _number(),
}

#: fields of a token record besides the common ones. prob, entropy and grad_norm are the policy's
#: probability of the token, the entropy (nats) at its position and the closed-form logit-gradient
#: norm per unit weight; top5 the policy's five likeliest tokens there, ``[[token, prob], ...]``;
#: dlogp the change of the token's log-probability across the update that followed (null when not
#: measured, and null when absent on read)
_TOKEN_FIELDS = {
    "position": _integer(minimum=0),
    "token_id": _integer(minimum=0),
    "token": _text,
    "context_before": _text,
    "context_after": _text,
    "prob": _number(0.0, 1.0),
    "entropy": _number(low=0.0),
    "candidate": _flag,
    "silenced": _flag,
    "grad_norm": _number(low=0.0),
    "top5": _top5,
    "dlogp": _number(nullable=True),
}

#: fields of a response record besides the common ones. tau_p / tau_h are the thresholds of its
#: step (tau_h null when S2T had none); quadrants maps each of QUADRANTS to
#: ``{"count", "grad_norm_sum", "dlogp_sum"}`` over the response's tokens; entropy_split is the entropy threshold
#: the quadrants used (tau_h, else the response's median entropy; null when neither exists, and
#: null when absent on read)
_RESPONSE_FIELDS = {
    "n_tokens": _integer(minimum=0),
    "tau_p": _number(0.0, 1.0),
    "tau_h": _number(low=0.0, nullable=True),
    "quadrants": _quadrants,
    "entropy_split": _number(low=0.0, nullable=True),
}


def validate_token_record(rec: Mapping) -> dict:
    """A normalised copy of a ``kind = "token"`` record (``kind`` set to ``"token"``).

    Raises:
        RecordError: a missing or mistyped field, a non-finite float, ``prob`` outside [0, 1],
            a negative ``entropy`` / ``grad_norm``, or ``silenced`` without ``candidate``.
    """
    out = dict(rec)
    out.update(_checked(rec, _COMMON_FIELDS))
    out.update({"kind": "token", **_checked(rec, _TOKEN_FIELDS)})
    if out["silenced"] and not out["candidate"]:
        raise RecordError("a silenced token must be a candidate ('silenced' true, 'candidate' false)")
    return out


def validate_response_record(rec: Mapping) -> dict:
    """A normalised copy of a ``kind = "response"`` record (``entropy_split`` added as null if absent).

    Raises:
        RecordError: a missing or mistyped field, a non-finite float, ``tau_p`` outside [0, 1],
            or quadrant counts that add up to more than ``n_tokens``.
    """
    out = dict(rec)
    out.update(_checked(rec, _COMMON_FIELDS))
    out.update({"kind": "response", **_checked(rec, _RESPONSE_FIELDS)})
    total = sum(q["count"] for q in out["quadrants"].values())
    if total > out["n_tokens"]:
        raise RecordError(f"quadrant counts add up to {total}, more than n_tokens={out['n_tokens']}")
    return out


def validate_record(rec: Any) -> dict:
    if not isinstance(rec, Mapping):
        raise RecordError(f"a record must be a JSON object, got {type(rec).__name__}")
    kind = rec.get("kind")
    if kind == "token":
        return validate_token_record(rec)
    if kind == "response":
        return validate_response_record(rec)
    raise RecordError(f"field 'kind' must be 'token' or 'response', got {kind!r}")
