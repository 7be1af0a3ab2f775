"""stapo_trl's pure pieces: S2T over one optimizer step (``s2t_window``), the rows the statistics forward
needs, the kept-token count of the token-normalised losses, the random strategy's seeds. No trainer."""

from __future__ import annotations

import math

import pytest
import torch

from stapo_core import s2t_mask
from stapo_trl import s2t_window
from stapo_trl.selection import kept_items, positive_advantage_rows, random_strategy_seed
from tests.helpers.dist_utils import run_on_ranks


def micro_batches(seed: int, sizes, length: int):
    """Per micro-batch ``(log_prob, entropy, advantages, mask)``: a third of the tokens below p = 0.05."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for size in sizes:
        p = torch.where(torch.rand(size, length, generator=g) < 0.33, torch.rand(size, length, generator=g) * 0.05,
                        torch.rand(size, length, generator=g) * 0.9 + 0.05)
        entropy = torch.rand(size, length, generator=g) * 3
        advantages = torch.randn(size, generator=g)
        mask = (torch.rand(size, length, generator=g) < 0.85).long()
        out.append((p.log(), entropy, advantages, mask))
    return out


def window(batches, **kwargs):
    return s2t_window(*[[b[i] for b in batches] for i in range(4)], **kwargs)


@pytest.mark.parametrize("strategy", ["low_entropy", "high_entropy", "full"])
def test_window_is_s2t_mask_of_the_joined_micro_batches(strategy):
    batches = micro_batches(0, sizes=(4, 4, 3), length=7)
    keeps, stats = window(batches, tau_p=0.05, q=0.75, strategy=strategy)
    joined = s2t_mask(*[torch.cat([b[i] for b in batches]) for i in range(4)], tau_p=0.05, q=0.75, strategy=strategy)
    assert [k.shape[0] for k in keeps] == [4, 4, 3]
    assert torch.equal(torch.cat(keeps), joined.keep)
    assert stats.keys() == joined.stats.keys()
    assert all((math.isnan(v) and math.isnan(joined.stats[k])) or v == joined.stats[k] for k, v in stats.items())
    assert stats["candidates"] > 4 and 0 < stats["silenced"] <= stats["candidates"]


def test_window_pools_tau_h_over_micro_batches():
    """tau_h of the step, not of each micro-batch: a micro-batch alone would silence other tokens."""
    batches = micro_batches(1, sizes=(4, 4), length=9)
    keeps, stats = window(batches, tau_p=0.05, q=0.75)
    alone = [window([b], tau_p=0.05, q=0.75) for b in batches]
    assert any(not torch.equal(k, a[0][0]) for k, a in zip(keeps, alone))
    assert all(a[1]["tau_h"] != stats["tau_h"] for a in alone)


def test_tau_p_zero_keeps_every_token():
    batches = micro_batches(2, sizes=(3, 3), length=5)
    keeps, stats = window(batches, tau_p=0.0, q=0.75)
    assert all(torch.equal(k, b[3].float()) for k, b in zip(keeps, batches))
    assert stats["candidates"] == stats["silenced"] == 0 and math.isnan(stats["tau_h"])
    assert stats["tokens"] == sum(int(b[3].sum()) for b in batches)


def test_window_refuses_unequal_lists():
    lp, ent, adv, mask = micro_batches(3, sizes=(2, 2), length=4)[0]
    with pytest.raises(ValueError, match="same .nonzero. number of micro-batches"):
        s2t_window([lp, lp], [ent], [adv, adv], [mask, mask], tau_p=0.05, q=0.75)


def _rank_window(rank, group, payload):
    keeps, stats = window(payload[rank], tau_p=0.05, q=0.75, group=group)
    return {"keeps": keeps, "stats": stats}


def test_pooled_quantile_equal_on_one_and_two_processes(tmp_path):
    """Two gloo processes with different completion lengths (as TRL pads per process) give the
    tau_h and masks of one process holding both batches."""
    rank0 = micro_batches(4, sizes=(4, 4), length=6)
    rank1 = micro_batches(5, sizes=(4, 4), length=9)
    results = run_on_ranks(_rank_window, [rank0, rank1], world=2, tmp_path=tmp_path)

    def pad(batch, length):  # the shorter completions padded with mask 0: no token added
        lp, ent, adv, mask = batch
        extra = length - lp.shape[1]
        return (torch.nn.functional.pad(lp, (0, extra)), torch.nn.functional.pad(ent, (0, extra)), adv,
                torch.nn.functional.pad(mask, (0, extra)))

    keeps, stats = window([pad(b, 9) for b in rank0] + rank1, tau_p=0.05, q=0.75)
    assert stats["candidates"] > 8 and stats["silenced"] > 0
    for result in results:
        assert result["stats"]["tau_h"] == stats["tau_h"]
        assert result["stats"]["silenced"] == stats["silenced"] and result["stats"]["tokens"] == stats["tokens"]
    assert all(torch.equal(k, pk[:, :6]) for k, pk in zip(results[0]["keeps"], keeps[:2]))
    assert all(torch.equal(k, pk) for k, pk in zip(results[1]["keeps"], keeps[2:]))


def test_positive_advantage_rows_are_those_with_a_positive_advantage_inside_the_mask():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])
    assert positive_advantage_rows(torch.tensor([0.5, -1.0, 2.0, 0.0]), mask).tolist() == [True, False, False, False]
    per_token = torch.tensor([[-1.0, 0.3, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [-1.0, -1.0, 0.1]])
    assert positive_advantage_rows(per_token, mask).tolist() == [True, False, False, True]  # row 2: outside the mask


def test_rows_without_a_positive_advantage_hold_no_candidate():
    """Zero statistics on the rows the forward skips change no S2T decision (log p = 0 is p = 1)."""
    batches = micro_batches(6, sizes=(6, 6), length=8)
    keeps, stats = window(batches, tau_p=0.05, q=0.75)
    zeroed = []
    for lp, ent, adv, mask in batches:
        rows = positive_advantage_rows(adv, mask)
        zeroed.append((torch.where(rows[:, None], lp, 0.0), torch.where(rows[:, None], ent, 0.0), adv, mask))
    keeps_z, stats_z = window(zeroed, tau_p=0.05, q=0.75)
    assert stats["silenced"] > 0 and not all(bool(positive_advantage_rows(b[2], b[3]).all()) for b in batches)
    assert all(torch.equal(a, b) for a, b in zip(keeps, keeps_z))
    assert all(v == stats_z[k] or (math.isnan(v) and math.isnan(stats_z[k])) for k, v in stats.items())


def test_kept_items_scale_trls_count_by_the_kept_fraction():
    n = torch.tensor(120)
    assert kept_items(n, 40, 40) is n  # nothing silenced: TRL's own tensor
    assert kept_items(n, 30, 40).dtype == torch.int64 and int(kept_items(n, 30, 40)) == 90
    odd = kept_items(n, 7, 50)
    assert odd.dtype == torch.float32 and odd.item() == pytest.approx(16.8)
    assert kept_items(n, 7, 9).item() == pytest.approx(120 * 7 / 9)
    assert int(kept_items(n, 0, 40)) == 0  # every token silenced: TRL clamps the divisor to 1, the loss is 0
    assert int(kept_items(torch.tensor(40), 33, 40)) == 33  # one optimizer step per generation: sum(M)


def test_random_strategy_seeds_differ_by_process_and_by_seed():
    seeds = {random_strategy_seed(seed, rank) for seed in range(4) for rank in range(64)}
    assert len(seeds) == 4 * 64
    assert random_strategy_seed(3, 5) == 3 * 1_000_003 + 5  # the verl recipe's per-rank seed
