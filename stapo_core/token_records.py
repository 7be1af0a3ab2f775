"""The spurious-token dump's records: schema, writer, reader and the four-quadrant counts.

The actor hook (``verl_patches.token_dump.hook``) writes, during training, what S2T saw; the
inspector (``python -m recipe.stapo.inspect``) and the plots read it. All of them use this module,
so the format and the numbers come from one place. Plain Python + numpy: it lives in
``stapo_core`` (the bottom of the import graph) so that reading a dump never imports verl.

Files (JSON Lines, UTF-8, one record per line), under a run folder ``RUN_DIR``:

* ``RUN_DIR/s2t_tokens/step_{step:06d}.jsonl`` (one file per training step), and/or
* ``RUN_DIR/s2t_tokens.jsonl`` (everything in one file).

Records (``kind`` tells them apart; extra keys are allowed and kept):

* :class:`TokenRecord`, ``kind = "token"``: one per candidate token of a sampled response
  (``prob`` and ``entropy`` of the policy at that position, the response's ``advantage``,
  ``candidate`` / ``silenced`` flags of S2T, ``grad_norm`` = the closed-form logit-gradient norm
  per unit weight ``sqrt(1 - 2 p_k + sum_n p_n^2)`` (:func:`stapo_core.logit_grad_norm`), and the
  policy's ``top5`` alternatives ``[[token_str, prob], ...]``).
* :class:`ResponseRecord`, ``kind = "response"``: one per sampled response: its ``advantage``,
  ``n_tokens``, the thresholds ``tau_p`` / ``tau_h`` of its step and the four quadrants of
  :func:`quadrant_counts` over its response tokens (``entropy_split`` = the entropy threshold the
  quadrants used: ``tau_h``, or the response's median entropy when ``tau_h`` is null).

Floats must be finite (``tau_h`` / ``entropy_split`` may be null); the writer and the reader
both validate every record and name the file and line of a bad one.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, TypedDict, Union

import numpy as np

from .fileio import atomic_write_text, iter_jsonl

#: folder of per-step dump files inside a run folder
TOKEN_DUMP_DIR = "s2t_tokens"
#: single-file alternative inside a run folder
TOKEN_DUMP_FILE = "s2t_tokens.jsonl"
#: how a per-step file is named
STEP_FILE_PATTERN = "step_{step:06d}.jsonl"
_STEP_FILE_RE = re.compile(r"^step_(\d+)\.jsonl$")
#: quadrant names: (low|high) probability x (low|high) entropy
QUADRANTS = ("lowp_lowh", "lowp_highh", "highp_lowh", "highp_highh")
#: told to the user when a run folder holds no dump (the lead's actor-side switch)
ENABLE_HINT = "run training with the token dump on: the override recipe.token_dump.dir=<run folder>"


class TokenRecord(TypedDict):
    """One candidate token of a sampled response (``kind = "token"``)."""

    kind: str
    step: int
    method: str
    uid: str
    response_index: int
    position: int
    token_id: int
    token: str
    context_before: str
    context_after: str
    prob: float
    entropy: float
    advantage: float
    candidate: bool
    silenced: bool
    grad_norm: float
    top5: list


class QuadrantStats(TypedDict):
    count: int
    grad_norm_sum: float


class ResponseRecord(TypedDict, total=False):
    """One sampled response (``kind = "response"``); ``entropy_split`` is optional on read."""

    kind: str
    step: int
    method: str
    uid: str
    response_index: int
    advantage: float
    n_tokens: int
    tau_p: float
    tau_h: Optional[float]
    entropy_split: Optional[float]
    quadrants: dict


Record = Union[TokenRecord, ResponseRecord, Mapping[str, Any]]


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


class RecordError(ValueError):
    """A record that does not follow the schema (the message names the field)."""


def _int(rec: Mapping, key: str, minimum: Optional[int] = None) -> int:
    value = rec.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecordError(f"field {key!r} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise RecordError(f"field {key!r} must be >= {minimum}, got {value}")
    return value


def _float(rec: Mapping, key: str, low: Optional[float] = None, high: Optional[float] = None,
           nullable: bool = False) -> Optional[float]:
    value = rec.get(key)
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RecordError(f"field {key!r} must be a finite number{' or null' if nullable else ''}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise RecordError(f"field {key!r} must lie in [{low}, {high}], got {value!r}")
    return float(value)


def _str(rec: Mapping, key: str) -> str:
    value = rec.get(key)
    if not isinstance(value, str):
        raise RecordError(f"field {key!r} must be a string, got {value!r}")
    return value


def _bool(rec: Mapping, key: str) -> bool:
    value = rec.get(key)
    if not isinstance(value, bool):
        raise RecordError(f"field {key!r} must be true or false, got {value!r}")
    return value


def _top5(rec: Mapping) -> list:
    value = rec.get("top5")
    if not isinstance(value, list) or len(value) > 5:
        raise RecordError(f"field 'top5' must be a list of at most 5 [token, prob] pairs, got {value!r}")
    out = []
    for i, pair in enumerate(value):
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2 or not isinstance(pair[0], str)
                or isinstance(pair[1], bool) or not isinstance(pair[1], (int, float))
                or not 0.0 <= pair[1] <= 1.0):
            raise RecordError(f"field 'top5'[{i}] must be [token string, probability in [0, 1]], got {pair!r}")
        out.append([pair[0], float(pair[1])])
    return out


def _common(rec: Mapping) -> dict:
    return {"step": _int(rec, "step", 0), "method": _str(rec, "method"), "uid": _str(rec, "uid"),
            "response_index": _int(rec, "response_index", 0), "advantage": _float(rec, "advantage")}


def validate_token_record(rec: Mapping) -> TokenRecord:
    """A normalised copy (ints stay ints, numbers become floats) of a ``kind = "token"`` record.

    Raises:
        RecordError: a missing or mistyped field, a non-finite float, ``prob`` outside [0, 1],
            a negative ``entropy`` / ``grad_norm``, or ``silenced`` without ``candidate``.
    """
    out = dict(rec)
    out.update(_common(rec))
    out.update({
        "kind": "token", "position": _int(rec, "position", 0), "token_id": _int(rec, "token_id", 0),
        "token": _str(rec, "token"), "context_before": _str(rec, "context_before"),
        "context_after": _str(rec, "context_after"), "prob": _float(rec, "prob", 0.0, 1.0),
        "entropy": _float(rec, "entropy", 0.0), "candidate": _bool(rec, "candidate"),
        "silenced": _bool(rec, "silenced"), "grad_norm": _float(rec, "grad_norm", 0.0), "top5": _top5(rec),
    })
    if out["silenced"] and not out["candidate"]:
        raise RecordError("a silenced token must be a candidate ('silenced' true, 'candidate' false)")
    return out  # type: ignore[return-value]


def _quadrants(rec: Mapping) -> dict:
    value = rec.get("quadrants")
    if not isinstance(value, Mapping) or set(value) != set(QUADRANTS):
        got = sorted(value) if isinstance(value, Mapping) else value
        raise RecordError(f"field 'quadrants' must map exactly {list(QUADRANTS)} to stats, got {got!r}")
    out = {}
    for name in QUADRANTS:
        stats = value[name]
        if not isinstance(stats, Mapping):
            raise RecordError(f"field 'quadrants.{name}' must be {{'count': int, 'grad_norm_sum': float}}, got {stats!r}")
        try:
            out[name] = {"count": _int(stats, "count", 0), "grad_norm_sum": _float(stats, "grad_norm_sum", 0.0)}
        except RecordError as exc:
            raise RecordError(f"quadrants.{name}: {exc}") from None
    return out


def validate_response_record(rec: Mapping) -> ResponseRecord:
    """A normalised copy of a ``kind = "response"`` record (``entropy_split`` added as null if absent).

    Raises:
        RecordError: a missing or mistyped field, a non-finite float, ``tau_p`` outside (0, 1],
            or quadrant counts that add up to more than ``n_tokens``.
    """
    out = dict(rec)
    out.update(_common(rec))
    out.update({
        "kind": "response", "n_tokens": _int(rec, "n_tokens", 0), "tau_p": _float(rec, "tau_p", 0.0, 1.0),
        "tau_h": _float(rec, "tau_h", 0.0, nullable=True), "quadrants": _quadrants(rec),
        "entropy_split": _float(rec, "entropy_split", 0.0, nullable=True),
    })
    total = sum(q["count"] for q in out["quadrants"].values())
    if total > out["n_tokens"]:
        raise RecordError(f"quadrant counts add up to {total}, more than n_tokens={out['n_tokens']}")
    return out  # type: ignore[return-value]


def validate_record(rec: Any) -> dict:
    """Dispatch on ``rec["kind"]`` ("token" or "response"); RecordError otherwise."""
    if not isinstance(rec, Mapping):
        raise RecordError(f"a record must be a JSON object, got {type(rec).__name__}")
    kind = rec.get("kind")
    if kind == "token":
        return validate_token_record(rec)
    if kind == "response":
        return validate_response_record(rec)
    raise RecordError(f"field 'kind' must be 'token' or 'response', got {kind!r}")


# --------------------------------------------------------------------------------------------
# writing and reading
# --------------------------------------------------------------------------------------------


def step_file(run_dir: str | os.PathLike, step: int) -> Path:
    """``RUN_DIR/s2t_tokens/step_{step:06d}.jsonl``."""
    return Path(run_dir) / TOKEN_DUMP_DIR / STEP_FILE_PATTERN.format(step=step)


def _encode(path: Path, records: Iterable[Record]) -> str:
    """Validate every record and return them as JSON Lines text (ValueError names ``path`` and the
    index of the first bad record; nothing is written)."""
    lines = []
    for i, rec in enumerate(records):
        try:
            lines.append(json.dumps(validate_record(rec), ensure_ascii=False, allow_nan=False))
        except RecordError as exc:
            raise ValueError(f"{path}: record #{i} is invalid: {exc}") from None
    return "".join(line + "\n" for line in lines)


def write_records(path: str | os.PathLike, records: Iterable[Record]) -> int:
    """Validate every record, then append them to ``path`` (created with its folders) and flush.

    All records are validated before anything is written, so a bad record leaves the file as it
    was. Returns the number of records written.

    Raises:
        ValueError: naming the file and the index of the first bad record.
    """
    path = Path(path)
    text = _encode(path, records)
    if not text:
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    return text.count("\n")


def write_step(run_dir: str | os.PathLike, step: int, records: Iterable[Record]) -> Path:
    """Write ``records`` as the step's file (:func:`step_file`), replacing it atomically.

    The records are validated first; a bad record raises ValueError and leaves any existing step
    file as it was (a resumed run rewrites the steps it trains again).
    """
    path = step_file(run_dir, step)
    return atomic_write_text(path, _encode(path, records))


def dump_files(run_dir: str | os.PathLike) -> list[Path]:
    """The dump files of a run, in step order: ``s2t_tokens/step_*.jsonl`` then ``s2t_tokens.jsonl``.

    ``run_dir`` may also be the ``s2t_tokens`` folder itself or a single ``.jsonl`` dump file.

    Raises:
        FileNotFoundError: no dump there (the message says how to produce one).
    """
    root = Path(run_dir)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such run folder")
    folder = root if root.name == TOKEN_DUMP_DIR else root / TOKEN_DUMP_DIR
    files = []
    if folder.is_dir():
        steps = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_FILE_RE.match(p.name))]
        files = [p for _, p in sorted(steps)]
    if (root / TOKEN_DUMP_FILE).is_file():
        files.append(root / TOKEN_DUMP_FILE)
    if not files:
        raise FileNotFoundError(
            f"{root}: no spurious-token dump (neither {TOKEN_DUMP_DIR}/step_*.jsonl nor {TOKEN_DUMP_FILE}); "
            f"{ENABLE_HINT}")
    return files


@dataclass(frozen=True)
class Dump:
    """What :func:`read_dump` found: validated records in file order, and the files that held no
    record (``(path, reason)``), e.g. an empty step file left by a run killed while writing."""

    tokens: list
    responses: list
    skipped: list


def read_dump(run_dir: str | os.PathLike, progress: bool = True) -> Dump:
    """All validated records of a run's dump (see :func:`dump_files` for where they are looked for).

    Raises:
        FileNotFoundError: no dump. ValueError: an unreadable line or a bad record (names the file
            and line).
    """
    from tqdm import tqdm

    tokens: list = []
    responses: list = []
    skipped: list = []
    files = dump_files(run_dir)
    for path in tqdm(files, desc="reading token dump", unit="file", disable=not progress or len(files) < 2):
        count = 0
        for number, obj in iter_jsonl(path):
            try:
                rec = validate_record(obj)
            except RecordError as exc:
                raise ValueError(f"{path}: line {number}: {exc}") from None
            (tokens if rec["kind"] == "token" else responses).append(rec)
            count += 1
        if count == 0:
            skipped.append((str(path), "no record (empty file)"))
    return Dump(tokens, responses, skipped)


def read_records(run_dir: str | os.PathLike, progress: bool = True) -> tuple[list[TokenRecord], list[ResponseRecord]]:
    """``(tokens, responses)`` of :func:`read_dump` (files without records are skipped)."""
    dump = read_dump(run_dir, progress=progress)
    return dump.tokens, dump.responses


# --------------------------------------------------------------------------------------------
# four-quadrant taxonomy
# --------------------------------------------------------------------------------------------


def _as_array(x, dtype) -> np.ndarray:
    """A numpy copy/view of a numpy array, torch tensor (detached, to host) or nested list."""
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().float().cpu().numpy() if x.is_floating_point() else x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


def entropy_split(entropy, mask, tau_h: Optional[float]) -> Optional[float]:
    """The entropy threshold of the quadrants: ``tau_h`` when finite, else the median entropy of the
    masked tokens (mean of the two middle values for an even count), None when there are none."""
    if tau_h is not None and math.isfinite(tau_h):
        return float(tau_h)
    ent = _as_array(entropy, np.float64)[_as_array(mask, np.float64) != 0]
    return float(np.median(ent)) if ent.size else None


def quadrant_counts(prob, entropy, advantage, grad_norm, mask, tau_p: float, tau_h: Optional[float],
                    *, positive_only: bool = False) -> dict:
    """Token counts and gradient-norm sums of the four probability x entropy quadrants.

    A token is *low probability* when ``prob < tau_p`` and *low entropy* when
    ``entropy < split`` with ``split = entropy_split(entropy, mask, tau_h)`` (``tau_h``, or the median
    entropy of the counted tokens when ``tau_h`` is None or not finite).

    Args:
        prob, entropy, grad_norm: same-shape float arrays (numpy or torch, any shape, e.g. ``(T,)``
            for one response or ``(B, T)``): policy probability of the sampled token, entropy (nats)
            at the position, closed-form logit-gradient norm per unit weight.
        advantage: float array broadcastable to that shape (``(B, 1)`` or a scalar works).
        mask: array of that shape, nonzero at the tokens to count (response tokens).
        tau_p: probability threshold in (0, 1]. tau_h: entropy threshold, or None.
        positive_only: count only tokens with ``advantage > 0``.

    Returns:
        ``{name: {"count": int, "grad_norm_sum": float}}`` for ``name`` in :data:`QUADRANTS`
        (sums in float64; zeros when nothing is counted).

    Raises:
        ValueError: shape mismatch, ``tau_p`` outside (0, 1], or a non-finite value at a counted token.
    """
    if isinstance(tau_p, bool) or not isinstance(tau_p, (int, float)) or not 0.0 < tau_p <= 1.0:
        raise ValueError(f"quadrant_counts: tau_p={tau_p!r} must be a number in (0, 1]")
    p, h, g = (_as_array(x, np.float64) for x in (prob, entropy, grad_norm))
    m = _as_array(mask, np.float64) != 0
    if not p.shape == h.shape == g.shape == m.shape:
        raise ValueError(f"quadrant_counts: prob {p.shape}, entropy {h.shape}, grad_norm {g.shape} and "
                         f"mask {m.shape} must have the same shape")
    try:
        adv = np.broadcast_to(_as_array(advantage, np.float64), p.shape)
    except ValueError:
        raise ValueError(f"quadrant_counts: advantage {np.shape(advantage)} does not broadcast to {p.shape}") from None
    if positive_only:
        m = m & (adv > 0)
    for name, arr in (("prob", p), ("entropy", h), ("grad_norm", g)):
        if not np.isfinite(arr[m]).all():
            raise ValueError(f"quadrant_counts: {name} holds non-finite values at counted tokens")
    split = entropy_split(h, m, tau_h)
    low_p = p < tau_p
    low_h = h < split if split is not None else np.zeros_like(m)
    out = {}
    for name, sel in zip(QUADRANTS, (low_p & low_h, low_p & ~low_h, ~low_p & low_h, ~low_p & ~low_h)):
        sel = sel & m
        out[name] = {"count": int(sel.sum()), "grad_norm_sum": float(g[sel].sum())}
    return out


def response_record(*, step: int, method: str, uid: str, response_index: int, advantage: float,
                    prob, entropy, grad_norm, mask, tau_p: float, tau_h: Optional[float]) -> ResponseRecord:
    """The ``kind = "response"`` record of one response from its per-token ``(T,)`` arrays.

    ``n_tokens`` = number of mask tokens; quadrants over all of them (:func:`quadrant_counts`);
    a non-finite ``tau_h`` (e.g. S2T's NaN without candidates) is stored as null.
    """
    tau_h = float(tau_h) if tau_h is not None and math.isfinite(tau_h) else None
    rec = {
        "kind": "response", "step": int(step), "method": method, "uid": str(uid),
        "response_index": int(response_index), "advantage": float(advantage),
        "n_tokens": int((_as_array(mask, np.float64) != 0).sum()), "tau_p": float(tau_p), "tau_h": tau_h,
        "entropy_split": entropy_split(entropy, mask, tau_h),
        "quadrants": quadrant_counts(prob, entropy, advantage, grad_norm, mask, tau_p, tau_h),
    }
    return validate_response_record(rec)


__all__ = [
    "ENABLE_HINT", "QUADRANTS", "TOKEN_DUMP_DIR", "TOKEN_DUMP_FILE", "RecordError", "ResponseRecord",
    "TokenRecord", "dump_files", "entropy_split", "iter_jsonl", "quadrant_counts", "read_records",
    "response_record", "step_file", "validate_record", "validate_response_record", "validate_token_record",
    "write_records",
]
