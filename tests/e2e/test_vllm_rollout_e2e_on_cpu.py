"""What is particular to verl's vLLM server rollout on CPU (``cpu_rollout/vllm.yaml``: vLLM's CPU build, an
``AsyncLLM`` server per replica, verl's worker extension, the weight sync from the trainer every step
through shared memory; docs/cpu.md). Every method training on it, with the rollout's log-probs checked
against the trainer's, is tests/e2e/test_trainer_e2e_on_cpu.py; same seed, same numbers is
test_reproducible_e2e_on_cpu.py; vLLM servers on two nodes is test_two_node_on_cpu.py. Runs of this
module (made once, on one xdist worker):

- STAPO, verl's TransferQueue trainer, 2 steps with a checkpoint at step 2, then resumed to step 3;
  while it runs, which of vLLM's kernel libraries its processes loaded (the AVX2 ones, under the
  recipe's instruction-set pin);
- a run whose vLLM engine has one layer fewer than the trainer's model, so that the first weight sync
  fails on the vLLM side: the run must end with the weight sync's error within a bounded time.

After every run nothing of vLLM's is left: no /dev/shm segment that no process maps, and the run's
folder for vLLM's socket files is gone. Cost: ~4 minutes on 2 cores (3 runs).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from recipe.stapo.cpu import read_metrics, run_cpu_trainer
from tests.e2e.test_trainer_e2e_on_cpu import MAX_PROB_DIFF, check_training_happened
from verl_patches.cpu.vllm_cpu import run_vllm_kernels

pytestmark = pytest.mark.slow

#: a failed weight sync must end the run within this many seconds after the sync's timeout
FAILED_SYNC_TIMEOUT_S = 20
RUN_TIMEOUT_S = 600
SCRATCH_LINE = re.compile(r"\[stapo\] vLLM's socket files: (\S+)")


def unmapped_shm_segments() -> set[str]:
    """Shared-memory segments (``psm_*``) in /dev/shm that no live process has mapped (what a finished
    run must not leave). Named semaphores (``sem.mp-*``, 32 bytes) are not checked: glibc maps one under
    a temporary name, so a live one and a leftover look the same."""
    names = {n for n in os.listdir("/dev/shm") if n.startswith("psm_")}
    mapped = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                mapped.update(line.rsplit("/dev/shm/", 1)[1].split()[0] for line in maps if "/dev/shm/" in line)
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return names - mapped


def vllm_run(assets, run_dir: Path, method: str, **kwargs):
    before = unmapped_shm_segments()
    kernels: set[str] = set()

    def note_kernels(step: int, metrics: dict) -> None:  # while the run's processes live
        kernels.update(run_vllm_kernels(str(Path(run_dir).resolve())))

    run = run_cpu_trainer(method, assets, run_dir, timeout=RUN_TIMEOUT_S, on_step=note_kernels, **kwargs)
    run.vllm_kernels = kernels
    log = run.log.read_text(errors="replace") if run.log.is_file() else ""
    run.left_shm = unmapped_shm_segments() - before
    run.scratch = [Path(p) for p in SCRATCH_LINE.findall(log)]
    return run


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm_runs")
    out = {"stapo": vllm_run(assets, base / "stapo", "stapo", steps=2, save_freq=2)}
    out["stapo"].steps = read_metrics(out["stapo"].metrics) if out["stapo"].ok else {}  # before the relaunch adds to it
    out["stapo_resumed"] = vllm_run(assets, base / "stapo", "stapo", steps=3, save_freq=2, resume=True)
    os.environ["STAPO_WEIGHT_SYNC_TIMEOUT_S"] = str(FAILED_SYNC_TIMEOUT_S)
    try:
        out["failed_sync"] = vllm_run(
            assets, base / "failed_sync", "grpo", steps=1,
            extra=["+actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides={num_hidden_layers:1}"])
    finally:
        del os.environ["STAPO_WEIGHT_SYNC_TIMEOUT_S"]
    return out


def _metrics(run) -> dict[int, dict]:
    assert run.ok, f"{run} failed; log tail:\n{run.tail()}"
    return read_metrics(run.metrics)


def test_stapo_silences_tokens_of_vllm_samples_and_resumes(runs):
    """STAPO's S2T on the tokens vLLM sampled (step 1's rollout on the weights synced at start, steps 2
    and 3 after updates); the relaunch continues from the step-2 checkpoint."""
    assert runs["stapo"].ok, runs["stapo"].tail()
    first = runs["stapo"].steps
    check_training_happened(first, {1, 2})
    steps = _metrics(runs["stapo_resumed"])
    # one record per step, steps 1-2 the first launch's; the relaunch trained step 3 only
    assert set(steps) == {1, 2, 3} and all(steps[s] == first[s] for s in (1, 2))
    relaunch_log = runs["stapo_resumed"].log.read_text(errors="replace")
    assert "global_step_2" in relaunch_log  # verl's resume message names the checkpoint
    assert set(re.findall(r"step:(\d+) - ", relaunch_log)) == {"3"}
    gaps = {s: d["training/rollout_probs_diff_max"] for s, d in steps.items()}
    assert max(gaps.values()) < MAX_PROB_DIFF, gaps
    # the update moved the policy (ppo_kl > 0 at a later mini-batch) and the next rollout still matches
    assert steps[3]["actor/ppo_kl"] != 0.0 or steps[2]["actor/ppo_kl"] != 0.0
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


@pytest.mark.parametrize("name", ["stapo", "stapo_resumed", "failed_sync"])
def test_nothing_of_vllm_is_left_behind(runs, name):
    run = runs[name]
    assert run.scratch, f"{run}: the driver did not name vLLM's socket folder"
    assert all(str(p).startswith("/") and not p.exists() for p in run.scratch), run.scratch
    assert not run.left_shm, f"{run} left /dev/shm segments nobody maps: {sorted(run.left_shm)}"
