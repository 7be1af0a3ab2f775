"""DAPO rule reward as JustRL and STAPO use it (STAPO_SPEC.md sections 5 and 6).

A response earns +1.0 when the content of its *last* ``\\boxed{...}`` inside its final 300
characters equals the ground truth, and -1.0 otherwise (no box, unbalanced box, wrong answer).
Equality is decided in two stages:

1. string equality after DAPO / Minerva answer normalisation (:func:`normalize_answer`);
2. symbolic equality with ``math_verify`` when the strings differ.

Stage 2 runs in a separate, persistent worker process with a hard wall-clock limit
(:class:`TimeLimitedRunner`): signal-based timeouts (``math_verify``'s own) only work in a
process's main thread, but verl 0.9.1 calls the reward from executor threads
(``RewardManager.run_single`` -> ``loop.run_in_executor``). A worker that exceeds the limit is
killed and the answer counts as wrong, so a pathological output cannot hang a reward worker.

verl entry point (``reward.custom_reward_function.path=<this file>``, ``.name=compute_score``):
verl 0.9.1's reward managers (``verl/experimental/reward_loop/reward_manager/naive.py``,
``dapo.py``) call ``compute_score(data_source=..., solution_str=..., ground_truth=...,
extra_info=..., **reward_kwargs)`` and accept a dict result whose ``"score"`` is the reward; every
key of the dict is logged as ``reward_extra_info``.
"""

from __future__ import annotations

import importlib
import logging
import os
import queue
import re
import subprocess
import sys
import threading
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

TAIL_CHARS = 300
"""Only the last ``TAIL_CHARS`` characters of a response are searched for ``\\boxed{}``."""

DEFAULT_TIMEOUT_S = 5.0
"""Hard wall-clock limit (seconds) of one symbolic comparison."""

CORRECT_SCORE = 1.0
WRONG_SCORE = -1.0

_BOX_OPENERS = ("\\boxed{", "\\fbox{")

# DAPO's normalisation lists (verl/utils/reward_score/math_dapo.py, itself from Minerva /
# lm-evaluation-harness), kept verbatim so that string matching gives the DAPO reward.
_SUBSTITUTIONS = [
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
]
_REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
    "meters", "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}",
    "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
]
# Extra LaTeX spellings folded before the DAPO steps (all are display variants of one value).
_PRE_SUBSTITUTIONS = [
    ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"),
    ("\\left", ""),
    ("\\right", ""),
    ("\\displaystyle", ""),
    ("\\!", ""),
    ("\\,", ""),
    ("°", ""),
    ("\\%", ""),
    ("%", ""),
]


# ----------------------------------------------------------------------------------------------
# extraction and normalisation
# ----------------------------------------------------------------------------------------------
def last_boxed_content(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced.

    Args:
        text: any string.
    Returns:
        The content between the outer braces, or None when there is no box or the last box is
        never closed (``"\\boxed{12"``). Linear in ``len(text)``.
    """
    start = max(text.rfind(opener) for opener in _BOX_OPENERS)
    if start < 0:
        return None
    open_at = text.index("{", start)
    depth = 0
    for pos in range(open_at, len(text)):
        char = text[pos]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : pos]
    return None


def normalize_answer(answer: str) -> str:
    """DAPO / Minerva normalisation of a final answer, plus ``\\dfrac``-style folding.

    Strips units and words (cm, degrees, dollars, ...), ``\\text{}`` wrappers, dollars, spaces,
    ``^\\circ``, percent signs, ``\\left``/``\\right``, trailing periods, thousands separators of
    integers; keeps only the right-hand side of an equation (``x=3`` -> ``3``); rewrites shorthand
    ``\\frac12`` -> ``\\frac{1}{2}`` and ``\\sqrt2`` -> ``\\sqrt{2}``.

    Args:
        answer: a raw answer string (content of a box or a ground truth).
    Returns:
        The normalised string (may be empty).
    """
    final = answer
    for before, after in _PRE_SUBSTITUTIONS:
        final = final.replace(before, after)
    final = final.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        final = final.replace(before, after)
    for expr in _REMOVED_EXPRESSIONS:
        final = final.replace(expr, "")
    final = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final)
    final = re.sub(r"(\\text\{)(.*?)(\})", "\\2", final)
    final = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", final)
    final = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", final)
    final = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final)
    final = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final)
    final = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", final)
    final = final.replace("$", "").strip().rstrip(".").strip()
    if final.replace(",", "").isdigit():
        final = final.replace(",", "")
    return final


# ----------------------------------------------------------------------------------------------
# symbolic equivalence (runs inside the guard's worker process)
# ----------------------------------------------------------------------------------------------
def symbolic_equal(pred: str, gold: str, inner_timeout_s: int = 2) -> bool:
    """``math_verify`` equivalence of two answer strings (raw and normalised forms).

    Meant to run in a guard worker's main thread, where ``math_verify``'s signal-based
    ``inner_timeout_s`` works; the guard adds the hard limit. Returns False on any parse error.
    """
    from math_verify import parse, verify

    kwargs = {"parsing_timeout": inner_timeout_s} if _in_main_thread() else {"parsing_timeout": None}
    verify_timeout = inner_timeout_s if _in_main_thread() else None
    pairs = [(gold, pred), (normalize_answer(gold), normalize_answer(pred))]
    for gold_text, pred_text in pairs:
        if not gold_text or not pred_text:
            continue
        try:
            gold_parsed = parse("\\boxed{" + gold_text + "}", **kwargs)
            pred_parsed = parse("\\boxed{" + pred_text + "}", **kwargs)
            if gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=verify_timeout):
                return True
        except Exception:  # noqa: BLE001 - any failure of the symbolic stage means "not shown equal"
            continue
    return False


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


# ----------------------------------------------------------------------------------------------
# process-based time guard
# ----------------------------------------------------------------------------------------------
def _guard_worker_main(read_fd: int, write_fd: int) -> None:
    """Loop of a guard worker process: receive ``(fn, args)``, send ``("ok"|"err", value)``."""
    from multiprocessing.connection import Connection

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its timeouts are expected here
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    outbox.send(("ready", None))
    while True:
        try:
            fn, args = inbox.recv()
        except EOFError:
            return
        try:
            if isinstance(fn, str):  # "module:function", imported here (see answers_equivalent)
                module_name, _, attr = fn.partition(":")
                fn = getattr(importlib.import_module(module_name), attr)
            outbox.send(("ok", fn(*args)))
        except Exception as exc:  # noqa: BLE001 - report to the parent, keep serving
            outbox.send(("err", f"{type(exc).__name__}: {exc}"))


_WORKER_CODE = "import sys; from recipe.stapo.reward import _guard_worker_main; _guard_worker_main(int(sys.argv[1]), int(sys.argv[2]))"


class _GuardWorker:
    """One worker process (a fresh interpreter, so the caller's ``__main__`` is never re-run)
    and the parent's ends of its two pipes."""

    def __init__(self, startup_timeout_s: float):
        from multiprocessing.connection import Connection

        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or ".") for p in sys.path)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _WORKER_CODE, str(to_child_r), str(from_child_w)],
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
    """Runs picklable top-level functions in persistent worker processes under a hard time limit.

    Thread-safe: concurrent callers each take an idle worker (up to ``max_workers`` are spawned
    lazily); time spent waiting for a worker does not count against a call's limit. A call that
    exceeds its limit kills its worker (a fresh one is spawned on demand), so the limit holds even
    for code stuck in C (sympy) and even when called outside the main thread.

    Args:
        max_workers: most worker processes alive at once.
        startup_timeout_s: limit for a worker to start (import) before it counts as failed.
    """

    def __init__(self, max_workers: int = 2, startup_timeout_s: float = 60.0):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._idle: "queue.Queue[_GuardWorker]" = queue.Queue()
        self._slots = threading.Semaphore(max_workers)
        self._startup_timeout_s = startup_timeout_s

    def call(self, fn: Callable[..., Any] | str, args: tuple, timeout_s: float) -> tuple[str, Any]:
        """Run ``fn(*args)`` in a worker; ``fn`` is a picklable function or ``"module:function"``.

        Returns:
            ``("ok", result)``, ``("err", message)`` when ``fn`` raised, ``("timeout", None)`` when it
            ran past ``timeout_s`` (its worker is killed), or ``("unavailable", message)`` when no
            worker process could be started (e.g. inside a daemonic process).
        """
        with self._slots:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                try:
                    worker = _GuardWorker(self._startup_timeout_s)
                except Exception as exc:  # noqa: BLE001 - reported as a status, never raised
                    return "unavailable", f"{type(exc).__name__}: {exc}"
            try:
                worker.outbox.send((fn, args))
            except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable function
                worker.kill()
                return "err", f"cannot send the call: {type(exc).__name__}: {exc}"
            try:
                if not worker.inbox.poll(timeout_s):
                    worker.kill()
                    return "timeout", None
                status, value = worker.inbox.recv()
            except (EOFError, OSError, BrokenPipeError) as exc:
                worker.kill()
                return "err", f"worker died: {type(exc).__name__}: {exc}"
            self._idle.put(worker)
            return status, value


_RUNNER: Optional[TimeLimitedRunner] = None
_RUNNER_LOCK = threading.Lock()
_UNAVAILABLE_WARNED = False


def get_runner() -> TimeLimitedRunner:
    """The process-wide runner; ``STAPO_REWARD_WORKERS`` sets its size (default min(4, CPUs))."""
    global _RUNNER
    with _RUNNER_LOCK:
        if _RUNNER is None:
            default = min(4, os.cpu_count() or 1)
            _RUNNER = TimeLimitedRunner(max_workers=int(os.environ.get("STAPO_REWARD_WORKERS", default)))
        return _RUNNER


def answers_equivalent(pred: str, gold: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """True when ``pred`` and ``gold`` are equal after normalisation or symbolically.

    Never raises and never runs longer than about ``timeout_s`` (plus a one-off worker start).
    """
    norm_pred, norm_gold = normalize_answer(pred), normalize_answer(gold)
    if not norm_pred or not norm_gold:
        return False
    if norm_pred == norm_gold:
        return True
    inner = max(1, int(timeout_s / 3))
    # By name, not by pickled reference: verl loads this file as a module named
    # "custom_module_<hash>" (reward.custom_reward_function.path), which a worker cannot import.
    fn = _SYMBOLIC_EQUAL_NAME if symbolic_check is symbolic_equal else symbolic_check
    status, value = get_runner().call(fn, (pred, gold, inner), timeout_s)
    if status == "err":
        logger.warning("reward: symbolic check failed (%s); counting the answer as wrong", value)
    if status == "unavailable":
        _warn_unavailable(value)
    return status == "ok" and bool(value)


def _warn_unavailable(message: str) -> None:
    global _UNAVAILABLE_WARNED
    if not _UNAVAILABLE_WARNED:
        logger.warning("reward: symbolic check disabled, no guard worker could start (%s)", message)
        _UNAVAILABLE_WARNED = True


_SYMBOLIC_EQUAL_NAME = "recipe.stapo.reward:symbolic_equal"
symbolic_check: Callable[[str, str, int], bool] = symbolic_equal
"""The function the guard runs for stage 2 (module attribute so tests can substitute it)."""


# ----------------------------------------------------------------------------------------------
# public reward
# ----------------------------------------------------------------------------------------------
def grade_solution(solution_str: Any, ground_truth: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[bool, Optional[str]]:
    """Grade one response with the DAPO rule.

    Args:
        solution_str: the decoded response (non-strings are converted with ``str``).
        ground_truth: the reference answer (a list/tuple of strings counts as its first element).
        timeout_s: hard limit of the symbolic stage.
    Returns:
        ``(correct, pred)``: ``pred`` is the last box content in the final ``TAIL_CHARS``
        characters, or None when there is none.
    """
    text = solution_str if isinstance(solution_str, str) else str(solution_str)
    gold = _ground_truth_text(ground_truth)
    pred = last_boxed_content(text[-TAIL_CHARS:])
    if pred is None:
        return False, None
    return answers_equivalent(pred, gold, timeout_s), pred


def _ground_truth_text(ground_truth: Any) -> str:
    if isinstance(ground_truth, (list, tuple)) and ground_truth:
        ground_truth = ground_truth[0]
    try:  # numpy arrays coming through verl's non_tensor_batch
        import numpy as np

        if isinstance(ground_truth, np.ndarray):
            ground_truth = ground_truth.reshape(-1)[0] if ground_truth.size else ""
    except ImportError:  # pragma: no cover - numpy ships with torch
        pass
    return str(ground_truth)


def compute_score(data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None, **kwargs: Any) -> dict:
    """verl custom reward function: the DAPO rule reward (+1 correct / -1 wrong).

    Args:
        data_source: dataset name (unused: every source is graded by the same rule).
        solution_str: decoded response text.
        ground_truth: reference answer.
        extra_info: per-row info from the parquet (unused).
        **kwargs: ``timeout_s`` (float, default ``DEFAULT_TIMEOUT_S``); anything else verl passes
            (``reward_router_address``, ...) is ignored.
    Returns:
        ``{"score": float (+1.0 or -1.0), "acc": bool, "pred": str | None}``. Never raises.
    """
    timeout_s = float(kwargs.get("timeout_s", DEFAULT_TIMEOUT_S))
    try:
        correct, pred = grade_solution(solution_str, ground_truth, timeout_s)
    except Exception as exc:  # noqa: BLE001 - a reward must never crash a worker
        logger.warning("reward: grading failed (%s: %s); scoring -1", type(exc).__name__, exc)
        correct, pred = False, None
    return {"score": CORRECT_SCORE if correct else WRONG_SCORE, "acc": bool(correct), "pred": pred}
