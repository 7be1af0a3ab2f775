"""Invariance of the mini-batch S2T statistic: for one mini-batch, the silenced set and the loss
(and its gradient) do not change with the micro-batch size or the number of data-parallel ranks.

Both sources of the statistics are covered: the rollout-time ones carried in the mini-batch, and
``stats_from=current`` (each rank's share of the mini-batch forwarded under the current policy; given
here as fixed tensors, the forward itself is checked on the real trainer by
tests/e2e/test_current_stats_e2e_on_cpu.py).

The actor's side of verl is reproduced as its engine runs it (``forward_backward_batch``): fold the
mask into the mini-batch (our ``TrainingWorker.train_batch`` wrapper), count ``batch_num_tokens``
all-reduced over ranks, split into micro-batches, call the loss per micro-batch and accumulate
gradients; FSDP averages gradients over ranks.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import verl_patches.activate  # noqa: F401
from recipe.stapo.driver import compose
from verl.utils.config import omega_conf_to_dataclass
from tests.helpers.verl_batch import flat_model_output, micro_batch, right_padded_mask
from verl_patches.losses import ppo_loss_with_token_selection
from verl_patches.token_selection import fold_into_mini_batch

B, R = 8, 10


def make_mini_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, R + 1, (B,), generator=g)
    mask = right_padded_mask(lengths, R)
    adv = torch.randn(B, generator=g)[:, None].expand(B, R).clone()
    old = -torch.rand(B, R, generator=g) * 2
    rare = torch.rand(B, R, generator=g) < 0.35
    old[rare] = -7.0 - torch.rand(int(rare.sum()), generator=g)
    log_prob = old + 0.1 * torch.randn(B, R, generator=g)
    entropy = torch.rand(B, R, generator=g) * 4
    return mask, old, log_prob, entropy, adv


def actor(method):
    cfg = compose([f"method={method}", "model=qwen3_1_7b"])
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def current_statistics(seed=0):
    """(log_prob, entropy) of the whole mini-batch under a "current" policy that differs from the
    rollout one (other probabilities, entropies permuted along each response)."""
    _, old, log_prob, entropy, _ = make_mini_batch(seed)
    return log_prob - 0.5 * torch.rand(B, R, generator=torch.Generator().manual_seed(seed + 1)), entropy.flip(1)


def engine_step(config, rows, micro_size, group=None, dp_size=1, seed=0, stats="rollout"):
    """One mini-batch as verl's actor runs it on this rank. Returns (loss, grad, keep, metrics).
    ``stats``: where the selection's statistics come from (``rollout`` or ``current``)."""
    mask, old, log_prob, entropy, adv = (t[rows] for t in make_mini_batch(seed))
    data = micro_batch(mask, old, adv, entropy=entropy, dp_size=dp_size)
    current = tuple(t[rows] for t in current_statistics(seed)) if stats == "current" else None
    metrics = fold_into_mini_batch(config.policy_loss, data, group=group, current=current)
    folded = data["response_mask"].clone()
    batch_num_tokens = data["loss_mask"].sum()
    if group is not None:
        dist.all_reduce(batch_num_tokens, group=group)
    lp = log_prob.clone().requires_grad_(True)
    total = torch.zeros(())
    for start in range(0, len(rows), micro_size):
        sl = slice(start, start + micro_size)
        mb = micro_batch(folded[sl], old[sl], adv[sl], valid=mask[sl], dp_size=dp_size,
                         batch_num_tokens=int(batch_num_tokens), global_batch_size=B)
        loss, _ = ppo_loss_with_token_selection(
            config=config, model_output={"log_probs": flat_model_output(lp[sl], mask[sl])}, data=mb, dp_group=group
        )
        loss.backward()
        total = total + loss.detach()
    return total, lp.grad, folded, metrics


STATS = ["rollout", "current"]


@pytest.mark.parametrize("stats", STATS)
@pytest.mark.parametrize("method", ["stapo", "entropy20"])
def test_micro_batch_size_does_not_change_mask_or_loss(method, stats):
    config = actor(method)
    ref = engine_step(config, list(range(B)), micro_size=B, stats=stats)
    silenced = int((make_mini_batch()[0] - ref[2]).sum())
    assert silenced > 0
    if stats == "current":  # the current statistics select other tokens than the rollout ones
        assert not torch.equal(ref[2], engine_step(config, list(range(B)), micro_size=B)[2])
    for micro_size in (1, 3, 4):
        out = engine_step(config, list(range(B)), micro_size=micro_size, stats=stats)
        torch.testing.assert_close(out[2], ref[2], rtol=0, atol=0)
        torch.testing.assert_close(out[0], ref[0])
        torch.testing.assert_close(out[1], ref[1])
        assert out[3] == ref[3]


CASES = [(method, stats) for method in ("stapo", "entropy20") for stats in STATS]


def _dp_worker(rank, world, init_file, out_dir):
    """Every (method, stats) case on this rank, in one process group (one start-up for all)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # uneven split of the mini-batch: rank 0 holds 3 rows, rank 1 holds 5 (variable candidate counts)
        rows = [0, 1, 2] if rank == 0 else [3, 4, 5, 6, 7]
        for method, stats in CASES:
            loss, grad, folded, metrics = engine_step(actor(method), rows, micro_size=2, group=dist.group.WORLD,
                                                      dp_size=world, stats=stats)
            torch.save({"rows": rows, "loss": loss, "grad": grad, "folded": folded, "metrics": metrics},
                       os.path.join(out_dir, f"{method}-{stats}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def data_parallel_results():
    """{(method, stats): [rank 0's result, rank 1's result]} from one 2-rank gloo run."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_dp_worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, start_method="spawn")
        return {case: [torch.load(os.path.join(tmp, f"{case[0]}-{case[1]}-rank{r}.pt")) for r in range(2)]
                for case in CASES}


@pytest.mark.parametrize("method,stats", CASES)
def test_data_parallel_ranks_give_the_single_process_result(method, stats, data_parallel_results):
    config = actor(method)
    ref_loss, ref_grad, ref_folded, ref_metrics = engine_step(config, list(range(B)), micro_size=B, stats=stats)
    ranks = data_parallel_results[(method, stats)]
    assert ranks[0]["metrics"] == ranks[1]["metrics"] == ref_metrics  # same tau_h and counts everywhere
    for r in ranks:
        torch.testing.assert_close(r["folded"], ref_folded[r["rows"]], rtol=0, atol=0)
        # FSDP averages gradients over the 2 ranks
        torch.testing.assert_close(r["grad"] / 2, ref_grad[r["rows"]])
    torch.testing.assert_close((ranks[0]["loss"] + ranks[1]["loss"]) / 2, ref_loss)


@pytest.mark.parametrize("method", ["stapo", "entropy20"])
def test_dynamic_batching_does_not_change_mask_loss_or_gradient(method):
    """verl's dynamic batch size (micro-batches packed by a token budget, rows reordered) against
    fixed micro-batches: the fold happens before either split, so the silenced set, the summed loss
    and its gradient are the same (stats_from=rollout)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    config = omega_conf_to_dataclass(compose([f"method={method}", "model=qwen3_1_7b",
                                              "actor_rollout_ref.actor.policy_loss.stats_from=rollout"]
                                             ).actor_rollout_ref.actor)
    mask, old, log_prob, entropy, adv = make_mini_batch(seed=3)
    results = {}
    for dynamic in (False, True):
        data = micro_batch(mask, old, adv, entropy=entropy)
        data["input_ids"] = torch.ones_like(data["attention_mask"])
        data["row"] = torch.arange(B)
        fold_into_mini_batch(config.policy_loss, data)
        tu.assign_non_tensor(data, use_dynamic_bsz=dynamic, micro_batch_size_per_gpu=2,
                             max_token_len_per_gpu=3 * (R + 3))  # 2-3 sequences per micro-batch
        batch_num_tokens = int(data["loss_mask"].sum())
        micro_batches, _ = prepare_micro_batches(data)
        lp = log_prob.clone().requires_grad_(True)
        total = torch.zeros(())
        for mb in micro_batches:
            rows = mb["row"].tolist()
            folded = mb["response_mask"]
            step = micro_batch(folded, old[rows], adv[rows], valid=mask[rows], batch_num_tokens=batch_num_tokens,
                               global_batch_size=tu.get(data, "global_batch_size"))
            loss, _ = ppo_loss_with_token_selection(
                config=config, model_output={"log_probs": flat_model_output(lp[rows], mask[rows])}, data=step)
            loss.backward()
            total = total + loss.detach()
        orders = [mb["row"].tolist() for mb in micro_batches]
        results[dynamic] = (total, lp.grad, data["response_mask"].clone(), orders)
    fixed, dyn = results[False], results[True]
    assert sorted(r for o in dyn[3] for r in o) == list(range(B)) and dyn[3] != fixed[3]  # really repacked
    torch.testing.assert_close(dyn[2], fixed[2], rtol=0, atol=0)
    assert (mask - fixed[2]).sum() > 0
    torch.testing.assert_close(dyn[0], fixed[0])
    torch.testing.assert_close(dyn[1], fixed[1])
