"""stapo_core.balance: the forward plan of the positive-advantage sequences over data-parallel ranks.

Closed forms on small cases (the assignment by hand), and properties on random ones: every sequence
forwarded exactly once, every rank with the same number of micro-batches, each within its limit, the
slowest rank within one sequence of the mean (the longest-first greedy bound).
"""

from __future__ import annotations

import random

import pytest

from stapo_core.balance import Item, assign_by_tokens, plan_forward, split_micro_batches


def test_longest_first_to_the_least_loaded_rank_by_hand():
    items = [Item(0, i, n) for i, n in enumerate([10, 9, 8, 3, 2])]
    shares = assign_by_tokens(items, 2)
    # 10 -> rank 0 (its owner, both empty); 9 -> 1; 8 -> 1 (9 < 10); 3 -> 0 (10 < 17); 2 -> 0 (13 < 17)
    assert [[it.tokens for it in share] for share in shares] == [[10, 3, 2], [9, 8]]


def test_a_tie_keeps_a_sequence_on_its_rank():
    shares = assign_by_tokens([Item(1, 4, 5), Item(0, 2, 5)], 2)
    assert shares == [[Item(0, 2, 5)], [Item(1, 4, 5)]]


def test_micro_batches_by_rows_and_by_token_budget():
    items = [Item(0, i, n) for i, n in enumerate([7, 6, 5, 4, 3])]
    assert [[it.tokens for it in mb] for mb in split_micro_batches(items, max_rows=2)] == [[7, 6], [5, 4], [3]]
    # first fit into bins of 12 tokens: 7 | 6 -> new bin | 5 -> first bin (12) | 4 -> second (10) | 3 -> third
    assert [[it.tokens for it in mb] for mb in split_micro_batches(items, max_tokens=12)] == [[7, 5], [6, 4], [3]]
    assert split_micro_batches(items) == [items]
    assert split_micro_batches([], max_rows=2) == []
    assert split_micro_batches([Item(0, 0, 50)], max_tokens=12) == [[Item(0, 0, 50)]]  # longer than the budget


def test_ranks_are_padded_to_the_same_number_of_micro_batches_with_the_shortest_sequence():
    # rank 1 holds no positive-advantage sequence; one rank gets 3 sequences of 1 row each
    items = [Item(0, 0, 40), Item(0, 1, 30), Item(0, 2, 12), Item(0, 3, 11)]
    plan = plan_forward(items, 2, max_rows=1)
    assert plan.num_micro_batches == 2
    assert plan.dummy == Item(0, 3, 11)
    forwarded = [it for r in range(2) for mb, pad in zip(plan.micro_batches[r], plan.padding[r]) if not pad for it in mb]
    assert sorted(forwarded, key=lambda it: it.index) == items
    assert all(len(mbs) == 2 for mbs in plan.micro_batches)
    for r in range(2):
        for mb, pad in zip(plan.micro_batches[r], plan.padding[r]):
            assert not pad or mb == (plan.dummy,)
    # 40 -> 0; 30 -> 1; 12 -> 1 (30 < 40) -> 42; 11 -> 0 (40 < 42): [51, 42]
    assert plan.rank_tokens() == [51, 42]


def test_more_ranks_than_sequences_pads_the_empty_ranks():
    plan = plan_forward([Item(2, 0, 9)], 4, max_tokens=100)
    assert plan.num_micro_batches == 1
    assert plan.padding == ((True,), (True,), (False,), (True,))
    assert plan.rank_tokens() == [9, 9, 9, 9]


def test_no_sequence_no_forward():
    plan = plan_forward([], 3, max_rows=2)
    assert plan.num_micro_batches == 0 and plan.dummy is None and plan.rank_tokens() == [0, 0, 0]


@pytest.mark.parametrize("seed", range(5))
def test_random_plans_forward_everything_once_within_limits_and_balanced(seed):
    rng = random.Random(seed)
    world = rng.choice([2, 3, 8])
    items = [Item(rng.randrange(world), i, rng.randint(1, 400)) for i in range(rng.randint(1, 40))]
    budget = 600
    plan = plan_forward(items, world, max_tokens=budget)
    counts = {len(mbs) for mbs in plan.micro_batches}
    assert len(counts) == 1
    real = [it for r in range(world) for mb, pad in zip(plan.micro_batches[r], plan.padding[r]) if not pad for it in mb]
    assert sorted(real, key=lambda it: it.index) == sorted(items, key=lambda it: it.index)
    assert all(sum(it.tokens for it in mb) <= budget for mbs in plan.micro_batches for mb in mbs)
    loads = [sum(it.tokens for it in share) for share in assign_by_tokens(items, world)]
    mean = sum(it.tokens for it in items) / world
    assert max(loads) <= mean + max(it.tokens for it in items)  # greedy longest-first bound
    held = [sum(it.tokens for it in items if it.owner == r) for r in range(world)]
    real_loads = [sum(it.tokens for mb, pad in zip(mbs, pads) if not pad for it in mb)
                  for mbs, pads in zip(plan.micro_batches, plan.padding)]
    assert max(real_loads) <= max(held)  # never busier than each rank forwarding its own sequences


def test_nothing_moves_when_the_ranks_own_shares_are_better_balanced():
    # greedy longest-first gives [3, 2, 2] / [3, 2] = 7 / 5; the ranks already hold 6 / 6
    items = [Item(0, 0, 3), Item(0, 1, 3), Item(1, 0, 2), Item(1, 1, 2), Item(1, 2, 2)]
    assert max(sum(it.tokens for it in share) for share in assign_by_tokens(items, 2)) == 7
    plan = plan_forward(items, 2)
    assert [[it.owner for mb in mbs for it in mb] for mbs in plan.micro_batches] == [[0, 0], [1, 1, 1]]
    assert plan.rank_tokens() == [6, 6]


def test_the_plan_is_deterministic():
    items = [Item(i % 3, i, 7 * (i % 5) + 1) for i in range(20)]
    assert plan_forward(items, 3, max_rows=2) == plan_forward(list(reversed(items)), 3, max_rows=2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(world=0), "world=0"),
    (dict(world=2, max_rows=1, max_tokens=5), "not both"),
    (dict(world=2, max_rows=0), "max_rows=0"),
    (dict(world=2, max_tokens=-1), "max_tokens=-1"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_forward([Item(0, 0, 3)], **kwargs)


def test_an_owner_outside_the_ranks_is_refused():
    with pytest.raises(ValueError, match="owner outside"):
        plan_forward([Item(2, 0, 3)], 2)
