"""S2T over the micro-batches of one optimizer step, from :func:`stapo_core.s2t_mask`, and the
pure pieces of STAPOTrainer's loss: which completions need statistics, and the kept-token count
TRL's token-normalised losses divide by.

The paper's ``tau_h`` is a statistic of the optimizer step's whole batch, so its micro-batches are
joined along the batch dimension (TRL pads a generation batch once) and pooled over the processes.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from stapo_core import s2t_mask
from stapo_core.checks import token_advantages
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


def random_strategy_seed(seed: int, process_index: int) -> int:
    """The seed of process ``process_index``'s generator for ``strategy="random"``: each process draws
    for its own candidates from its own generator, seeded apart as the verl recipe seeds each rank
    (``seed x 1,000,003 + rank``), so two processes (or two seeds) never share draws."""
    return seed * 1_000_003 + process_index


def positive_advantage_rows(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """bool ``(batch,)``: the completions with a positive advantage at some token of ``mask``, the
    only ones that can hold an S2T candidate (``A > 0``).

    Args:
        advantages: ``(batch,)`` or ``(batch, completion_len)`` float.
        mask: ``(batch, completion_len)``, nonzero marks the tokens the loss uses.
    """
    return ((token_advantages("positive_advantage_rows", advantages, mask, "mask") > 0) & (mask != 0)).any(-1)


def kept_items(num_items_in_batch: torch.Tensor, kept: int, tokens: int) -> torch.Tensor:
    """TRL's ``num_items_in_batch`` for the loss over the kept tokens: ``N x kept / tokens``.

    TRL's ``dapo``, ``cispo`` and ``vespo`` then divide by the step's kept tokens when the generation
    is one optimizer step, the paper's ``J_STAPO`` (docs/trl.md).

    Args:
        num_items_in_batch: 0-dim integer tensor, TRL's count ``N``.
        kept, tokens: the optimizer step's kept and loss tokens over every process (``kept <= tokens``).

    Returns:
        ``num_items_in_batch`` itself when ``kept == tokens``; else a 0-dim tensor on its device,
        of its dtype when the value is a whole number, float32 otherwise.
    """
    if kept == tokens:
        return num_items_in_batch
    value = float(num_items_in_batch) * kept / max(tokens, 1)
    dtype = num_items_in_batch.dtype if value.is_integer() else torch.float32
    return torch.tensor(value, dtype=dtype, device=num_items_in_batch.device)


__all__ = ["kept_items", "positive_advantage_rows", "random_strategy_seed", "s2t_window"]
