"""A CPU trainer run watched for what vLLM loads and leaves: which of vLLM's kernel libraries the
run's processes loaded (read while they live, at each step), the ``/dev/shm`` segments nobody maps
that appeared during the run, and the socket folders the driver named. Read by
tests/e2e/test_vllm_rollout_e2e_on_cpu.py, for its own run and the shared STAPO run
(tests/helpers/shared_runs.py makes every shared run through :func:`watched_run`)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from stapo_cpu.trainer import CPURun, run_cpu_trainer
from stapo_cpu.patches.vllm_cpu import run_vllm_kernels

#: the line in which the driver names the run's folder for vLLM's socket files
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


def watched_run(method: str, assets, run_dir: Path, **kwargs) -> CPURun:
    """:func:`stapo_cpu.trainer.run_cpu_trainer` (same arguments), the result carrying ``vllm_kernels``
    (set of library file names), ``left_shm`` (set of segment names) and ``scratch`` (list of paths)."""
    before = unmapped_shm_segments()
    kernels: set[str] = set()

    def note_kernels(step: int, metrics: dict) -> None:  # while the run's processes live
        kernels.update(run_vllm_kernels(str(Path(run_dir).resolve())))

    run = run_cpu_trainer(method, assets, run_dir, on_step=note_kernels, **kwargs)
    run.vllm_kernels = kernels
    log = run.log.read_text(errors="replace") if run.log.is_file() else ""
    run.left_shm = unmapped_shm_segments() - before
    run.scratch = [Path(p) for p in SCRATCH_LINE.findall(log)]
    return run
