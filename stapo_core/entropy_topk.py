"""20-Entropy's token selection: keep the ``ratio`` highest-entropy response tokens (``entropy_topk``).

Wang et al. 2025 ("Beyond the 80/20 rule"): only the top 20% highest-entropy tokens carry the
policy gradient.
"""

from __future__ import annotations

import math

import torch

from .distributed import exchange_counts, gather_padded, group_rank
from .checks import check_fraction, check_token_tensors, raise_if_negative_entropy, raise_if_nonfinite, rounding_tolerance


#: how k is rounded from ratio * N: ``ceil`` (exact ceiling), ``authors_code`` (20-Entropy's code)
ROUNDINGS = ("ceil", "authors_code")


def top_count(num_tokens: int, ratio: float, rounding: str = "ceil") -> int:
    """The number of tokens 20-Entropy keeps out of ``num_tokens``.

    ``ceil``: ``k = ceil(ratio * N)``, the product rounded to 9 decimals first so that float error
    does not add a token (0.2 * 15 = 3.0000000000000004 gives 3, not 4).
    ``authors_code``: ``k = max(1, int(ratio * N + 0.9999))`` as the authors' code computes it (a
    ceiling except when the fractional part of ``ratio * N`` is in (0, 1e-4]; never for ratio 0.2);
    0 when ``N = 0``.
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"top_count: rounding={rounding!r} is invalid: expected one of {list(ROUNDINGS)}")
    if num_tokens == 0:
        return 0
    if rounding == "authors_code":
        return min(num_tokens, max(1, int(num_tokens * ratio + 0.9999)))
    return min(num_tokens, math.ceil(round(ratio * num_tokens, 9)))


def _host_token_counts(mask: torch.Tensor, entropy: torch.Tensor, group, tolerance: float) -> list:
    """``[[tokens, nonfinite_entropy, entropy below -tolerance] per rank]`` on the host (one sync)."""
    counts = torch.stack([mask.sum(), (mask & ~torch.isfinite(entropy)).sum(), (mask & (entropy < -tolerance)).sum()])
    if group is None:
        return [counts.tolist()]
    return exchange_counts(counts, group).tolist()


def _pooled_entropies(entropy, mask, width, group):
    """``(pooled, lower_ranks)``: 1-D response entropies of every rank (``-inf`` padding), and the
    part of it that lower ranks hold (empty for a single process)."""
    if group is None:
        pooled = torch.where(mask, entropy, torch.full_like(entropy, -math.inf)).reshape(-1)
        return pooled, pooled[:0]
    rows = gather_padded(entropy, mask, width, group, fill=-math.inf)  # (world, width)
    return rows.reshape(-1), rows[: group_rank(group)]


def entropy_topk_mask(
    entropy: torch.Tensor, response_mask: torch.Tensor, *, ratio: float = 0.2, group=None, rounding: str = "ceil"
) -> torch.Tensor:
    """:func:`entropy_topk_selection`'s keep mask."""
    return entropy_topk_selection(entropy, response_mask, ratio=ratio, group=group, rounding=rounding)[0]


def entropy_topk_selection(
    entropy: torch.Tensor, response_mask: torch.Tensor, *, ratio: float = 0.2, group=None, rounding: str = "ceil"
) -> tuple[torch.Tensor, torch.Tensor]:
    """20-Entropy (Wang et al. 2025): keep the ``k = ceil(ratio * N)`` highest-entropy response tokens.

    N counts the response tokens of the pooled batch (every rank of ``group``). Exactly k tokens
    are kept. Ties at the threshold (the k-th largest entropy v) are broken deterministically and
    identically on every rank: all tokens with H > v are kept, then tokens with H == v in the
    order (rank, flat row-major index) until k are kept, i.e. the choice a single process makes on
    the ranks' batches concatenated along the batch dimension.

    Args:
        entropy: ``(batch, resp_len)`` float, any float dtype (compared in float32).
        response_mask: ``(batch, resp_len)``, nonzero marks response tokens.
        ratio: fraction in (0, 1].
        group: ``torch.distributed`` process group to pool over, or None.
        rounding: how ``k`` is rounded from ``ratio * N`` (:func:`top_count`).

    Returns:
        ``(keep, threshold)``: float32 ``(batch, resp_len)``, 1 for kept tokens, 0 elsewhere (always 0
        outside the mask); 0-dim float32 on the tokens' device, the k-th largest pooled entropy
        (``+inf`` when k is 0).

    Raises:
        ValueError: bad ``ratio`` or ``rounding``, shape mismatch, non-finite entropy or entropy below 0
            beyond float rounding (:func:`~stapo_core.checks.rounding_tolerance`) inside
            ``response_mask`` (raised on every rank of ``group`` alike).

    One host sync (the token counts); with ``group`` one all-gather of counts and one of the
    response entropies (padded to the largest rank's count).
    """
    ratio = check_fraction("ratio", ratio, include_one=True)
    if rounding not in ROUNDINGS:
        raise ValueError(f"entropy_topk_mask: rounding={rounding!r} is invalid: expected one of {list(ROUNDINGS)}")
    check_token_tensors("entropy_topk_mask", response_mask, entropy=entropy)
    ent = entropy.detach().float()
    mask = response_mask != 0
    tolerance = rounding_tolerance(entropy.dtype)
    per_rank = _host_token_counts(mask, ent, group, tolerance)
    raise_if_nonfinite("entropy_topk_mask", {"entropy": sum(r[1] for r in per_rank)})
    raise_if_negative_entropy("entropy_topk_mask", sum(r[2] for r in per_rank), tolerance)
    k = top_count(sum(r[0] for r in per_rank), ratio, rounding)
    if k == 0:
        return torch.zeros_like(ent), torch.full((), math.inf, device=ent.device)

    pooled, lower_ranks = _pooled_entropies(ent, mask, max(r[0] for r in per_rank), group)
    threshold = torch.topk(pooled, k).values[-1]  # v, the k-th largest pooled entropy
    ties_before = (lower_ranks == threshold).sum()  # ties held by lower ranks come first
    ties_wanted = k - (pooled > threshold).sum()

    tie = mask & (ent == threshold)
    tie_order = torch.cumsum(tie.reshape(-1).long(), 0).reshape(tie.shape)  # 1-based among local ties
    keep = (mask & (ent > threshold)) | (tie & (ties_before + tie_order <= ties_wanted))
    return keep.float(), threshold


__all__ = ["ROUNDINGS", "entropy_topk_mask", "entropy_topk_selection", "top_count"]
