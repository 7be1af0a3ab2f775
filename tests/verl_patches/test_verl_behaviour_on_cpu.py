"""What the recipe relies on in verl's own losses, which no patch wraps and so no anchor of the patch
table sees (``python -m verl_patches check``): computed here with the installed verl's functions, so a
verl release that changes it fails these tests (docs/cluster.md, "Trying a newer verl").

* verl 0.9.1's ``gspo`` aggregates by ``loss_agg_mode``; verl 0.9.0 and verl's main branch force
  ``seq-mean-token-mean``. The STAPO+GSPO run (``run_scripts/ablations.sh compose``) keeps the recipe's
  ``token-mean``, and docs/method.md states its gradient under it.
* verl's ``geo_mean`` is the plain mean over the micro-batch's sequences, blind to the mini-batch's
  sequence count and the data-parallel size; the recipe's mean over the sequences that keep a token
  (``verl_patches/losses.py``) rescales exactly that mean. A verl whose ``geo_mean`` takes each
  micro-batch's share of the mini-batch over the data-parallel ranks (a change proposed upstream) would
  be corrected twice.
"""

from __future__ import annotations

import torch

from tests.helpers.verl_batch import actor_config, right_padded_mask
from verl.trainer.ppo.core_algos import get_policy_loss_fn

PL = "actor_rollout_ref.actor.policy_loss"


def batch(rows: int = 6, width: int = 10, seed: int = 0):
    """Responses of unequal lengths whose sequences differ in advantage and ratio: the token mean and
    the mean of the sequences' means of any per-token loss differ."""
    g = torch.Generator().manual_seed(seed)
    mask = right_padded_mask(torch.tensor([2, width, 4, width - 1, 3, width])[:rows], width)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.5, 1.5])[:rows, None].expand(rows, width).clone()
    old = -torch.rand(rows, width, generator=g) * 2.0
    log_prob = old + 0.3 * torch.randn(rows, width, generator=g)
    return mask, old, log_prob, adv


def set_global_batch(config, mask: torch.Tensor, global_batch_size: int, dp_size: int) -> None:
    """What verl's ``ppo_loss`` tells a policy loss about the mini-batch (``config.global_batch_info``)."""
    config.global_batch_info.update(dp_size=dp_size, batch_num_tokens=int(mask.sum()) * dp_size,
                                    global_batch_size=global_batch_size, loss_scale_factor=config.loss_scale_factor)


def test_gspo_aggregates_the_recipes_token_mean():
    """verl's gspo under the STAPO+GSPO run's config is the token mean of GSPO's per-token loss
    ``max(-A s_i, -A clip(s_i, 1 - 0.2, 1 + 0.28))``, ``s_i = exp(mean_t log r_t)``, not the mean of the
    sequences' means (what verl 0.9.0 and main compute whatever loss_agg_mode says)."""
    config = actor_config("method=stapo", f"{PL}.loss_mode=gspo")
    assert config.loss_agg_mode == "token-mean"
    mask, old, log_prob, adv = batch()
    set_global_batch(config, mask, global_batch_size=mask.shape[0], dp_size=1)
    loss, _ = get_policy_loss_fn("gspo")(old, log_prob, adv, mask, loss_agg_mode=config.loss_agg_mode, config=config)

    seq_ratio = torch.exp(((log_prob - old) * mask).sum(-1) / mask.sum(-1))[:, None]
    clipped = seq_ratio.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    per_token = torch.maximum(-adv * seq_ratio, -adv * clipped) * mask
    token_mean = per_token.sum() / mask.sum()
    seq_mean_token_mean = (per_token.sum(-1) / mask.sum(-1)).mean()
    assert abs(float(token_mean - seq_mean_token_mean)) > 0.05  # the batch tells the two apart
    torch.testing.assert_close(loss, token_mean)


def test_geo_mean_is_the_mean_over_its_micro_batch_whatever_the_mini_batch():
    """verl's geo_mean of a micro-batch is the mean of its sequences' own geo_mean losses, whether the
    micro-batch is the whole mini-batch on one rank or a quarter of it on one of two ranks (verl then
    sums the micro-batches' losses and averages the ranks' gradients): what the recipe's mean over the
    kept sequences assumes. A data-parallel-aware geo_mean (each micro-batch's sum over the mini-batch's
    sequences times the ranks) breaks the equality."""
    config = actor_config("method=stapo", f"{PL}.loss_mode=geo_mean")
    geo_mean = get_policy_loss_fn("geo_mean")
    mask, old, log_prob, adv = batch()
    alone = []
    for i in range(mask.shape[0]):
        set_global_batch(config, mask[i:i + 1], global_batch_size=1, dp_size=1)
        alone.append(geo_mean(old[i:i + 1], log_prob[i:i + 1], adv[i:i + 1], mask[i:i + 1], config=config)[0])
    alone = torch.stack(alone)
    assert alone.std() > 0.1  # sequences of different losses: a mean over another count differs
    for rows, global_batch_size, dp_size in [(slice(0, 6), 6, 1), (slice(0, 3), 12, 2), (slice(3, 6), 12, 2)]:
        set_global_batch(config, mask[rows], global_batch_size=global_batch_size, dp_size=dp_size)
        loss, _ = geo_mean(old[rows], log_prob[rows], adv[rows], mask[rows], config=config)
        torch.testing.assert_close(loss, alone[rows].mean())
