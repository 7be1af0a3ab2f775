"""S2T (Silencing Spurious Tokens, STAPO): the keep mask that silences spurious tokens.

S2T (docs/method.md, "S2T"). A response token is *silenced* (M = 0) when

    A_i > 0,   p_{i,t} = exp(log_prob_{i,t}) < tau_p,   H_{i,t} < tau_h,

where the first two conditions define the *candidate set* C and
``tau_h = quantile({H_{i,t} : (i,t) in C}, q)`` is pooled over the whole batch (and over every rank
of ``group``). The loss is then the mean over the remaining tokens, J = sum(M L) / sum(M).

Performance contract (single process): no host<->device sync except the one ``.tolist()`` of the
small stats vector at the end, no boolean indexing, no token tensor moved to the host. The
quantile is computed from a sorted, ``+inf``-padded copy of the entropies
(:func:`quantile_sorted_padded`), bit-identical to ``torch.quantile`` over the candidates.
With ``group``, one more sync reads the per-rank candidate counts to size the all-gather buffer
(:mod:`stapo_core.distributed`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .checks import (check_fraction, check_token_tensors, raise_if_negative_entropy, raise_if_nonfinite,
                     raise_if_not_log_probs, rounding_tolerance, token_advantages)
from .distributed import all_reduce_sum, exchange_counts, gather_padded

#: S2T strategies: the paper's method and its three ablations
STRATEGIES = ("low_entropy", "high_entropy", "random", "full")
#: the paper's S2T defaults: candidates have p < DEFAULT_TAU_P; the DEFAULT_Q-quantile of their entropies splits them
DEFAULT_TAU_P = 0.002
DEFAULT_Q = 0.75

#: order of the entries of the stats vector reduced over ranks (see _stats_vector)
_STAT_SUMS = (
    "candidates",
    "silenced",
    "tokens",
    "entropy_silenced_sum",
    "entropy_kept_candidates_sum",
    "nonfinite_log_prob",
    "nonfinite_entropy",
    "nonfinite_advantages",
    "log_prob_positive",
    "log_prob_negative",
    "log_prob_above_one",
    "entropy_negative",
)


@dataclass(frozen=True)
class S2TResult:
    """Result of :func:`s2t_mask`.

    keep: float32 ``(batch, resp_len)``: 1 keep, 0 silenced; 0 outside ``response_mask``.
    candidate: bool ``(batch, resp_len)``: the candidate set C (A > 0, p < tau_p, inside ``response_mask``).
    stats: python numbers, global over ``group`` when given (identical on every rank):
        ``candidates``, ``silenced``, ``tokens`` (ints), ``silenced_frac`` = silenced / max(tokens, 1),
        ``tau_h`` (the entropy threshold; NaN for ``random``/``full`` or without candidates),
        ``entropy_silenced_mean``, ``entropy_kept_candidates_mean`` (NaN when empty).
    """

    keep: torch.Tensor
    candidate: torch.Tensor
    stats: dict


def _check_strategy(strategy) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is invalid: expected one of {list(STRATEGIES)}")
    return strategy


def quantile_sorted_padded(sorted_values: torch.Tensor, count: torch.Tensor, q: float) -> torch.Tensor:
    """The ``q``-quantile of the first ``count`` entries of an ascending 1-D tensor, without a sync.

    Reproduces ``torch.quantile(sorted_values[:count], q)`` (linear interpolation) bit for bit:
    ``rank = q * (count - 1)`` in the values' dtype, ``lerp(v[floor(rank)], v[ceil(rank)],
    rank - floor(rank))``.

    Args:
        sorted_values: ``(L,)`` floating tensor, ascending; entries past ``count`` are padding
            (e.g. ``+inf``) and never read when ``count >= 1``.
        count: 0-dim integer tensor, ``0 <= count <= L`` (may live on the device).
        q: quantile in [0, 1].

    Returns:
        0-dim tensor of ``sorted_values``' dtype; NaN when ``count == 0`` or ``L == 0``.
    """
    if sorted_values.dim() != 1:
        raise ValueError(f"quantile_sorted_padded: sorted_values must be 1-D, got shape {tuple(sorted_values.shape)}")
    nan = torch.full((), float("nan"), dtype=sorted_values.dtype, device=sorted_values.device)
    if sorted_values.numel() == 0:
        return nan
    q_t = torch.full((), q, dtype=sorted_values.dtype, device=sorted_values.device)
    count = count.to(device=sorted_values.device, dtype=torch.long)
    rank = q_t * (count - 1).clamp(min=0)  # float, as torch.quantile: q * last_index
    below = rank.long()
    above = rank.ceil().long()
    weight = rank - below
    v_below = sorted_values.gather(0, below.reshape(1))
    v_above = sorted_values.gather(0, above.reshape(1))
    return torch.where(count > 0, v_below.lerp(v_above, weight.reshape(1)).reshape(()), nan)


def _pooled_quantile(entropy: torch.Tensor, candidate: torch.Tensor, q: float, group) -> torch.Tensor:
    """``quantile(H over the candidates of every rank, q)``: 0-dim float32, NaN with no candidates.
    With ``group``: one host read of the per-rank counts, then one all-gather."""
    count = candidate.sum()
    if group is None:
        pooled = torch.where(candidate, entropy, torch.full_like(entropy, math.inf)).reshape(-1)
    else:
        counts = exchange_counts(count.reshape(1), group)  # (world, 1)
        width = int(counts.max().item())  # the one sync the pooling needs
        if width == 0:
            return torch.full((), math.nan, dtype=torch.float32, device=entropy.device)
        pooled = gather_padded(entropy, candidate, width, group, fill=math.inf).reshape(-1)
        count = counts.sum()
    return quantile_sorted_padded(torch.sort(pooled).values, count, q)


def _silence(strategy, entropy, candidate, q, generator, group):
    """``(silenced bool (batch, resp_len), tau_h 0-dim float32)`` for one strategy."""
    nan = torch.full((), math.nan, dtype=torch.float32, device=entropy.device)
    if strategy == "low_entropy":  # silence H < quantile_q(H_C)
        tau_h = _pooled_quantile(entropy, candidate, q, group)
        return candidate & (entropy < tau_h), tau_h
    if strategy == "high_entropy":  # silence H > quantile_{1-q}(H_C)
        tau_h = _pooled_quantile(entropy, candidate, 1.0 - q, group)
        return candidate & (entropy > tau_h), tau_h
    if strategy == "random":  # silence each candidate with probability q, independently
        # U(0, 1) drawn on the generator's device (the global RNG's: the tokens'), then moved to the tokens
        u = torch.rand(entropy.shape, generator=generator, dtype=torch.float32,
                       device=generator.device if generator is not None else entropy.device)
        return candidate & (u.to(entropy.device) < q), nan
    return candidate.clone(), nan  # full: every candidate


def _stats_vector(mask, log_prob, entropy, advantages, candidate, silenced, lp_tol, h_tol) -> torch.Tensor:
    """float64 ``(len(_STAT_SUMS),)``: the summable statistics, in ``_STAT_SUMS`` order (the counts of
    impossible values among them: log-probabilities above ``lp_tol``, entropies below ``-h_tol``)."""
    zero = torch.zeros((), dtype=torch.float64, device=mask.device)
    kept_candidate = candidate & ~silenced
    return torch.stack(
        [
            candidate.sum().double(),
            silenced.sum().double(),
            mask.sum().double(),
            torch.where(silenced, entropy.double(), zero).sum(),
            torch.where(kept_candidate, entropy.double(), zero).sum(),
            (mask & ~torch.isfinite(log_prob)).sum().double(),
            (mask & ~torch.isfinite(entropy)).sum().double(),
            (mask & ~torch.isfinite(advantages)).sum().double(),
            (mask & (log_prob > lp_tol)).sum().double(),
            (mask & (log_prob < 0)).sum().double(),
            (mask & (log_prob > 1.0 + lp_tol)).sum().double(),
            (mask & (entropy < -h_tol)).sum().double(),
        ]
    )


def _stats_dict(values: list, lp_tol: float, h_tol: float) -> dict:
    """``values``: ``_STAT_SUMS`` then ``tau_h``, on the host."""
    v = dict(zip(_STAT_SUMS + ("tau_h",), values))
    raise_if_nonfinite("s2t_mask", {k: v["nonfinite_" + k] for k in ("log_prob", "entropy", "advantages")})
    raise_if_not_log_probs("s2t_mask", int(v["log_prob_positive"]), int(v["log_prob_negative"]),
                           int(v["log_prob_above_one"]), lp_tol)
    raise_if_negative_entropy("s2t_mask", int(v["entropy_negative"]), h_tol)
    candidates, silenced, tokens = int(v["candidates"]), int(v["silenced"]), int(v["tokens"])
    kept_candidates = candidates - silenced
    return {
        "candidates": candidates,
        "silenced": silenced,
        "tokens": tokens,
        "silenced_frac": silenced / max(tokens, 1),
        "tau_h": float(v["tau_h"]),
        "entropy_silenced_mean": v["entropy_silenced_sum"] / silenced if silenced else math.nan,
        "entropy_kept_candidates_mean": (
            v["entropy_kept_candidates_sum"] / kept_candidates if kept_candidates else math.nan
        ),
    }


def s2t_candidates(
    log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, *, tau_p: float = DEFAULT_TAU_P
) -> torch.Tensor:
    """S2T's candidate set C: bool ``(batch, resp_len)``, ``response_mask != 0``, ``A > 0`` and
    ``exp(log_prob) < tau_p`` (all strict; probabilities in float32), exactly the set
    :func:`s2t_mask` splits by entropy.

    Args:
        log_prob: ``(batch, resp_len)`` float log pi(y_t). advantages: ``(batch, resp_len)`` or
            ``(batch,)``. response_mask: ``(batch, resp_len)``, nonzero marks response tokens.
        tau_p: probability threshold in (0, 1).

    Raises:
        ValueError: as :func:`s2t_mask` for ``tau_p``, shapes and a ``log_prob`` above 0 (one host
            read of three counts).
    """
    tau_p = check_fraction("tau_p", tau_p)
    check_token_tensors("s2t_candidates", response_mask, log_prob=log_prob)
    adv = token_advantages("s2t_candidates", advantages, response_mask).detach().float()
    lp, mask = log_prob.detach().float(), response_mask != 0
    tolerance = rounding_tolerance(log_prob.dtype)
    positive, negative, above_one = torch.stack(
        [(mask & (lp > tolerance)).sum(), (mask & (lp < 0)).sum(), (mask & (lp > 1.0 + tolerance)).sum()]).tolist()
    raise_if_not_log_probs("s2t_candidates", positive, negative, above_one, tolerance)
    return mask & (adv > 0) & (torch.exp(lp) < tau_p)


def s2t_mask(
    log_prob: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tau_p: float = DEFAULT_TAU_P,
    q: float = DEFAULT_Q,
    strategy: str = "low_entropy",
    generator: Optional[torch.Generator] = None,
    group=None,
) -> S2TResult:
    """S2T keep mask: silence rare, low-entropy tokens of positive-advantage responses.

    Candidates C = {response_mask != 0, A > 0, exp(log_prob) < tau_p} (all strict). Silenced:

    * ``low_entropy`` (STAPO): C and H < tau_h, tau_h = quantile(H_C, q);
    * ``high_entropy``: C and H > tau_h, tau_h = quantile(H_C, 1 - q);
    * ``random``: each candidate independently with probability q (tau_h NaN). Draws come from
      ``generator`` (global RNG when None); with ``group`` each rank draws for its own tokens with
      its own generator, so give ranks differently seeded generators;
    * ``full``: every candidate (tau_h NaN).

    The quantile (``torch.quantile``'s linear interpolation) pools the candidates of every rank of
    ``group``: every rank gets the same tau_h and the mask one process holding the concatenated
    batch would compute. Without candidates nothing is silenced. Computed in float32, detached.

    Args:
        log_prob: ``(batch, resp_len)`` float log pi(y_t), any float dtype.
        entropy: ``(batch, resp_len)`` float, entropy H_t of the next-token distribution (nats).
        advantages: ``(batch, resp_len)`` or ``(batch,)`` float.
        response_mask: ``(batch, resp_len)``, any dtype; nonzero marks response tokens.
        tau_p: probability threshold in (0, 1).
        q: quantile in (0, 1).
        strategy: one of :data:`STRATEGIES`.
        generator: ``torch.Generator`` for ``random`` (ideally on the tokens' device).
        group: ``torch.distributed`` process group to pool over, or None.

    Returns:
        :class:`S2TResult` (keep float32 ``(batch, resp_len)``, stats global over ``group``).

    Raises:
        ValueError: bad ``tau_p``, ``q`` or ``strategy``; shape or device mismatch; non-finite
            ``log_prob``, ``entropy`` or ``advantages`` inside ``response_mask``; a ``log_prob``
            above 0 or an ``entropy`` below 0 beyond float rounding
            (:func:`~stapo_core.checks.rounding_tolerance`: 1e-3 in float32), with probabilities
            passed as log-probabilities named as such (all detected with the final stats read, on
            every rank of ``group`` alike).
    """
    tau_p = check_fraction("tau_p", tau_p)
    q = check_fraction("q", q)
    strategy = _check_strategy(strategy)
    check_token_tensors("s2t_mask", response_mask, log_prob=log_prob, entropy=entropy)
    adv = token_advantages("s2t_mask", advantages, response_mask).detach().float()
    lp = log_prob.detach().float()
    ent = entropy.detach().float()
    mask = response_mask != 0

    candidate = mask & (adv > 0) & (torch.exp(lp) < tau_p)  # A > 0, p < tau_p (as s2t_candidates)
    silenced, tau_h = _silence(strategy, ent, candidate, q, generator, group)
    keep = (mask & ~silenced).float()  # M_{i,t}

    lp_tol, h_tol = rounding_tolerance(log_prob.dtype), rounding_tolerance(entropy.dtype)
    sums = all_reduce_sum(_stats_vector(mask, lp, ent, adv, candidate, silenced, lp_tol, h_tol), group)
    values = torch.cat([sums, tau_h.double().reshape(1)]).tolist()  # the one host sync
    return S2TResult(keep=keep, candidate=candidate, stats=_stats_dict(values, lp_tol, h_tol))


def s2t_keep_at(log_prob: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, *, tau_p: float, tau_h: float, strategy: str) -> Optional[torch.Tensor]:
    """S2T's keep mask at a given ``tau_h`` (a pooled :func:`s2t_mask`'s, NaN: none) instead of a
    quantile of these tokens: no pooling, no collective. On the statistics that gave ``tau_h`` it is
    that selection's mask; on other statistics of the same tokens it says what the same thresholds
    silence there. None for ``random`` (its silenced set is a draw, not a threshold).

    Args: as :func:`s2t_mask`. Returns float32 ``(batch, resp_len)``, 0 outside ``response_mask``.
    """
    if _check_strategy(strategy) == "random":
        return None
    candidate = s2t_candidates(log_prob, advantages, response_mask, tau_p=tau_p)
    entropy = entropy.detach().float()
    silenced = {"low_entropy": candidate & (entropy < tau_h), "high_entropy": candidate & (entropy > tau_h),
                "full": candidate}[strategy]
    return ((response_mask != 0) & ~silenced).float()


__all__ = ["DEFAULT_Q", "DEFAULT_TAU_P", "S2TResult", "STRATEGIES", "quantile_sorted_padded", "s2t_candidates",
           "s2t_keep_at", "s2t_mask"]
