"""Grading of generated samples and the mean@N metric (docs/eval.md).

Stage 1 is the grading protocol's rule-based answer grader (:mod:`recipe.stapo.eval.protocols`,
retried with :data:`RETRY_LIMIT_FACTORS` times the limit on an ungraded answer), stage 2 a verifier
on what stage 1 did not find correct; both cache their results keyed by the sample and by what
decided them (:func:`grader_identity`, the verifier's ``identity()``).
"""

from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Optional, Sequence

from tqdm import tqdm

import recipe.stapo.eval.justrl_grader as justrl_grader
import recipe.stapo.reward as reward
from recipe.stapo.eval.generate import Problem, ResultCache
from recipe.stapo.eval.justrl_grader import grade_answer as justrl_grade_answer
from recipe.stapo.eval.verifier import AnswerVerifier, Verdict, VerifyItem
from recipe.stapo.reward.lenient import DEFAULT_TIMEOUT_S, Graded, grade_answer as lenient_grade_answer


@dataclass(frozen=True)
class GradedSample:
    """Grade of one sample: ``pred`` None when there is no box where the grader looks,
    ``grader_correct`` None when ungraded, ``verifier_correct`` None when not re-checked; ``status``
    ``ok``, ``timed_out`` (graded wrong: the check ran past its limit on every try) or ``ungraded``."""

    problem_index: int
    sample: int
    pred: Optional[str]
    grader_correct: Optional[bool]
    verifier_correct: Optional[bool] = None
    status: str = "ok"

    @property
    def correct(self) -> bool:
        return bool(self.grader_correct) or bool(self.verifier_correct)

    @property
    def ungraded(self) -> bool:
        """Its correctness is unknown: the grader could not check it and no verifier accepted it."""
        return self.grader_correct is None and not self.verifier_correct


GRADERS = ("lenient", "justrl")
"""The stage-1 answer graders (:mod:`recipe.stapo.eval.protocols` says which protocol uses which)."""
RETRY_LIMIT_FACTORS = (2.0, 4.0)
"""An ungraded answer is retried, at once, with these multiples of the per-answer limit."""


def _grade_function(grader: str):
    """The ``grade_answer`` of ``grader`` (ValueError naming the graders for another name)."""
    if grader not in GRADERS:
        raise ValueError(f"unknown answer grader {grader!r}; known {list(GRADERS)}")
    return lenient_grade_answer if grader == "lenient" else justrl_grade_answer


@lru_cache(maxsize=2)
def _grader_source_sha256(grader: str = "lenient") -> str:
    digest = hashlib.sha256()
    paths = ([Path(justrl_grader.__file__)] if grader == "justrl" else []) + sorted(Path(reward.__file__).parent.glob("*.py"))
    for path in paths:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def grader_identity(timeout_s: float = DEFAULT_TIMEOUT_S, grader: str = "lenient") -> dict:
    """What decides a stage-1 grade: the grader, its code (``lenient``: sha256 of every module of
    ``recipe.stapo.reward``; ``justrl``: of :mod:`recipe.stapo.eval.justrl_grader` and those, whose
    helpers it uses), the versions of ``math_verify`` and verl (whose graders both use), the
    per-answer time limit and the retries of an ungraded answer."""
    def _version(name: str) -> Optional[str]:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    _grade_function(grader)
    return {
        "grader": grader,
        "code_sha256": _grader_source_sha256(grader),
        "math_verify": _version("math-verify"),
        "verl": _version("verl"),
        "timeout_s": float(timeout_s),
        "retry_limit_factors": list(RETRY_LIMIT_FACTORS),
    }


def grade_answers(
    records: dict[tuple[int, int], dict],
    problems: Sequence[Problem],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    desc: str = "grade",
    cache: Optional[ResultCache] = None,
    grader: str = "lenient",
) -> dict[tuple[int, int], GradedSample]:
    """Stage-1 grades of every record (keys ``(problem_index, sample)``), an ungraded answer retried
    after the others (see the module docstring). ``cache``'s identity must be
    :func:`grader_identity` of ``timeout_s`` and ``grader``; ungraded answers are never cached."""
    grade_one = _grade_function(grader)
    truth = {p.index: p.ground_truth for p in problems}
    cached = cache.load() if cache is not None else {}
    graded = {key: GradedSample(key[0], key[1], r.get("pred"), bool(r["grader_correct"]), status=r.get("status", "ok"))
              for key, r in cached.items()}
    todo = [key for key in sorted(records) if key not in graded]
    fresh: list[dict] = []

    def keep(key: tuple[int, int], result: Graded, last_try: bool) -> bool:
        """Record a grade; False when the answer stays ungraded for now."""
        if result.correct is None and not (last_try and result.status == "timeout"):
            graded[key] = GradedSample(key[0], key[1], result.pred, None, status="ungraded")
            return False
        status = "ok" if result.correct is not None else "timed_out"
        graded[key] = GradedSample(key[0], key[1], result.pred, bool(result.correct), status=status)
        fresh.append({"problem_index": key[0], "sample": key[1], "grader_correct": bool(result.correct),
                      "pred": result.pred, "status": status})
        if cache is not None and len(fresh) >= 1024:
            cache.append(fresh)
            fresh.clear()
        return True

    for round_number, factor in enumerate((1.0, *RETRY_LIMIT_FACTORS)):
        last = round_number == len(RETRY_LIMIT_FACTORS)
        label = f"{desc} (retry x{factor:g} limit)" if round_number else desc
        todo = [key for key in tqdm(todo, desc=label, unit="sample")
                if not keep(key, grade_one(records[key]["response"], truth[key[0]], timeout_s * factor), last)]
        if not todo:
            break
    if cache is not None:
        cache.append(fresh)
    return {key: graded[key] for key in sorted(records)}


def _as_verdict(value) -> Verdict:
    return value if isinstance(value, Verdict) else Verdict(bool(value))


def apply_verifier(
    graded: dict[tuple[int, int], GradedSample],
    records: dict[tuple[int, int], dict],
    problems: Sequence[Problem],
    verifier: AnswerVerifier,
    cache: ResultCache,
    batch_size: int = 512,
) -> tuple[dict[tuple[int, int], GradedSample], int]:
    """Re-check the samples stage 1 did not find correct (wrong or ungraded) with ``verifier``
    (cached in ``cache``, whose identity must be ``verifier.identity()``); returns ``(new grades,
    number of samples judged now)``."""
    by_index = {p.index: p for p in problems}
    judged = {key: bool(r["verifier_correct"]) for key, r in cache.load().items()}
    todo = [key for key, g in sorted(graded.items()) if not g.grader_correct and key not in judged]
    for start in tqdm(range(0, len(todo), batch_size), desc="verifier", unit="batch", leave=False):
        keys = todo[start : start + batch_size]
        items = [
            VerifyItem(by_index[k[0]].question, by_index[k[0]].ground_truth, records[k]["response"]) for k in keys
        ]
        verdicts = [_as_verdict(v) for v in verifier.verify(items)]
        if len(verdicts) != len(items):
            raise ValueError(f"verifier {verifier.describe()} returned {len(verdicts)} verdicts for {len(items)} items")
        rows = []
        for k, v in zip(keys, verdicts):
            row = {"problem_index": k[0], "sample": k[1], "verifier_correct": v.correct}
            if v.judgement is not None:
                row.update(judgement=v.judgement, output=v.output, response_chars_dropped=v.response_chars_dropped)
            rows.append(row)
        cache.append(rows)
        judged.update((k, v.correct) for k, v in zip(keys, verdicts))
    grades = {
        key: g if g.grader_correct else GradedSample(g.problem_index, g.sample, g.pred, g.grader_correct, judged.get(key),
                                                     g.status)
        for key, g in graded.items()
    }
    return grades, len(todo)


def mean_at_n(graded: dict[tuple[int, int], GradedSample], problems: Sequence[Problem], n_samples: int,
              use_verifier: bool = True) -> tuple[float, Optional[float]]:
    """mean@N in percent and its standard error: per-problem mean accuracy over its N samples,
    averaged over problems (an ungraded sample counts as not correct here; the summary counts them
    beside it); the standard error is the problems' spread, ``stdev(accuracies) / sqrt(problems)``
    (both the draw of the problems and of their samples; None for one problem)."""
    if not problems:
        raise ValueError("mean_at_n: no problems")
    accuracies = []
    for problem in problems:
        hits = 0
        for sample in range(n_samples):
            grade = graded.get((problem.index, sample))
            if grade is None:
                raise ValueError(f"mean_at_n: problem {problem.index} sample {sample} is not graded")
            hits += grade.correct if use_verifier else bool(grade.grader_correct)
        accuracies.append(hits / n_samples)
    spread = 100.0 * statistics.stdev(accuracies) / math.sqrt(len(accuracies)) if len(accuracies) > 1 else None
    return 100.0 * sum(accuracies) / len(accuracies), spread
