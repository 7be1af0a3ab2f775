"""verl's own vLLM server rollout (``rollout.name=vllm``, the paper run's), end to end on CPU.

The same trainer as tests/e2e/test_trainer_e2e_on_cpu.py with ``cpu_rollout=vllm`` (vLLM's CPU build:
an ``AsyncLLM`` server per replica, verl's worker extension, the weight sync from the trainer every
step through shared memory, vLLM's sampler and log-probs; docs/cpu.md). Runs of this module (made
once, on one xdist worker):

- STAPO, verl's TransferQueue trainer, 2 steps with a checkpoint at step 2, then resumed to step 3;
- the same 2 steps again in another folder: same seed, same numbers (``cpu_rollout/vllm.yaml`` turns on
  full determinism: a seed per sample and a fixed batch order);
- GRPO and 20-Entropy on the TransferQueue trainer, JustRL on the legacy trainer, 2 steps each;
- a run whose vLLM engine has one layer fewer than the trainer's model, so that the first weight sync
  fails on the vLLM side: the run must end with the weight sync's error within a bounded time.

After every run nothing of vLLM's is left: no /dev/shm segment that no process maps, and the run's
folder for vLLM's socket files is gone. Cost: ~10 minutes on 2 cores (7 runs).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest

from recipe.stapo.cpu import read_metrics, run_cpu_trainer
from recipe.stapo.cpu.reproducibility import seeded_metrics
from tests.e2e.test_trainer_e2e_on_cpu import check_training_happened

pytestmark = pytest.mark.slow

#: vLLM's float32 CPU kernels vs the trainer's (FSDP2, float32): the largest token-probability gap
#: between the rollout's log-probs and the trainer's recomputation of them, after updates (measured
#: 5e-6 to 8e-6; a rollout on stale weights is off by the update's change, ~1e-3 here)
MAX_PROB_DIFF = 5e-5
#: a failed weight sync must end the run within this many seconds after the sync's timeout
FAILED_SYNC_TIMEOUT_S = 20
RUN_TIMEOUT_S = 600
#: (method, trainer) runs of 2 steps beside STAPO's
METHODS = [("grpo", True), ("entropy20", True), ("justrl", False)]
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
    run = run_cpu_trainer(method, assets, run_dir, rollout="vllm", timeout=RUN_TIMEOUT_S, **kwargs)
    log = run.log.read_text(errors="replace") if run.log.is_file() else ""
    run.left_shm = unmapped_shm_segments() - before
    run.scratch = [Path(p) for p in SCRATCH_LINE.findall(log)]
    return run


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm_runs")
    out = {"stapo": vllm_run(assets, base / "stapo", "stapo", steps=2, save_freq=2)}
    out["stapo"].steps = read_metrics(out["stapo"].metrics) if out["stapo"].ok else {}  # before the relaunch adds to it
    out["stapo_again"] = vllm_run(assets, base / "stapo_again", "stapo", steps=2, save_freq=2)
    out["stapo_resumed"] = vllm_run(assets, base / "stapo", "stapo", steps=3, save_freq=2, resume=True)
    for method, use_v1 in METHODS:
        out[method] = vllm_run(assets, base / method, method, steps=2, use_v1=use_v1)
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


@pytest.mark.parametrize("method", [m for m, _ in METHODS])
def test_every_method_trains_on_vllm_rollouts(runs, method):
    steps = _metrics(runs[method])
    check_training_happened(steps, {1, 2})
    for data in steps.values():
        assert data["training/rollout_probs_diff_max"] < MAX_PROB_DIFF
        s2t = {k: v for k, v in data.items() if k.startswith("actor/s2t/")}
        assert s2t and all(math.isfinite(v) for v in s2t.values())
        assert s2t["actor/s2t/applied"] == 0.0  # S2T monitored, not applied


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


def test_same_seed_same_numbers_with_vllm(runs):
    """Two runs with the same seed log the same value for every metric but the wall-clock ones (vLLM's
    CPU forward is batch-invariant and every sample has its own seed: docs/cpu.md)."""
    assert runs["stapo"].ok and runs["stapo_again"].ok, runs["stapo_again"].tail()
    first, again = seeded_metrics(runs["stapo"].steps), seeded_metrics(_metrics(runs["stapo_again"]))
    assert len(first) > 100 and {step for step, _ in first} == {1, 2}
    differ = {key: (first[key], again.get(key)) for key in first if again.get(key) != first[key]}
    assert not differ, differ


def test_a_failed_weight_sync_ends_the_run_with_its_reason(runs):
    run = runs["failed_sync"]
    log = run.log.read_text(errors="replace")
    assert run.returncode not in (0, -9), f"{run}: expected a failing exit, got a success or a timeout"
    assert "WeightSyncTimeout" in log and f"within {FAILED_SYNC_TIMEOUT_S:g} s" in log, run.tail()
    assert run.wall_s < RUN_TIMEOUT_S


@pytest.mark.parametrize("name", ["stapo", "stapo_resumed", "stapo_again", *[m for m, _ in METHODS], "failed_sync"])
def test_nothing_of_vllm_is_left_behind(runs, name):
    run = runs[name]
    assert run.scratch, f"{run}: the driver did not name vLLM's socket folder"
    assert all(str(p).startswith("/") and not p.exists() for p in run.scratch), run.scratch
    assert not run.left_shm, f"{run} left /dev/shm segments nobody maps: {sorted(run.left_shm)}"
