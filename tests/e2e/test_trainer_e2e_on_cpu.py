"""verl 0.9.1's real trainer, end to end on CPU: every method trains and logs what it should.

Each run is ``python -m recipe.stapo.main_stapo method=<m>`` with the CPU overrides of
:mod:`stapo_cpu` and the tiny assets, 2 steps; the runs are the suite's shared runs
(tests/helpers/shared_runs.py, each made once per session): GRPO, 20-Entropy and STAPO on verl's
default TransferQueue trainer (``trainer.use_v1=true``), JustRL and STAPO (on verl's GSPO loss) on
the legacy trainer. Resuming from the checkpoints (a relaunch of the same command, the same wandb
run continued) is tests/e2e/test_two_node_on_cpu.py's.
"""

from __future__ import annotations

import math

import pytest

from recipe.stapo.metrics import read_metrics

pytestmark = pytest.mark.slow

#: vLLM's float32 CPU kernels vs the trainer's (FSDP2, float32): the largest token-probability gap
#: between the rollout's log-probs and the trainer's recomputation of them, after updates (measured
#: 5e-6 to 8e-6; a rollout on stale weights is off by the update's change, ~1e-3 here)
MAX_PROB_DIFF = 5e-5
#: (method, shared run)
PLAN = [("grpo", "grpo_v1"), ("entropy20", "entropy20_v1"), ("stapo", "stapo_v1"), ("justrl", "justrl_legacy"),
        ("stapo", "stapo_gspo_legacy")]


def _metrics(run) -> dict[int, dict]:
    assert run.ok, f"{run} failed; log tail:\n{run.tail()}"
    return read_metrics(run.metrics)


def check_training_happened(steps: dict[int, dict], expected_steps: set[int]) -> None:
    assert set(steps) == expected_steps
    grad_norms = [data["actor/grad_norm"] for data in steps.values()]
    # a step whose every group is all-right or all-wrong has zero advantages, hence zero gradient
    assert all(math.isfinite(g) for g in grad_norms) and max(grad_norms) > 0, grad_norms
    for step, data in steps.items():
        assert data["training/global_step"] == step
        assert -1.0 <= data["critic/score/mean"] <= 1.0
        # the rollout sampled from exactly the trainer's weights (synced to vLLM each step)
        assert data["training/rollout_probs_diff_max"] < MAX_PROB_DIFF, (step, data["training/rollout_probs_diff_max"])
        assert math.isfinite(data["actor/pg_loss"])


@pytest.mark.parametrize("method,name", PLAN, ids=[name for _, name in PLAN])
def test_two_steps_train(shared_runs, method, name):
    steps = _metrics(shared_runs.get(name))
    check_training_happened(steps, {1, 2})
    data = steps[2]
    # the step's entropy quantiles are logged for every method (verl_patches.step_metrics)
    assert 0 <= data["actor/entropy_p50"] <= data["actor/entropy_p80"] <= data["actor/entropy_p95"]
    # every method logs S2T's statistics: applied by STAPO, monitored by the others (s2t_monitor)
    s2t = {k: v for k, v in data.items() if k.startswith("actor/s2t/")}
    assert s2t, f"no actor/s2t/ metrics in {sorted(data)}"
    assert all(math.isfinite(v) for v in s2t.values())
    assert 0 <= s2t["actor/s2t/silenced"] <= s2t["actor/s2t/candidates"] <= s2t["actor/s2t/tokens"]
    assert "actor/s2t/grad_norm_kept" in s2t  # rollout-time sum_pi_squared reached the actor
    assert s2t["actor/s2t/applied"] == (1.0 if method == "stapo" else 0.0)
    # and the update effect of the tokens S2T singles out, once per step (verl_patches.update_effect)
    for step in (1, 2):
        effect = {k: v for k, v in steps[step].items() if k.startswith("actor/s2t/dlogp_")}
        assert effect["actor/s2t/dlogp_seconds"] >= 0 and effect["actor/s2t/dlogp_all_tokens"] >= 0
        assert (effect["actor/s2t/dlogp_responses"] > 0) == (effect["actor/s2t/dlogp_all_tokens"] > 0)
        assert ("actor/s2t/dlogp_all" in effect) == (effect["actor/s2t/dlogp_all_tokens"] > 0)
    if method == "stapo":
        # stats_from=current (the recipe's default): mini-batch 2 of each step ran one forward of the
        # updated policy through verl's inference path and compared its silenced set with the rollout one
        assert 0.0 <= s2t["actor/s2t/rollout_agreement"] <= 1.0
    if method == "entropy20":
        tokens, kept = data["actor/entropy_topk/tokens"], data["actor/entropy_topk/kept"]
        assert 0.2 * tokens <= kept <= 0.2 * tokens + 1  # ceil(0.2 N) per mini-batch, averaged
    if method == "grpo":
        assert "actor/kl_loss" in data and math.isfinite(data["actor/kl_loss"])  # KL to the reference policy
    else:
        assert "actor/kl_loss" not in data


