"""What is particular to verl's vLLM server rollout on CPU (``stapo_cpu.trainer.cpu_overrides``: vLLM's CPU build, an
``AsyncLLM`` server per replica, verl's worker extension, the weight sync from the trainer every step
through shared memory; docs/cpu.md). Every method training on it, with the rollout's log-probs checked
against the trainer's, is tests/e2e/test_trainer_e2e_on_cpu.py; same seed, same numbers is
test_reproducible_e2e_on_cpu.py; vLLM servers on two nodes is test_two_node_on_cpu.py. The runs read
here, each watched for what vLLM loads and leaves (tests/helpers/vllm_watch.py):

- the suite's shared STAPO run (``stapo_v1``, verl's TransferQueue trainer, 2 steps,
  tests/helpers/shared_runs.py); while it runs, which of vLLM's kernel libraries its processes loaded
  (the AVX2 ones, under the recipe's instruction-set pin);
- a run whose vLLM engine has one layer fewer than the trainer's model, so that the first weight sync
  fails on the vLLM side: the run must end with the weight sync's error within a bounded time.

After every run nothing of vLLM's is left: no /dev/shm segment that no process maps, and the run's
folder for vLLM's socket files is gone. A relaunch resuming, its first rollout on the checkpoint's
weights, is test_two_node_on_cpu.py's.
Cost: ~1 minute on 2 cores beyond the shared run (1 run).
"""

from __future__ import annotations

import pytest

from recipe.stapo.metrics import read_metrics
from tests.e2e.test_trainer_e2e_on_cpu import check_training_happened
from tests.helpers.vllm_watch import watched_run

pytestmark = pytest.mark.slow

#: a failed weight sync must end the run within this many seconds after the sync's timeout
FAILED_SYNC_TIMEOUT_S = 5
RUN_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def runs(assets, shared_runs, tmp_path_factory):
    out = {"stapo": shared_runs.get("stapo_v1")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STAPO_WEIGHT_SYNC_TIMEOUT_S", str(FAILED_SYNC_TIMEOUT_S))
        out["failed_sync"] = watched_run(
            "grpo", assets, tmp_path_factory.mktemp("vllm_runs") / "failed_sync", steps=1, timeout=RUN_TIMEOUT_S,
            extra=["+actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides={num_hidden_layers:1}"])
    return out


def _metrics(run) -> dict[int, dict]:
    assert run.ok, f"{run} failed; log tail:\n{run.tail()}"
    return read_metrics(run.metrics)


def test_stapo_silences_tokens_of_vllm_samples(runs):
    """STAPO's S2T on the tokens vLLM sampled (step 1's rollout on the weights synced at start, step 2
    after the updates)."""
    steps = _metrics(runs["stapo"])
    check_training_happened(steps, {1, 2})  # each step's rollout on the trainer's weights, within MAX_PROB_DIFF
    # the updates moved the policy (ppo_kl > 0 at a later mini-batch) and the next rollout still matches
    assert any(d["actor/ppo_kl"] != 0.0 for d in steps.values())
    for data in steps.values():
        assert data["actor/s2t/applied"] == 1.0
        assert 0 <= data["actor/s2t/silenced"] <= data["actor/s2t/candidates"] <= data["actor/s2t/tokens"]
    # positive-advantage tokens exist in some step (the tiny task's rewards are mixed: the chance that
    # every group of every step is all-right or all-wrong is ~1e-11), so S2T's rule ran on them
    assert max(d["actor/s2t/tokens"] for d in steps.values()) > 0


def test_vllm_runs_its_avx2_kernels_under_the_pin(runs):
    """Every process of the run that loaded vLLM's kernels (the vLLM server, its engine, the workers that
    import vLLM) loaded the AVX2 library, as on an AVX2-only CPU (patch ``cpu_vllm_isa_pin``)."""
    assert runs["stapo"].ok, runs["stapo"].tail()
    assert runs["stapo"].vllm_kernels == {"_C_AVX2.abi3.so"}, runs["stapo"].vllm_kernels


def test_a_failed_weight_sync_ends_the_run_with_its_reason(runs):
    run = runs["failed_sync"]
    log = run.log.read_text(errors="replace")
    assert run.returncode not in (0, -9), f"{run}: expected a failing exit, got a success or a timeout"
    assert "WeightSyncTimeout" in log and f"within {FAILED_SYNC_TIMEOUT_S:g} s" in log, run.tail()
    assert run.wall_s < RUN_TIMEOUT_S


@pytest.mark.parametrize("name", ["stapo", "failed_sync"])
def test_nothing_of_vllm_is_left_behind(runs, name):
    run = runs[name]
    assert run.scratch, f"{run}: the driver did not name vLLM's socket folder"
    assert all(str(p).startswith("/") and not p.exists() for p in run.scratch), run.scratch
    assert not run.left_shm, f"{run} left /dev/shm segments nobody maps: {sorted(run.left_shm)}"
