"""The four-quadrant taxonomy of response tokens: low/high probability x low/high entropy.

A token is *low probability* when ``prob < tau_p`` and *low entropy* when ``entropy < split``, with
``split`` = :func:`entropy_split` (S2T's ``tau_h``, or the response's median entropy when there is
none). Each quadrant counts its tokens and sums their closed-form logit-gradient norms per unit
weight and, when measured, the changes of their log-probabilities across the update that followed.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..checks import is_number
from .schema import QUADRANTS, validate_response_record


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


def quadrant_counts(prob, entropy, grad_norm, mask, tau_p: float, tau_h: Optional[float], dlogp=None) -> dict:
    """Token counts and gradient-norm sums of the four probability x entropy quadrants.

    Args:
        prob, entropy, grad_norm: same-shape float arrays (numpy or torch, any shape, e.g. ``(T,)``
            for one response or ``(B, T)``): policy probability of the sampled token, entropy (nats)
            at the position, closed-form logit-gradient norm per unit weight.
        mask: array of that shape, nonzero at the tokens to count (response tokens).
        tau_p: probability threshold in (0, 1]. tau_h: entropy threshold, or None.
        dlogp: optional array of that shape: the change of each token's log-probability across
            the update that followed.

    Returns:
        ``{name: {"count": int, "grad_norm_sum": float, "dlogp_sum": float or None}}`` for ``name``
        in :data:`QUADRANTS` (sums in float64; zeros when nothing is counted; ``dlogp_sum`` None
        without ``dlogp``).

    Raises:
        ValueError: shape mismatch, ``tau_p`` outside (0, 1], or a non-finite value at a counted token.
    """
    if not is_number(tau_p) or not 0.0 < tau_p <= 1.0:
        raise ValueError(f"quadrant_counts: tau_p={tau_p!r} must be a number in (0, 1]")
    p, h, g = (_as_array(x, np.float64) for x in (prob, entropy, grad_norm))
    m = _as_array(mask, np.float64) != 0
    d = None if dlogp is None else _as_array(dlogp, np.float64)
    if not p.shape == h.shape == g.shape == m.shape or (d is not None and d.shape != m.shape):
        raise ValueError(f"quadrant_counts: prob {p.shape}, entropy {h.shape}, grad_norm {g.shape}, "
                         f"{'' if d is None else f'dlogp {d.shape}, '}and mask {m.shape} must have the same shape")
    for name, arr in (("prob", p), ("entropy", h), ("grad_norm", g)) + ((("dlogp", d),) if d is not None else ()):
        if not np.isfinite(arr[m]).all():
            raise ValueError(f"quadrant_counts: {name} holds non-finite values at counted tokens")
    split = entropy_split(h, m, tau_h)
    low_p = p < tau_p
    low_h = h < split if split is not None else np.zeros_like(m)
    out = {}
    for name, sel in zip(QUADRANTS, (low_p & low_h, low_p & ~low_h, ~low_p & low_h, ~low_p & ~low_h)):
        sel = sel & m
        out[name] = {"count": int(sel.sum()), "grad_norm_sum": float(g[sel].sum()),
                     "dlogp_sum": None if d is None else float(d[sel].sum())}
    return out


def response_record(*, step: int, method: str, uid: str, response_index: int, advantage: float,
                    prob, entropy, grad_norm, mask, tau_p: float, tau_h: Optional[float],
                    dlogp=None) -> dict:
    """The ``kind = "response"`` record of one response from its per-token ``(T,)`` arrays; a
    non-finite ``tau_h`` (S2T's NaN without candidates) is stored as null."""
    tau_h = float(tau_h) if tau_h is not None and math.isfinite(tau_h) else None
    rec = {
        "kind": "response", "step": int(step), "method": method, "uid": str(uid),
        "response_index": int(response_index), "advantage": float(advantage),
        "n_tokens": int((_as_array(mask, np.float64) != 0).sum()), "tau_p": float(tau_p), "tau_h": tau_h,
        "entropy_split": entropy_split(entropy, mask, tau_h),
        "quadrants": quadrant_counts(prob, entropy, grad_norm, mask, tau_p, tau_h, dlogp),
    }
    return validate_response_record(rec)
