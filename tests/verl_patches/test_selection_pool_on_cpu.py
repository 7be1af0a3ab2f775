"""Token selection pooled over groups of data-parallel ranks (``policy_loss.ranks_per_pool``): 4 gloo
processes in 2 groups of 2 give, in each group, the selection one process makes on the union of that
group's tokens (stapo_core's top-k over a subgroup, the mini-batch fold, the micro-batch scope of the
authors' pool), while verl's token count and the S2T monitor stay over all 4 ranks; the groups are made
once, by the actor's init, on every rank.

All cases run in one spawn of 4 processes (one process-group start-up).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import verl_patches.activate  # noqa: F401  (the recipe's loss and fold, as in a run)
from recipe.stapo.driver import compose
from stapo_core.distributed import contiguous_subgroups, split_contiguous
from stapo_core.entropy_topk import entropy_topk_selection
from tests.helpers.dist_utils import run_on_ranks
from tests.helpers.verl_batch import flat_model_output, micro_batch, right_padded_mask
from verl.utils.config import omega_conf_to_dataclass
from verl_patches import selection_pool
from verl_patches.losses import ppo_loss_with_token_selection
from verl_patches.token_selection import fold_into_mini_batch

PL = "actor_rollout_ref.actor.policy_loss"
WORLD, K = 4, 2
R = 12
#: rows of the mini-batch each rank holds (uneven: the groups {0, 1} and {2, 3} hold 5 and 7 rows)
ROWS = {0: [0, 1], 1: [2, 3, 4], 2: [5, 6, 7, 8], 3: [9, 10, 11]}
AUTHORS_POOL = [f"{PL}.stats_from=current", f"{PL}.scope=micro_batch"]


def group_of(rank: int) -> list[int]:
    return [r for r in range(WORLD) if r // K == rank // K]


def group_rows(rank: int) -> list[int]:
    return [i for r in group_of(rank) for i in ROWS[r]]


def mini_batch(seed: int = 0):
    """``(mask, old_log_prob, log_prob, entropy, current_entropy, advantages)`` of the whole mini-batch,
    entropies quantized so that ties sit at every threshold."""
    g = torch.Generator().manual_seed(seed)
    n = sum(len(v) for v in ROWS.values())
    mask = right_padded_mask(torch.randint(4, R + 1, (n,), generator=g), R)
    old = -torch.rand(n, R, generator=g) * 3
    log_prob = old + 0.1 * torch.randn(n, R, generator=g)
    entropy = torch.randint(0, 6, (n, R), generator=g).float() / 4
    current = torch.randint(0, 6, (n, R), generator=g).float() / 4
    adv = torch.randn(n, generator=g)[:, None].expand(n, R).clone()
    return mask, old, log_prob, entropy, current, adv


def actor(method: str = "entropy20", *overrides: str):
    return omega_conf_to_dataclass(compose([f"method={method}", "model=qwen3_1_7b", *overrides]).actor_rollout_ref.actor)


def fold_and_loss(config, rows, group=None):
    """The mini-batch fold on ``rows`` (pooled by ``config``'s ranks_per_pool over ``group``), verl's
    token count over ``group``, and the loss of one micro-batch. Returns (folded mask, metrics, grad)."""
    mask, old, log_prob, entropy, _, adv = (t[rows] for t in mini_batch())
    data = micro_batch(mask, old, adv, entropy=entropy, dp_size=1 if group is None else WORLD)
    metrics = fold_into_mini_batch(config.policy_loss, data, group=group)
    folded = data["response_mask"].clone()
    count = data["loss_mask"].sum()
    if group is not None:
        dist.all_reduce(count, group=group)
    lp = log_prob.clone().requires_grad_(True)
    mb = micro_batch(folded, old, adv, valid=mask, dp_size=1 if group is None else WORLD,
                     batch_num_tokens=int(count), global_batch_size=len(ROWS))
    loss, _ = ppo_loss_with_token_selection(config=config, model_output={"log_probs": flat_model_output(lp, mask)},
                                            data=mb, dp_group=group)
    loss.backward()
    return folded, metrics, lp.grad


def micro_batch_scope(config, rows, group=None):
    """One micro-batch of the micro-batch scope on ``rows``, the update's entropy from the model output.
    Returns (the mask the loss ran over, the selection's metrics)."""
    mask, old, log_prob, _, current, adv = (t[rows] for t in mini_batch())
    data = micro_batch(mask, old, adv, dp_size=1 if group is None else WORLD, global_batch_size=len(ROWS))
    output = {"log_probs": flat_model_output(log_prob, mask), "entropy": flat_model_output(current, mask)}
    _, metrics = ppo_loss_with_token_selection(config=config, model_output=output, data=data, dp_group=group)
    return data["response_mask"].clone(), {k: v.values for k, v in metrics.items() if k.startswith("entropy_topk/")}


def _on_rank(rank, world, _payload):
    out = {}
    # the actor's init makes the groups: every rank, once
    pooled = actor("entropy20", f"{PL}.ranks_per_pool={K}")
    engine = SimpleNamespace(get_data_parallel_group=lambda: dist.group.WORLD)
    worker = SimpleNamespace(actor=SimpleNamespace(loss_fn=functools.partial(print, config=pooled), engine=engine))
    selection_pool.wrap_init_model(lambda self: None)(worker)
    made = dict(selection_pool._POOLS)
    group = selection_pool.pool_group(pooled.policy_loss, dist.group.WORLD)
    out["made"] = {key: dist.get_process_group_ranks(g) for key, g in made.items()}
    out["same_group_object"] = group is next(iter(made.values())) and selection_pool._POOLS == made
    out["pool_members"] = dist.get_process_group_ranks(group)

    # stapo_core: 20-Entropy's top-k over the subgroup
    mask, _, _, entropy, _, _ = (t[ROWS[rank]] for t in mini_batch())
    keep, threshold = entropy_topk_selection(entropy, mask, ratio=0.2, group=group)
    out["topk"] = (keep, float(threshold))
    out["whole_group"] = contiguous_subgroups(dist.group.WORLD, WORLD) is dist.group.WORLD
    out["alone"] = contiguous_subgroups(dist.group.WORLD, 1) is None

    # the mini-batch fold and its loss (the shipped reading, grouped)
    out["fold"] = fold_and_loss(pooled, ROWS[rank], dist.group.WORLD)
    # the authors' pool: each micro-batch pooled over the group, the update's entropy
    authors = actor("entropy20", *AUTHORS_POOL, f"{PL}.ranks_per_pool={K}")
    out["micro"] = micro_batch_scope(authors, ROWS[rank], dist.group.WORLD)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_on_ranks(_on_rank, None, WORLD, tmp_path_factory.mktemp("pool"))


def test_the_groups_are_made_once_by_the_actors_init_on_every_rank(ranks):
    for rank, out in enumerate(ranks):
        assert out["made"] == {(tuple(range(WORLD)), K): group_of(rank)}
        assert out["same_group_object"] and out["pool_members"] == group_of(rank)
        assert out["whole_group"] and out["alone"]


def test_top_k_over_a_group_of_ranks_is_one_process_over_the_union_of_its_tokens(ranks):
    mask, _, _, entropy, _, _ = mini_batch()
    for rank, out in enumerate(ranks):
        rows = group_rows(rank)
        keep, threshold = entropy_topk_selection(entropy[rows], mask[rows], ratio=0.2)
        offset = rows.index(ROWS[rank][0])
        torch.testing.assert_close(out["topk"][0], keep[offset:offset + len(ROWS[rank])], rtol=0, atol=0)
        assert out["topk"][1] == float(threshold)
    # the two groups' thresholds are their own (not the pool of all 4 ranks)
    whole = entropy_topk_selection(entropy, mask, ratio=0.2)[0]
    assert not torch.equal(torch.cat([ranks[r]["topk"][0] for r in range(WORLD)]), whole)


def test_the_mini_batch_fold_selects_per_group_and_the_loss_is_the_mean_over_every_kept_token(ranks):
    pooled, single = actor("entropy20", f"{PL}.ranks_per_pool={K}"), actor("entropy20")
    for rank, out in enumerate(ranks):
        rows = group_rows(rank)
        folded, metrics, _ = fold_and_loss(single, rows)  # one process on the group's union
        offset = rows.index(ROWS[rank][0])
        torch.testing.assert_close(out["fold"][0], folded[offset:offset + len(ROWS[rank])], rtol=0, atol=0)
        own = {k: v for k, v in metrics.items() if k.startswith("entropy_topk/")}
        assert {k: v for k, v in out["fold"][1].items() if k.startswith("entropy_topk/")} == own
        assert own["entropy_topk/tokens"] == float(mini_batch()[0][rows].sum())
    # the S2T monitor keeps the paper's pool: all 4 ranks, one tau_h
    everything = list(range(sum(len(v) for v in ROWS.values())))
    _, monitor, _ = fold_and_loss(single, everything)
    for out in ranks:
        assert {k: v for k, v in out["fold"][1].items() if k.startswith("s2t/")} == \
            {k: v for k, v in monitor.items() if k.startswith("s2t/")}
    # the loss: verl's token-mean over every rank's kept tokens (the count all-reduced over the 4 ranks),
    # i.e. one process on the whole mini-batch with the groups' masks, with no selection of its own
    mask, old, log_prob, _, _, adv = mini_batch()
    kept = torch.cat([ranks[r]["fold"][0] for r in range(WORLD)])
    lp = log_prob.clone().requires_grad_(True)
    data = micro_batch(kept, old, adv, valid=mask, global_batch_size=len(ROWS))
    loss, _ = ppo_loss_with_token_selection(config=actor("justrl"), model_output={"log_probs": flat_model_output(lp, mask)},
                                            data=data)
    loss.backward()
    assert pooled.policy_loss.ranks_per_pool == K and kept.sum() < mask.sum()
    for rank, out in enumerate(ranks):  # FSDP averages the ranks' gradients
        torch.testing.assert_close(out["fold"][2] / WORLD, lp.grad[ROWS[rank]])


def test_the_authors_pool_selects_each_micro_batch_over_its_group(ranks):
    single = actor("entropy20", *AUTHORS_POOL)
    for rank, out in enumerate(ranks):
        rows = group_rows(rank)
        selected, metrics = micro_batch_scope(single, rows)
        offset = rows.index(ROWS[rank][0])
        torch.testing.assert_close(out["micro"][0], selected[offset:offset + len(ROWS[rank])], rtol=0, atol=0)
        assert out["micro"][1] == metrics
        mask, _, _, _, current, _ = mini_batch()
        keep, _ = entropy_topk_selection(current[rows], mask[rows], ratio=0.2)
        torch.testing.assert_close(selected.float(), keep, rtol=0, atol=0)


def test_split_contiguous_cuts_in_rank_order_and_refuses_a_size_that_does_not_divide():
    assert split_contiguous([4, 5, 6, 7, 8, 9], 2) == [[4, 5], [6, 7], [8, 9]]
    assert split_contiguous(list(range(64)), 8)[7] == list(range(56, 64))
    for size in (4, 0, True, 7.0):
        with pytest.raises(ValueError, match="does not divide the 6 ranks"):
            split_contiguous(list(range(6)), size)
