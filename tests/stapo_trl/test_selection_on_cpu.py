"""stapo_trl's S2T over one optimizer step (``s2t_window``) and ``STAPOConfig``'s checks: no trainer."""

from __future__ import annotations

import math

import pytest
import torch

from stapo_core import s2t_mask
from stapo_trl import STAPOConfig, s2t_window
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


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"tau_p": -0.1}, "tau_p=-0.1 is invalid"),
        ({"tau_p": 1.0}, "tau_p=1.0 is invalid"),
        ({"q": 0.0}, "q=0.0 is invalid"),
        ({"strategy": "lowest"}, "strategy='lowest' is invalid"),
        ({"top_entropy_quantile": 0.2}, "top_entropy_quantile=0.2"),
        ({"steps_per_generation": 3}, "steps_per_generation=3 is not a multiple of gradient_accumulation_steps=2"),
    ],
)
def test_config_refuses_bad_settings_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        STAPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                    gradient_accumulation_steps=2, report_to="none", **overrides)


def test_config_defaults_are_the_papers(tmp_path):
    args = STAPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                       report_to="none")
    assert (args.tau_p, args.q, args.strategy) == (0.002, 0.75, "low_entropy")
