"""Grading of generated samples and the mean@N metric.

Stage 1 is the grading protocol's rule (:mod:`recipe.stapo.eval.protocols`): JustRL's
(:func:`recipe.stapo.eval.justrl_rule.grade_solution`: last ``\\boxed{}`` anywhere, mathd or
sympy equality) or the lenient rule (:func:`recipe.stapo.reward.lenient.grade_solution`: last
``\\boxed{}`` in the final 300 characters, normalised string or ``math_verify`` equality), each
with a hard time limit per answer and deliberately not the strict training reward: evaluation asks
whether the answer is right, not whether it is written exactly like the ground truth. Stage 2, when
a verifier is given, re-checks only the stage-1 failures (the paper's grading).

Both stages cache their results on disk (:class:`~recipe.stapo.eval.generate.ResultCache`), each
result keyed by the sample (problem, reference answer, response) and by the identity of its
grader: :func:`rule_identity` (the rule's code and settings) for stage 1, the verifier's
``identity()`` (model, prompt text, input, decoding, parser) for stage 2. A change of any of them
grades again; an interrupted grading resumes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Optional, Sequence

from tqdm import tqdm

import recipe.stapo.eval.justrl_rule as justrl_rule
import recipe.stapo.reward as reward
from recipe.stapo.eval.generate import Problem, ResultCache
from recipe.stapo.eval.verifier import AnswerVerifier, Verdict, VerifyItem
from recipe.stapo.eval.justrl_rule import grade_solution as justrl_grade_solution
from recipe.stapo.reward.lenient import DEFAULT_TIMEOUT_S, grade_solution


@dataclass(frozen=True)
class GradedSample:
    """Grade of one sample.

    Attributes:
        problem_index, sample: the sample's key.
        pred: extracted answer (None: no box in the final 300 characters).
        rule_correct: stage-1 verdict.
        verifier_correct: stage-2 verdict (None when not re-checked).
    """

    problem_index: int
    sample: int
    pred: Optional[str]
    rule_correct: bool
    verifier_correct: Optional[bool] = None

    @property
    def correct(self) -> bool:
        return self.rule_correct or bool(self.verifier_correct)


RULES = ("lenient", "justrl")
"""The stage-1 rules (:mod:`recipe.stapo.eval.protocols` says which protocol uses which)."""


def _check_rule(rule: str) -> None:
    if rule not in RULES:
        raise ValueError(f"unknown grading rule {rule!r}; known {list(RULES)}")


@lru_cache(maxsize=2)
def _rule_source_sha256(rule: str = "lenient") -> str:
    digest = hashlib.sha256()
    paths = [Path(justrl_rule.__file__)] if rule == "justrl" else sorted(Path(reward.__file__).parent.glob("*.py"))
    for path in paths:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def rule_identity(timeout_s: float = DEFAULT_TIMEOUT_S, rule: str = "lenient") -> dict:
    """What decides a stage-1 grade: the rule, its code (``lenient``: sha256 of every module of
    ``recipe.stapo.reward``; ``justrl``: of :mod:`recipe.stapo.eval.justrl_rule`), the versions of
    ``math_verify`` and verl (whose graders both rules use), and the per-answer time limit."""
    def _version(name: str) -> Optional[str]:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    _check_rule(rule)
    return {
        "rule": rule,
        "code_sha256": _rule_source_sha256(rule),
        "math_verify": _version("math-verify"),
        "verl": _version("verl"),
        "timeout_s": float(timeout_s),
    }


def grade_rule(
    records: dict[tuple[int, int], dict],
    problems: Sequence[Problem],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    desc: str = "grade",
    cache: Optional[ResultCache] = None,
    rule: str = "lenient",
) -> dict[tuple[int, int], GradedSample]:
    """Stage-1 grades of every record (keys ``(problem_index, sample)``).

    Args:
        cache: cached grades of this rule (its grader identity must be :func:`rule_identity` of
            ``timeout_s`` and ``rule``); new grades are appended to it.
        rule: ``lenient`` or ``justrl`` (:data:`RULES`).
    """
    _check_rule(rule)
    grade_one = grade_solution if rule == "lenient" else justrl_grade_solution
    truth = {p.index: p.ground_truth for p in problems}
    cached = cache.load() if cache is not None else {}
    graded = {key: GradedSample(key[0], key[1], r.get("pred"), bool(r["rule_correct"])) for key, r in cached.items()}
    todo = [key for key in sorted(records) if key not in graded]
    fresh = []
    for key in tqdm(todo, desc=desc, unit="sample", leave=False):
        correct, pred = grade_one(records[key]["response"], truth[key[0]], timeout_s)
        graded[key] = GradedSample(key[0], key[1], pred, correct)
        fresh.append({"problem_index": key[0], "sample": key[1], "rule_correct": bool(correct), "pred": pred})
        if cache is not None and len(fresh) >= 1024:
            cache.append(fresh)
            fresh = []
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
    """Re-check stage-1 failures with ``verifier`` (cached in ``cache``, whose grader identity must
    be ``verifier.identity()``).

    Returns:
        ``(new grades, number of samples judged now)``.
    """
    by_index = {p.index: p for p in problems}
    judged = {key: bool(r["verifier_correct"]) for key, r in cache.load().items()}
    todo = [key for key, g in sorted(graded.items()) if not g.rule_correct and key not in judged]
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
        key: g if g.rule_correct else GradedSample(g.problem_index, g.sample, g.pred, False, judged.get(key))
        for key, g in graded.items()
    }
    return grades, len(todo)


def mean_at_n(graded: dict[tuple[int, int], GradedSample], problems: Sequence[Problem], n_samples: int, use_verifier: bool = True) -> float:
    """mean@N in percent: per-problem mean accuracy over its N samples, averaged over problems.

    Raises:
        ValueError: a (problem, sample) among the first ``n_samples`` has no grade.
    """
    if not problems:
        raise ValueError("mean_at_n: no problems")
    total = 0.0
    for problem in problems:
        hits = 0
        for sample in range(n_samples):
            grade = graded.get((problem.index, sample))
            if grade is None:
                raise ValueError(f"mean_at_n: problem {problem.index} sample {sample} is not graded")
            hits += grade.correct if use_verifier else grade.rule_correct
        total += hits / n_samples
    return 100.0 * total / len(problems)
