"""S2T over the micro-batches of one optimizer step, from :func:`stapo_core.s2t_mask`.

TRL splits the batch of one optimizer step into gradient-accumulation micro-batches (and over the
processes). The paper's ``tau_h`` is a statistic of that whole batch, so the micro-batches of a
step are joined along the batch dimension and ``stapo_core.s2t_mask`` pools the candidates over
the processes of ``group``. Micro-batches of one process share their completion length (TRL pads a
generation batch once); processes may differ, which the pooling allows.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from stapo_core import s2t_mask
from stapo_core.distributed import all_reduce_sum


def _no_candidate_result(masks: Sequence[torch.Tensor], group) -> tuple[list, dict]:
    """``tau_p = 0``: no token has ``p < 0``, so every token is kept; the statistics say so."""
    tokens = all_reduce_sum(torch.stack([m.ne(0).sum().double() for m in masks]).sum().reshape(1), group)
    tokens = int(tokens.item())
    stats = {"candidates": 0, "silenced": 0, "tokens": tokens, "silenced_frac": 0.0, "tau_h": math.nan,
             "entropy_silenced_mean": math.nan, "entropy_kept_candidates_mean": math.nan}
    return [m.ne(0).float() for m in masks], stats


def s2t_window(
    log_probs: Sequence[torch.Tensor],
    entropies: Sequence[torch.Tensor],
    advantages: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    *,
    tau_p: float,
    q: float,
    strategy: str = "low_entropy",
    group=None,
    generator: Optional[torch.Generator] = None,
) -> tuple[list, dict]:
    """S2T keep masks of the micro-batches of one optimizer step, ``tau_h`` pooled over all of them.

    Args:
        log_probs, entropies: per micro-batch, ``(batch_k, completion_len)`` float: log p of the
            sampled token and the entropy of the policy at each completion position.
        advantages: per micro-batch, ``(batch_k,)`` or ``(batch_k, completion_len)``.
        masks: per micro-batch, ``(batch_k, completion_len)``: nonzero marks the tokens the loss uses.
        tau_p: candidates have ``p < tau_p``; in [0, 1), 0 meaning no candidate at all.
        q, strategy, group, generator: as :func:`stapo_core.s2t_mask` (``group``: the processes to
            pool over, None for one process).

    Returns:
        ``(keeps, stats)``: one float32 keep mask per micro-batch (1 keep, 0 silenced or outside
        the mask) and ``s2t_mask``'s statistics of the whole step (every process alike).
    """
    n = len(masks)
    if not n or any(len(seq) != n for seq in (log_probs, entropies, advantages)):
        raise ValueError(
            "s2t_window: log_probs, entropies, advantages and masks must list the same (nonzero) number of "
            f"micro-batches, got {len(log_probs)}, {len(entropies)}, {len(advantages)}, {n}"
        )
    if tau_p == 0:
        return _no_candidate_result(masks, group)
    sizes = [m.shape[0] for m in masks]
    result = s2t_mask(
        torch.cat(list(log_probs)),
        torch.cat(list(entropies)),
        torch.cat(list(advantages)),
        torch.cat(list(masks)),
        tau_p=tau_p,
        q=q,
        strategy=strategy,
        generator=generator,
        group=group,
    )
    return list(result.keep.split(sizes)), result.stats


__all__ = ["s2t_window"]
