"""The CPU wing's activation (stapo_cpu.activate, the CPU environment's first external module) reads
``STAPO_CPU_THREADS``: a bad value is refused before Ray, before Hydra loads verl's config (where
``import verl`` would fail naming nothing), by the driver's check of the modules ``import verl``
imports; a GPU run never reads it."""

from __future__ import annotations

import subprocess

import pytest

from recipe.stapo.preflight import check_environment
from stapo_cpu.trainer import cpu_env, cpu_overrides, trainer_command
from tests.helpers.paths import REPO


def test_a_gpu_run_never_reads_the_cpu_threads():
    assert check_environment({"STAPO_CPU_THREADS": "abc"}) == []
    assert check_environment({"STAPO_CPU_THREADS": "abc", "VERL_USE_EXTERNAL_MODULES": "verl_patches.activate"}) == []


@pytest.mark.parametrize("threads, refused", [("abc", True), ("2", False)])
def test_the_cpu_runs_threads_are_checked_before_hydra_loads_verls_config(assets, tmp_path, threads, refused):
    env = {**cpu_env(tmp_path / "run"), "STAPO_CPU_THREADS": threads}
    command = [*trainer_command("stapo", cpu_overrides(assets, tmp_path / "run")), "--check"]
    proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    if refused:
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "preflight refused the config (1 problem" in proc.stderr, proc.stderr[-3000:]
        assert f"STAPO_CPU_THREADS={threads!r}: expected a positive integer" in proc.stderr, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "Could not load" not in proc.stderr
    else:
        assert proc.returncode == 0 and "config OK" in proc.stdout, proc.stderr[-3000:]
