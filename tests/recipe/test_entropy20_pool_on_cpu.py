"""20-Entropy's pool (docs/method.md, "The pool the authors' top 20% came from"): the numbers the
docs give against the recipe's configs, and the documented overrides for the nearest reading."""

from __future__ import annotations

import pytest

from recipe.stapo.driver import compose
from verl.utils.config import omega_conf_to_dataclass

AUTHORS_SP, AUTHORS_BUDGET = 8, 22528
AUTHORS_POOL = AUTHORS_SP * AUTHORS_BUDGET
NEAREST = ["actor_rollout_ref.actor.policy_loss.stats_from=current", "actor_rollout_ref.actor.policy_loss.scope=micro_batch",
           f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={AUTHORS_BUDGET}"]


def test_the_authors_pool_against_the_recipes_micro_batches():
    """Their pool: 180,224 tokens; the recipe's authors_code pools, per model: 5.5x (1.7B, 8B) and
    11x (14B) smaller, without sequence parallelism."""
    assert AUTHORS_POOL == 180224
    ratios = {}
    for model in ("qwen3_1_7b", "qwen3_8b", "qwen3_14b"):
        actor = compose(["method=entropy20", f"model={model}",
                         "actor_rollout_ref.actor.policy_loss.entropy_topk_reading=authors_code"]).actor_rollout_ref.actor
        assert actor.ulysses_sequence_parallel_size == 1
        ratios[model] = AUTHORS_POOL / actor.ppo_max_token_len_per_gpu
    assert ratios == {"qwen3_1_7b": 5.5, "qwen3_8b": 5.5, "qwen3_14b": 11.0}


@pytest.mark.parametrize("model", ["qwen3_1_7b", "qwen3_14b"])
def test_the_nearest_reading_pools_each_micro_batch_over_the_ranks(model):
    """The documented overrides compose into 20-Entropy per micro-batch, pooled over the data-parallel
    ranks, from the update's statistics, with the authors' per-GPU budget: on 8 ranks a pool of
    8 x 22,528 tokens, theirs."""
    actor = compose(["method=entropy20", f"model={model}", *NEAREST]).actor_rollout_ref.actor
    cfg = omega_conf_to_dataclass(actor.policy_loss)
    assert (cfg.token_selection, cfg.entropy_top_ratio, cfg.entropy_topk_reading) == ("entropy_topk", 0.2, "pooled")
    assert cfg.resolved_scope == "micro_batch" and cfg.statistics_source == "current" and cfg.pools_over_ranks
    assert 8 * actor.ppo_max_token_len_per_gpu == AUTHORS_POOL
