"""S2T's current-policy forward (``stats_from=current``): only the positive-advantage sequences,
balanced over data-parallel ranks, with the silenced set, ``tau_h`` and every count of a full forward.

The worker is verl's as the recipe's ``TrainingWorker.train_batch`` wrapper uses it, with
``infer_batch`` (the current policy's forward) answering from fixed per-sequence statistics, keyed by
a row id that travels with each sequence, so a sequence forwarded on another rank gets its own
statistics. The reference is S2T (``stapo_core.s2t_mask``) on every sequence of the mini-batch.
The forward itself, on verl's real trainer, is tests/e2e/test_current_stats_e2e_on_cpu.py.
"""

from __future__ import annotations

import importlib
import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch

import verl_patches.activate  # noqa: F401  (installs the patches)
from recipe.stapo.driver import compose
from stapo_core import s2t_mask
from tests.helpers.dist_utils import run_on_ranks
from tests.helpers.verl_batch import PROMPT_LEN, flat_model_output, micro_batch, right_padded_mask
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers import engine_workers

B, R = 8, 10
PL = "actor_rollout_ref.actor.policy_loss"
#: rank 0 holds rows 0-3, rank 1 rows 4-7, none of them with a positive advantage
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, 2.0, -1.0, 0.0, -0.5, -2.0])
CURRENT_KEYS = ("s2t/current_forward_tokens_frac", "s2t/current_forward_slowest_rank_frac", "s2t/current_forward_s")


def mini_batch(rows, seed=0):
    """The mini-batch rows ``rows`` (padded, with a ``row_id`` field), and the current policy's
    (log_prob, entropy) of every row: rare tokens in the positive-advantage rows, varied lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, R + 1, (B,), generator=g)
    mask = right_padded_mask(lengths, R)
    adv = ADVANTAGES[:, None].expand(B, R).clone()
    old = -torch.rand(B, R, generator=g) * 2
    log_prob = old - 0.3 * torch.rand(B, R, generator=g)
    rare = torch.rand(B, R, generator=g) < 0.5
    log_prob[rare] = -7.0 - torch.rand(int(rare.sum()), generator=g)
    entropy = torch.rand(B, R, generator=g) * 4
    data = micro_batch(mask[rows], old[rows], adv[rows], entropy=entropy.flip(1)[rows])
    data["row_id"] = torch.tensor(rows)
    return data, (log_prob, entropy), mask, adv


class FakeWorker:
    """What the recipe uses of verl's ``TrainingWorker``: the bound loss (carrying the actor config),
    the engine (data-parallel group, parameters) and ``infer_batch``, which records the rows of each
    call and answers from ``statistics`` (indexed by ``row_id``)."""

    def __init__(self, config, statistics, group=None, micro=4):
        self.loss_fn = partial(engine_workers.ppo_loss, config=config)
        self.engine = SimpleNamespace(get_data_parallel_group=lambda: group, module=torch.nn.Linear(1, 1))
        self.engine_config = SimpleNamespace(infer_micro_batch_size_per_gpu=micro, use_dynamic_bsz=False,
                                             infer_max_token_len_per_gpu=None)
        self.statistics, self.calls = statistics, []

    def infer_batch(self, data):
        assert tu.get(data, "calculate_entropy") and not tu.get(data, "compute_loss")
        rows = data["row_id"].tolist()
        self.calls.append(rows)
        log_prob, entropy = (t[rows] for t in self.statistics)
        valid = data["attention_mask"][:, PROMPT_LEN:]
        return {"log_probs": flat_model_output(log_prob, valid), "entropy": flat_model_output(entropy, valid)}


def actor(*overrides):
    cfg = compose(["method=stapo", "model=qwen3_1_7b", f"{PL}.stats_from=current", *overrides])
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def second_mini_batch(worker, data):
    """The recipe's work on ``data`` as the second mini-batch of a step (the first forwards nothing);
    returns its metrics and the folded response mask."""
    before_update = importlib.import_module("verl_patches.mini_batch").before_update
    first = data.clone()
    tu.assign_non_tensor(first, update_lr_scheduler=False)
    assert before_update(worker, first)[0] and worker.calls == []
    tu.assign_non_tensor(data, update_lr_scheduler=True)
    metrics, _ = before_update(worker, data)
    return metrics, data["response_mask"].clone()


def tokens(mask, rows):
    return sum(PROMPT_LEN + int(mask[r].sum()) for r in rows)


def test_only_positive_advantage_sequences_are_forwarded_and_the_fold_is_a_full_forwards():
    data, current, mask, adv = mini_batch(list(range(B)))
    positive = [r for r in range(B) if ADVANTAGES[r] > 0]
    worker = FakeWorker(actor(), current)
    metrics, folded = second_mini_batch(worker, data)
    assert sorted(r for call in worker.calls for r in call) == positive  # each once, nothing else
    assert all(len(call) <= 4 for call in worker.calls)  # the inference pass's micro-batch size
    keep = s2t_mask(*current, adv, mask).keep
    assert (mask * (1 - keep)).sum() > 0
    torch.testing.assert_close(folded.float(), mask * keep, rtol=0, atol=0)

    full_data, _, _, _ = mini_batch(list(range(B)))
    full_worker = FakeWorker(actor(f"{PL}.current_forward=full"), current)
    full_metrics, full_folded = second_mini_batch(full_worker, full_data)
    assert full_worker.calls and sorted(r for call in full_worker.calls for r in call) == list(range(B))
    torch.testing.assert_close(folded, full_folded, rtol=0, atol=0)
    assert {k: v for k, v in metrics.items() if k not in CURRENT_KEYS} == \
        {k: v for k, v in full_metrics.items() if k not in CURRENT_KEYS}
    assert full_metrics["s2t/current_forward_tokens_frac"] == 1.0
    assert metrics["s2t/current_forward_tokens_frac"] == pytest.approx(tokens(mask, positive) / tokens(mask, range(B)))
    assert metrics["s2t/current_forward_tokens_frac"] < 1.0


def test_a_mini_batch_without_positive_advantage_forwards_nothing():
    data, current, mask, adv = mini_batch(list(range(B)))
    data["advantages"] = -data["advantages"].abs()
    worker = FakeWorker(actor(), current)
    metrics, folded = second_mini_batch(worker, data)
    assert worker.calls == []
    torch.testing.assert_close(folded, data["loss_mask"], rtol=0, atol=0)
    assert metrics["s2t/silenced"] == 0 and metrics["s2t/tokens"] == mask.sum().item()
    assert metrics["s2t/current_forward_tokens_frac"] == 0.0


def test_entropy_topk_forwards_every_sequence():
    """20-Entropy ranks every token's entropy: current_forward does not apply."""
    config = omega_conf_to_dataclass(compose(["method=entropy20", "model=qwen3_1_7b", f"{PL}.stats_from=current"]
                                             ).actor_rollout_ref.actor)
    assert config.policy_loss.forwards_current_policy and not config.policy_loss.rule.positive_advantage_only
    data, current, _, _ = mini_batch(list(range(B)))
    worker = FakeWorker(config, current)
    metrics, _ = second_mini_batch(worker, data)
    assert sorted(r for call in worker.calls for r in call) == list(range(B))
    assert metrics["entropy_topk/current_forward_tokens_frac"] == 1.0


def _two_ranks(rank, group, payload):
    """Rank ``rank``'s half of the mini-batch through the recipe, the forward on 2 gloo ranks."""
    micro, = payload
    rows = list(range(4)) if rank == 0 else list(range(4, B))
    data, current, _, _ = mini_batch(rows)
    worker = FakeWorker(actor(), current, group=group, micro=micro)
    metrics, folded = second_mini_batch(worker, data)
    return {"rows": rows, "calls": worker.calls, "metrics": metrics, "folded": folded}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_on_ranks(_two_ranks, (1,), 2, tmp_path_factory.mktemp("current_stats"))


def test_two_ranks_and_a_rank_without_positive_advantage_give_the_full_forwards_fold(two_ranks):
    """Rank 1 holds no positive-advantage sequence: it forwards some of rank 0's (one sequence per
    micro-batch here), both ranks run the same number of forwards, and each rank's folded mask and
    every metric equal S2T on the whole mini-batch from a single process."""
    _, current, mask, adv = mini_batch(list(range(B)))
    keep = s2t_mask(*current, adv, mask).keep
    positive = [r for r in range(B) if ADVANTAGES[r] > 0]
    assert len(two_ranks[0]["calls"]) == len(two_ranks[1]["calls"])  # the ranks stay in step
    forwarded = [r for result in two_ranks for call in result["calls"] for r in call]
    assert set(forwarded) == set(positive)  # only positive rows (padding repeats one of them)
    assert any(r in positive for call in two_ranks[1]["calls"] for r in call)  # rank 1 helped
    extra = list(forwarded)
    for r in positive:
        extra.remove(r)
    assert len(set(extra)) <= 1  # padding micro-batches repeat one sequence (the shortest)
    for result in two_ranks:
        torch.testing.assert_close(result["folded"].float(), (mask * keep)[result["rows"]], rtol=0, atol=0)
    reference = FakeWorker(actor(f"{PL}.current_forward=full"), current)
    full_data, _, _, _ = mini_batch(list(range(B)))
    want, _ = second_mini_batch(reference, full_data)
    for result in two_ranks:
        got = {k: v for k, v in result["metrics"].items() if k not in CURRENT_KEYS}
        assert got == {k: v for k, v in want.items() if k not in CURRENT_KEYS}
        assert got["s2t/silenced"] > 0 and math.isfinite(got["s2t/tau_h"])
    # the forward's share: tokens forwarded (padding included) over the mini-batch's, and the busiest rank's
    loads = [tokens(mask, [r for call in result["calls"] for r in call]) for result in two_ranks]
    held = [tokens(mask, result["rows"]) for result in two_ranks]
    for result in two_ranks:
        assert result["metrics"]["s2t/current_forward_tokens_frac"] == pytest.approx(sum(loads) / sum(held))
        assert result["metrics"]["s2t/current_forward_slowest_rank_frac"] == pytest.approx(max(loads) / max(held))
    assert max(loads) < tokens(mask, positive)  # rank 0 alone would forward all the positive sequences
