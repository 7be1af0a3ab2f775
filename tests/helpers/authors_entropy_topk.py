"""20-Entropy as its authors' code runs it, reimplemented from that code for the tests.

Source: github.com/Shenzhi-Wang/Beyond-the-80-20-Rule-RLVR at commit 137d8d1e253c355d4cf86b8bb2dded5aa0d93580
(the fix of ``flat_mask``, which their README asks every user to have), files
``verl/trainer/ppo/core_algos.py`` (``get_global_entropy_top_mask``, ``compute_policy_loss_vanilla``,
``agg_loss``, with verl's ``masked_mean``) and ``verl/workers/actor/dp_actor.py``
(``DataParallelPPOActor.update_policy``). Per data-parallel rank, per micro-batch:

- the entropy is the update's own forward of the micro-batch;
- the mask keeps the ``max(1, int(N * ratio + 0.9999))`` highest-entropy response tokens of the
  micro-batch (``torch.topk``; N its response tokens);
- the loss is verl's vanilla PPO loss (dual clip) averaged over the kept tokens of the micro-batch
  (``masked_mean``, denominator + 1e-8), times ``loss_scale_factor``: the micro-batch's share of the
  rank's mini-batch sequences;
- gradients accumulate over the micro-batches and are averaged over the ranks.

Written from that code, independently of the recipe (no recipe import).
"""

from __future__ import annotations

import torch


def top_mask(entropy: torch.Tensor, response_mask: torch.Tensor, top_ratio: float) -> torch.Tensor:
    """``get_global_entropy_top_mask``: long ``(batch, resp_len)``, 1 on the selected tokens."""
    flat_entropy = entropy.flatten()
    flat_mask = response_mask.flatten().bool()
    response_entropy = flat_entropy[flat_mask]
    if response_entropy.numel() == 0:
        return torch.zeros_like(entropy, dtype=torch.long)
    top_k = max(1, int(len(response_entropy) * top_ratio + 0.9999))
    _, topk_idx = torch.topk(response_entropy, k=top_k)
    top_positions = flat_mask.nonzero(as_tuple=False).squeeze(1)[topk_idx]
    flat_out = torch.zeros_like(flat_entropy, dtype=torch.long)
    flat_out[top_positions] = 1
    return flat_out.view_as(entropy)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's ``masked_mean`` (``verl.utils.torch_functional``)."""
    return (values * mask).sum() / (mask.sum() + 1e-8)


def vanilla_token_losses(old_log_prob, log_prob, advantages, clip_low, clip_high, clip_c):
    """``compute_policy_loss_vanilla``'s per-token ``pg_losses`` (asymmetric clip, dual clip)."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    return torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)


def rank_update(micro_batches, mini_batch_size: int, top_ratio: float, clip_low: float, clip_high: float,
                clip_c: float):
    """One rank's ``update_policy`` on one mini-batch (token-mean, no KL, no entropy bonus).

    ``micro_batches``: ``(log_prob leaf requiring grad, old_log_prob, advantages, response_mask,
    entropy)`` per micro-batch, ``(n_mb, resp_len)`` each; ``mini_batch_size``: the rank's mini-batch
    sequences. Accumulates the gradient into each ``log_prob``; returns the summed loss and the
    number of tokens kept per micro-batch.
    """
    total, kept = torch.zeros(()), []
    for log_prob, old_log_prob, advantages, response_mask, entropy in micro_batches:
        loss_scale_factor = response_mask.shape[0] / mini_batch_size
        entropy_top_mask = top_mask(entropy, response_mask, top_ratio)
        pg_losses = vanilla_token_losses(old_log_prob, log_prob, advantages, clip_low, clip_high, clip_c)
        pg_loss = masked_mean(pg_losses, response_mask * entropy_top_mask)
        loss = pg_loss * loss_scale_factor
        loss.backward()
        total = total + loss.detach()
        kept.append(int(entropy_top_mask.sum()))
    return total, kept
