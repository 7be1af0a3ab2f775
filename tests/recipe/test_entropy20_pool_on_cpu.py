"""20-Entropy's pool (docs/method.md, "The pool the authors' top 20% came from"): the numbers the
docs give against the recipe's configs, the documented overrides for the authors' pool, and the pool
size in tokens the preflight prints, per node count (``ranks_per_pool``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from recipe.stapo.driver import compose
from recipe.stapo.policy_loss import settings_of
from recipe.stapo.preflight.run import selection_pool, summary
from tests.helpers.cluster_files import fake_cluster
from tests.helpers.paths import REPO
from verl.utils.config import omega_conf_to_dataclass

AUTHORS_SP, AUTHORS_BUDGET = 8, 22528
AUTHORS_POOL = AUTHORS_SP * AUTHORS_BUDGET
NEAREST = ["actor_rollout_ref.actor.policy_loss.stats_from=current", "actor_rollout_ref.actor.policy_loss.scope=micro_batch",
           f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={AUTHORS_BUDGET}"]


def test_the_authors_pool_against_the_recipes_micro_batches():
    """Their pool: 180,224 tokens; the recipe's entropy_topk_authors_code pools, per model: 5.5x (1.7B, 8B) and
    11x (14B) smaller, without sequence parallelism."""
    assert AUTHORS_POOL == 180224
    ratios = {}
    for model in ("qwen3_1_7b", "qwen3_8b", "qwen3_14b"):
        actor = compose(["method=entropy20", f"model={model}",
                         "actor_rollout_ref.actor.policy_loss.token_selection=entropy_topk_authors_code"]).actor_rollout_ref.actor
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
    assert (cfg.token_selection, cfg.entropy_top_ratio) == ("entropy_topk", 0.2)
    assert cfg.resolved_scope == "micro_batch" and cfg.statistics_source == "current" and cfg.pool_ranks(8) == 8
    assert 8 * actor.ppo_max_token_len_per_gpu == AUTHORS_POOL


# ------------------------------------------------------------------------------------------------
# ranks_per_pool: the authors' pool at any node count
# ------------------------------------------------------------------------------------------------

PL = "actor_rollout_ref.actor.policy_loss"
AUTHORS = [*NEAREST, f"{PL}.ranks_per_pool=8"]


def pool(nodes: int, *overrides: str, model: str = "qwen3_8b"):
    return selection_pool(compose(["method=entropy20", f"model={model}", f"trainer.nnodes={nodes}",
                                   "trainer.n_gpus_per_node=8", *overrides]))


@pytest.mark.parametrize("model", ["qwen3_1_7b", "qwen3_8b", "qwen3_14b"])
def test_the_shipped_reading_pools_the_whole_mini_batch_at_any_node_count(model):
    """method=entropy20 as shipped: one threshold over the PPO mini-batch (64 prompts x 8 responses of up
    to 15,360 tokens), on 1 node and on 8."""
    for nodes in (1, 8):
        p = pool(nodes, model=model)
        assert (p.tokens, p.ranks, p.data_parallel) == (64 * 8 * 15360, 8 * nodes, 8 * nodes), p
        assert "512 sequences on all" in p.text()


def test_the_nearest_reading_without_groups_pools_every_rank_8x_more_on_8_nodes():
    assert pool(1, *NEAREST).tokens == AUTHORS_POOL
    assert pool(8, *NEAREST).tokens == 8 * AUTHORS_POOL == 1_441_792


@pytest.mark.parametrize("nodes", [1, 2, 8])
def test_the_authors_pool_with_ranks_per_pool_8_at_every_node_count(nodes):
    p = pool(nodes, *AUTHORS)
    assert (p.tokens, p.ranks, p.data_parallel) == (AUTHORS_POOL, 8, 8 * nodes)
    assert p.text().startswith("up to 180,224 tokens per threshold: one micro-batch of ")


def test_the_authors_code_rule_pools_one_ranks_micro_batch():
    for nodes in (1, 8):
        p = pool(nodes, "actor_rollout_ref.actor.policy_loss.token_selection=entropy_topk_authors_code", model="qwen3_14b")
        assert (p.tokens, p.ranks) == (16384, 1) and "one data-parallel rank" in p.text()


def test_the_summary_prints_the_pool_in_tokens():
    config = compose(["method=entropy20", "model=qwen3_8b", "trainer.nnodes=8", *AUTHORS])
    text = summary(config)
    assert "actor_rollout_ref.actor.policy_loss.ranks_per_pool = 8" in text
    assert "token selection pool = up to 180,224 tokens per threshold: one micro-batch of each group of 8 of the " \
           "64 data-parallel ranks, up to 22,528 tokens per rank" in text


def test_ranks_per_pool_must_divide_the_data_parallel_size():
    cfg = omega_conf_to_dataclass(compose(["method=entropy20", *AUTHORS]).actor_rollout_ref.actor.policy_loss)
    for dp in (8, 16, 64):
        assert cfg.pool_ranks(dp) == 8
    for dp in (4, 12, 20):
        with pytest.raises(ValueError, match=r"policy_loss\.ranks_per_pool=8 is invalid: expected a divisor of the "
                                             rf"run's {dp} data-parallel ranks"):
            cfg.pool_ranks(dp)


@pytest.mark.parametrize("overrides, phrase", [
    (["method=entropy20", "actor_rollout_ref.actor.policy_loss.ranks_per_pool=0"], "a whole number >= 1"),
    (["method=entropy20", "actor_rollout_ref.actor.policy_loss.ranks_per_pool=2.5"], "a whole number >= 1"),
    (["method=entropy20", "actor_rollout_ref.actor.policy_loss.ranks_per_pool=true"], "a whole number >= 1"),
    (["method=stapo", "actor_rollout_ref.actor.policy_loss.ranks_per_pool=8"], "S2T's tau_h is pooled over the whole"),
    (["method=justrl", "actor_rollout_ref.actor.policy_loss.ranks_per_pool=8"], "token_selection=none"),
    (["method=entropy20", "actor_rollout_ref.actor.policy_loss.token_selection=entropy_topk_authors_code",
      "actor_rollout_ref.actor.policy_loss.ranks_per_pool=8"], "token_selection=entropy_topk_authors_code"),
])
def test_the_config_refuses_a_pool_it_cannot_make(overrides, phrase):
    with pytest.raises(ValueError) as info:
        settings_of(compose(overrides))
    assert "actor_rollout_ref.actor.policy_loss.ranks_per_pool=" in str(info.value) and phrase in str(info.value)


def _runbook_command() -> str:
    """The runbook's 20-Entropy command (docs/cluster.md), its continuation lines joined."""
    text = (REPO / "docs" / "cluster.md").read_text().replace("\\\n", " ")
    lines = [line for line in text.splitlines() if "run_scripts/qwen3_8b_entropy20.sh" in line and "ranks_per_pool" in line]
    assert len(lines) == 1, lines
    return " ".join(lines[0].split())


def test_the_runbooks_command_passes_the_preflight_with_the_authors_pool(tmp_path):
    """The command as the runbook writes it, under ``STAPO_DRY_RUN=check`` (the composed config validated
    here, nothing submitted) on a stand-in for the cluster's storage: 64 GPUs, 8 groups of 8 ranks,
    180,224 tokens per threshold; with 12 ranks per pool it is refused naming the key."""
    command = _runbook_command()
    assert command.startswith("LAUNCH=submit EXPERIMENT=qwen3_8b_entropy20_authors_pool bash run_scripts/")
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_MEM_GB", "LAUNCH", "NNODES", "GPUS_PER_NODE")}
    env.update(fake_cluster(tmp_path), STAPO_DRY_RUN="check", PYTHON=sys.executable, LOGGER="console")
    proc = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for text in ("preflight passed", "GPUs = 64", f"{PL}.ranks_per_pool = 8",
                 "token selection pool = up to 180,224 tokens per threshold: one micro-batch of each group of 8 of "
                 "the 64 data-parallel ranks, up to 22,528 tokens per rank"):
        assert text in proc.stderr, proc.stderr[-3000:]
    bad = command.replace("ranks_per_pool=8", "ranks_per_pool=12")
    proc = subprocess.run(["bash", "-c", bad], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and f"{PL}.ranks_per_pool=12: expected a divisor of the run's 64" in proc.stderr, \
        proc.stderr[-3000:]
