"""Process guard: run a function under a hard wall-clock limit, from any thread.

Signal-based timeouts only work in a main thread, verl 0.9.1 calls rewards from executor threads,
and sympy stuck in C cannot be interrupted at all: so the call runs in a persistent helper process,
killed when the limit passes. Nothing here knows about answers.
"""

from __future__ import annotations

import importlib
import logging
import os
import queue
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable, Mapping, Optional

WORKERS_ENV = "STAPO_REWARD_WORKERS"  # how many helper processes one process may run

# statuses of TimeLimitedRunner.call under which the function's answer is unknown: a grader turns
# them into "ungraded", never into a verdict
UNGRADED_STATUSES = ("timeout", "unavailable", "died")


class RewardConfigError(ValueError):
    """A setting of the rewards (an environment variable) is invalid: raised, never scored as -1."""


def workers_from_env(environ: Optional[Mapping[str, str]] = None) -> int:
    """The number of helper processes :data:`WORKERS_ENV` asks for (``environ`` defaults to
    ``os.environ``): a whole number >= 1; unset or empty means min(4, CPUs); anything else
    (``abc``, ``0``, ``1.5``) raises :class:`RewardConfigError`."""
    environ = os.environ if environ is None else environ
    default = min(4, os.cpu_count() or 1)
    raw = environ.get(WORKERS_ENV, "")
    if not raw.strip():
        return default
    workers = int(raw.strip()) if raw.strip().isascii() and raw.strip().isdigit() else 0
    if workers < 1:
        raise RewardConfigError(
            f"{WORKERS_ENV}={raw!r}: expected a whole number >= 1 (how many helper processes the lenient "
            f"reward's symbolic check may run per process); set e.g. {WORKERS_ENV}={default}, or unset it "
            f"for the default min(4, CPUs) = {default}"
        )
    return workers


def _resolve(fn: Callable[..., Any] | str) -> Callable[..., Any]:
    """A function, or the function a ``"module:function"`` name points at (imported here)."""
    if isinstance(fn, str):
        module_name, _, attr = fn.partition(":")
        return getattr(importlib.import_module(module_name), attr)
    return fn


def _guard_worker_main(read_fd: int, write_fd: int, warm_up: str = "") -> None:
    """Loop of a helper process: run ``warm_up`` (a ``"module:function"`` name, called without
    arguments; its errors are ignored), report ready, then receive ``(fn, args)`` and send
    ``("ok"|"err", value)`` until the parent closes the pipe."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its own timeouts are expected here
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    if warm_up:
        try:
            _resolve(warm_up)()
        except Exception:  # noqa: BLE001 - a failing warm-up only costs the first call its speed
            pass
    outbox.send(("ready", None))
    while True:
        try:
            fn, args = inbox.recv()
        except EOFError:
            return
        try:
            outbox.send(("ok", _resolve(fn)(*args)))
        except Exception as exc:  # noqa: BLE001 - report to the parent, keep serving
            outbox.send(("err", f"{type(exc).__name__}: {exc}"))


# Read once when this module is imported, so that a process that can grade (the trainer loading its
# reward function, the evaluation) stops at its start on an invalid value, naming the variable,
# instead of failing after hours of work or scoring every answer that needs the symbolic check -1.
workers_from_env()


_WORKER_CODE = (
    "import sys; from recipe.stapo.reward.guard import _guard_worker_main; "
    "_guard_worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])"
)


class _GuardWorker:
    """One helper process (a fresh interpreter, so the caller's ``__main__`` is never re-run)
    and the parent's ends of its two pipes."""

    def __init__(self, startup_timeout_s: float, warm_up: str = ""):
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or ".") for p in sys.path)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _WORKER_CODE, str(to_child_r), str(from_child_w), warm_up],
                pass_fds=(to_child_r, from_child_w),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self.inbox = Connection(from_child_r, writable=False)
        self.outbox = Connection(to_child_w, readable=False)
        if not self.inbox.poll(startup_timeout_s):
            self.kill()
            raise RuntimeError(f"reward guard worker did not start within {startup_timeout_s}s")
        self.inbox.recv()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        self.inbox.close()
        self.outbox.close()


class TimeLimitedRunner:
    """Runs picklable top-level functions in persistent helper processes under a hard time limit.

    Thread-safe: concurrent callers each take an idle helper (up to ``max_workers`` are spawned
    lazily); time spent waiting for a free helper, or for a new one to start (and warm up), does
    not count against a call's limit. A call that exceeds its limit kills its helper, so the limit
    holds even for code stuck in C and even when called outside the main thread. ``warm_up`` is a
    ``"module:function"`` each helper calls once before it takes calls (e.g. to import sympy,
    seconds on a busy machine, outside every call's limit).
    """

    def __init__(self, max_workers: int = 2, startup_timeout_s: float = 60.0, warm_up: str = ""):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._idle: "queue.Queue[_GuardWorker]" = queue.Queue()
        self._slots = threading.Semaphore(max_workers)
        self._startup_timeout_s = startup_timeout_s
        self._warm_up = warm_up

    @property
    def warm_up(self) -> str:
        """The ``"module:function"`` every helper of this runner runs before it takes calls."""
        return self._warm_up

    def call(self, fn: Callable[..., Any] | str, args: tuple, timeout_s: float) -> tuple[str, Any]:
        """Run ``fn(*args)`` in a helper; ``fn`` is a picklable function or ``"module:function"``.
        Returns ``("ok", result)``, ``("err", message)`` when ``fn`` raised (or could not be sent),
        ``("timeout", None)`` (its helper is killed), ``("unavailable", message)`` when no helper
        could be started, or ``("died", message)`` when the helper ended during the call."""
        with self._slots:
            worker = self._take_worker()
            if isinstance(worker, str):
                return "unavailable", worker
            try:
                worker.outbox.send((fn, args))
            except OSError as exc:  # its pipe is closed: the helper ended while idle
                worker.kill()
                return "died", f"{type(exc).__name__}: {exc}"
            except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable function
                worker.kill()
                return "err", f"cannot send the call: {type(exc).__name__}: {exc}"
            try:
                if not worker.inbox.poll(timeout_s):
                    worker.kill()
                    return "timeout", None
                status, value = worker.inbox.recv()
            except (EOFError, OSError) as exc:
                worker.kill()
                return "died", f"{type(exc).__name__}: {exc}"
            self._idle.put(worker)
            return status, value

    def _take_worker(self) -> "_GuardWorker | str":
        """An idle helper that is still alive (helpers that ended while idle are dropped), else a
        new one; the reason as a string when none can be started."""
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                break
            if worker.process.poll() is None:
                return worker
            worker.kill()
        try:
            return _GuardWorker(self._startup_timeout_s, self._warm_up)
        except Exception as exc:  # noqa: BLE001 - reported as a status, never raised
            return f"{type(exc).__name__}: {exc}"

    def helper_pids(self) -> list[int]:
        """Process ids of the idle helpers (the busy ones are in calls)."""
        return sorted(worker.process.pid for worker in list(self._idle.queue))

    def close(self) -> None:
        """End the idle helpers (a later call starts new ones)."""
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return


_RUNNERS: dict[str, TimeLimitedRunner] = {}
_RUNNERS_LOCK = threading.Lock()


def get_runner(warm_up: str = "") -> TimeLimitedRunner:
    """The process-wide runner of the helpers warmed up by ``warm_up``, created on first use: each
    grader has its own helpers, so a call never pays for another grader's imports.
    :data:`WORKERS_ENV` sets the size of each."""
    with _RUNNERS_LOCK:
        runner = _RUNNERS.get(warm_up)
        if runner is None:
            runner = _RUNNERS[warm_up] = TimeLimitedRunner(max_workers=workers_from_env(), warm_up=warm_up)
        return runner
