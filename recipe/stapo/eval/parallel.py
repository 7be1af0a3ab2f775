"""Data-parallel generation over the GPUs of a node: one worker process per model replica.

The main process (:func:`recipe.stapo.eval.run_eval.run_evaluation`) deals the samples still to
generate out round robin (:func:`deal`); each worker (``python -m recipe.stapo.eval.worker``, on
its own ``CUDA_VISIBLE_DEVICES``) appends the usual generation records to its own part files, which
the main process merges in one worker's order (:func:`recipe.stapo.eval.generate.merge_parts`)
before grading. Workers die with the main process (Linux: ``PR_SET_PDEATHSIG``) and share its lock
on the output folder (:class:`OutputLock`). docs/eval.md ("All GPUs of a node") gives the details.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from stapo_core.fileio import atomic_write, open_regular

WORKERS_DIR = "workers"
LOCK_NAME = ".lock"


class WorkerFailed(RuntimeError):
    """A data-parallel worker exited with an error (the message names its log)."""


class OutputLock:
    """An exclusive ``flock`` on ``OUT/.lock`` held for a whole run (workers inherit it)."""

    def __init__(self, out: Path):
        self.path = Path(out) / LOCK_NAME
        self.fd: Optional[int] = None

    @staticmethod
    def _flock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def busy_message(self) -> str:
        holder = ""
        try:
            holder = self.path.read_text().strip()
        except OSError:
            pass
        return (
            f"{self.path.parent}: another evaluation is writing to this folder ({self.path}: {holder or 'held'}); "
            "wait for it to end (or end it) and rerun, or use another --out"
        )

    def check_free(self) -> None:
        """Raise ValueError when another process holds the lock (writes nothing)."""
        if not self.path.exists():
            return
        fd = open_regular(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            if not self._flock(fd):
                raise ValueError(self.busy_message())
        finally:
            os.close(fd)  # closing drops the probe's lock

    def acquire(self) -> None:
        """Take the lock (creating the folder and the file) and write this process id into it;
        ValueError when another process holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_regular(self.path, os.O_RDWR | os.O_CREAT)
        if not self._flock(fd):
            os.close(fd)
            raise ValueError(self.busy_message())
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def visible_gpus() -> list[str]:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` when set (its entries, indices or
    UUIDs), else the indices ``nvidia-smi`` lists, else none."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and g.strip() != "-1"]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip().isdigit()] if out.returncode == 0 else []


@dataclass(frozen=True)
class WorkerLaunch:
    """How one worker is started: ``env`` is set on top of the main process's environment,
    ``folder`` holds its plan, part files and log."""

    rank: int
    argv: list[str]
    env: dict[str, str]
    folder: Path


def resolve_workers(data_parallel_size: str | int, backend: str, tensor_parallel_size: int, gpus: Sequence[str]) -> int:
    """Number of workers: ``auto`` is every visible GPU's replica for vLLM (``len(gpus) //
    tensor_parallel_size``, at least 1) and 1 for the transformers backend (CPU)."""
    if data_parallel_size == "auto":
        return max(1, len(gpus) // tensor_parallel_size) if backend == "vllm" else 1
    try:
        workers = int(data_parallel_size)
    except (TypeError, ValueError):
        raise ValueError(f"--data-parallel-size must be 'auto' or an integer >= 1, got {data_parallel_size!r}") from None
    if workers < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {workers}")
    if backend == "vllm" and workers > 1 and workers * tensor_parallel_size > len(gpus):
        raise ValueError(
            f"--data-parallel-size {workers} x --tensor-parallel-size {tensor_parallel_size} needs "
            f"{workers * tensor_parallel_size} GPUs, but {len(gpus)} are visible ({','.join(gpus) or 'none'}; "
            "CUDA_VISIBLE_DEVICES or --gpus chooses them)"
        )
    return workers


def worker_launches(out: Path, workers: int, backend: str, tensor_parallel_size: int, gpus: Sequence[str]) -> list[WorkerLaunch]:
    """The command and environment of each worker.

    vLLM workers get ``CUDA_VISIBLE_DEVICES`` = their own ``tensor_parallel_size`` consecutive
    GPUs of ``gpus``; transformers (CPU) workers get ``CUDA_VISIBLE_DEVICES=""``.
    """
    launches = []
    for rank in range(workers):
        folder = Path(out) / WORKERS_DIR / f"rank{rank}"
        devices = ",".join(gpus[rank * tensor_parallel_size : (rank + 1) * tensor_parallel_size]) if backend == "vllm" else ""
        argv = [sys.executable, "-m", "recipe.stapo.eval.worker", "--plan", str(folder / "plan.json")]
        launches.append(WorkerLaunch(rank, argv, {"CUDA_VISIBLE_DEVICES": devices}, folder))
    return launches


def part_store_paths(out: Path) -> list[Path]:
    """Every worker part file under ``OUT/workers`` (from any earlier number of workers)."""
    return sorted((Path(out) / WORKERS_DIR).glob("rank*/generations/*.jsonl"))


def _die_with_parent() -> None:  # pragma: no cover (runs in the child before exec)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def run_workers(launches: Sequence[WorkerLaunch], plans: Sequence[dict], lock: Optional[OutputLock] = None) -> None:
    """Write each worker's plan, start them all, wait for all of them (:class:`WorkerFailed`
    naming the log of each that failed; the work of every worker is kept)."""
    procs = []
    for launch, plan in zip(launches, plans):
        launch.folder.mkdir(parents=True, exist_ok=True)
        atomic_write(launch.folder / "plan.json", json.dumps(plan, ensure_ascii=False) + "\n")
        log = os.fdopen(open_regular(launch.folder / "worker.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab")
        env = {**os.environ, **launch.env}
        print(f"[eval] worker {launch.rank}: {len(plan['items'])} samples, CUDA_VISIBLE_DEVICES={launch.env['CUDA_VISIBLE_DEVICES']!r}, "
              f"log {launch.folder / 'worker.log'}", file=sys.stderr)
        pass_fds = (lock.fd,) if lock is not None and lock.fd is not None else ()
        procs.append((launch, log, subprocess.Popen(
            launch.argv, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent, pass_fds=pass_fds,
        )))
    watch_progress([proc for _, _, proc in procs], [launch.folder for launch in launches],
                   sum(len(plan["items"]) for plan in plans))
    failed = []
    for launch, log, proc in procs:
        code = proc.wait()
        log.close()
        if code != 0:
            failed.append(f"worker {launch.rank} exited with {code} (log: {launch.folder / 'worker.log'})")
    if failed:
        raise WorkerFailed(
            "; ".join(failed) + ". The samples every worker finished are kept: rerun the same command to resume"
        )


class _LineCounter:
    """Counts the lines appended to the part files under a folder since it was made (reads only the
    new bytes of each file at every look)."""

    def __init__(self, folder: Path):
        self.folder, self.read, self.lines = Path(folder), {}, 0

    def count(self) -> int:
        for path in sorted((self.folder / "generations").glob("*.jsonl")):
            try:
                with open(path, "rb") as handle:
                    handle.seek(self.read.get(path, 0))
                    chunk = handle.read()
            except OSError:  # merged and removed meanwhile
                continue
            self.read[path] = self.read.get(path, 0) + len(chunk)
            self.lines += chunk.count(b"\n")
        return self.lines


def watch_progress(procs: Sequence[subprocess.Popen], folders: Sequence[Path], total: int, poll_s: float = 2.0) -> None:
    """A progress bar on this process's console for the samples the workers write into their part
    files (each worker's own bar goes to its log), until every worker has exited."""
    from tqdm import tqdm  # the bar only where workers run

    counters = [_LineCounter(folder) for folder in folders]
    with tqdm(total=total, desc=f"generate ({len(procs)} worker{'s' if len(procs) > 1 else ''})", unit="sample") as bar:
        while True:
            running = any(proc.poll() is None for proc in procs)
            bar.update(min(total, sum(c.count() for c in counters)) - bar.n)
            if not running:
                return
            time.sleep(poll_s)


def deal(items: Sequence, workers: int) -> list[list]:
    """``items`` dealt round robin to at most ``workers`` workers (``items[r::workers]``; no empty share)."""
    count = max(1, min(workers, len(items)))
    return [list(items[r::count]) for r in range(count)] if items else []


def plan_for(config_dict: dict, items: Sequence[tuple[str, str, str, int]]) -> dict:
    """A worker's plan: the run's settings and its ``(decoding, benchmark, problem_id, sample)`` items."""
    return {"config": config_dict, "items": [list(i) for i in items]}


def config_dict(config) -> dict:
    """``EvalConfig`` as JSON-serialisable dict (what a worker rebuilds it from)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}
