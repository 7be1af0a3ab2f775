"""verl 0.9.1's real trainer, end to end on CPU: every method, both trainers, checkpoint + resume.

Each run is ``python -m recipe.stapo.main_stapo method=<m>`` with the CPU overrides of
:mod:`recipe.stapo.cpu` and the tiny assets (built once per session, reused). The runs are made
once per module (one Ray start each, ~75-95 s on 2 cores) and every test reads what one of them
logged through verl's file logger. Wall times go to ``<basetemp>/stapo_cpu_e2e/walls.json`` and the
pytest output.

Runs (7): TransferQueue trainer (``trainer.use_v1=true``) x {grpo, entropy20, justrl}, 2 steps;
legacy trainer x {grpo, entropy20, stapo}, 2 steps; legacy justrl: 2 steps with a checkpoint at each
step, then a second run resuming from the step-1 checkpoint, which must train step 2 again. STAPO on
the TransferQueue trainer is tests/e2e/test_current_stats_e2e_on_cpu.py's run (which also records every
mini-batch and checks its silenced set against an independent forward).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest

from recipe.stapo.cpu import METHODS, read_metrics, run_cpu_trainer

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 420
#: rollout (HF, float32) vs trainer (FSDP2, float32) token probabilities: equal up to float noise
MAX_PROB_DIFF = 1e-3
PLAN = [(m, True) for m in METHODS if m != "stapo"] + [(m, False) for m in METHODS]


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """Run the plan once; returns {(method, use_v1): CPURun} plus ("resume", False)."""
    root = tmp_path_factory.getbasetemp() / "stapo_cpu_e2e"
    shutil.rmtree(root, ignore_errors=True)
    done, walls = {}, {}
    for method, use_v1 in PLAN:
        name = f"{method}_{'v1' if use_v1 else 'legacy'}"
        resumable = method == "justrl" and not use_v1
        done[(method, use_v1)] = run_cpu_trainer(method, assets, root / name, steps=2, use_v1=use_v1,
                                                 save_freq=1 if resumable else -1, timeout=RUN_TIMEOUT_S)
        walls[name] = done[(method, use_v1)].wall_s
        print(f"[e2e] {done[(method, use_v1)]}")
    first = done[("justrl", False)]
    checkpoint = first.run_dir / "checkpoints" / "global_step_1"
    if first.ok and checkpoint.is_dir():
        done[("resume", False)] = run_cpu_trainer("justrl", assets, first.run_dir, steps=2, use_v1=False,
                                                  save_freq=-1, resume_from=checkpoint,
                                                  metrics_file="metrics_resume.jsonl", timeout=RUN_TIMEOUT_S)
        walls["justrl_legacy_resume"] = done[("resume", False)].wall_s
        print(f"[e2e] {done[('resume', False)]}")
    (root / "walls.json").write_text(json.dumps(walls, indent=2))
    print(f"[e2e] wall seconds: {walls}")
    return done


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
        # the rollout sampled from exactly the trainer's weights (pushed to the HF server each step)
        assert data["training/rollout_probs_diff_max"] < MAX_PROB_DIFF, (step, data["training/rollout_probs_diff_max"])
        assert math.isfinite(data["actor/pg_loss"])


@pytest.mark.parametrize("method,use_v1", PLAN, ids=[f"{m}-{'v1' if v else 'legacy'}" for m, v in PLAN])
def test_two_steps_train(runs, method, use_v1):
    steps = _metrics(runs[(method, use_v1)])
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


def test_checkpoint_resumes(runs):
    first = runs[("justrl", False)]
    assert (first.run_dir / "checkpoints" / "global_step_1").is_dir()
    assert ("resume", False) in runs, "the step-1 checkpoint was not written"
    resumed = _metrics(runs[("resume", False)])
    check_training_happened(resumed, {2})
    assert "global_step_1" in runs[("resume", False)].log.read_text(errors="replace")
