"""Grading of generated samples and the mean@N metric.

Stage 1 is the lenient rule (:func:`recipe.stapo.reward.lenient.grade_solution`: last
``\\boxed{}`` in the final 300 characters, normalised string or symbolic equality, a hard time
limit per answer), deliberately not the strict training reward: evaluation asks whether the answer
is right, not whether it is written exactly like the ground truth. Stage 2, when a verifier is
given, re-checks only the stage-1 failures; its judgements are appended to a JSONL cache so an
interrupted grading resumes too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from tqdm import tqdm

from recipe.stapo.eval.generate import JsonlStore, Problem
from recipe.stapo.eval.verifier import AnswerVerifier, VerifyItem
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


def grade_rule(records: dict[tuple[int, int], dict], problems: Sequence[Problem], timeout_s: float = DEFAULT_TIMEOUT_S, desc: str = "grade") -> dict[tuple[int, int], GradedSample]:
    """Stage-1 grades of every record (keys ``(problem_index, sample)``)."""
    truth = {p.index: p.ground_truth for p in problems}
    graded = {}
    for key in tqdm(sorted(records), desc=desc, unit="sample", leave=False):
        correct, pred = grade_solution(records[key]["response"], truth[key[0]], timeout_s)
        graded[key] = GradedSample(key[0], key[1], pred, correct)
    return graded


def apply_verifier(
    graded: dict[tuple[int, int], GradedSample],
    records: dict[tuple[int, int], dict],
    problems: Sequence[Problem],
    verifier: AnswerVerifier,
    cache: JsonlStore,
    batch_size: int = 512,
) -> dict[tuple[int, int], GradedSample]:
    """Re-check stage-1 failures with ``verifier`` (cached in ``cache``); returns new grades."""
    by_index = {p.index: p for p in problems}
    judged = {key: bool(r["verifier_correct"]) for key, r in cache.load().items()}
    todo = [key for key, g in sorted(graded.items()) if not g.rule_correct and key not in judged]
    for start in tqdm(range(0, len(todo), batch_size), desc="verifier", unit="batch", leave=False):
        keys = todo[start : start + batch_size]
        items = [
            VerifyItem(by_index[k[0]].question, by_index[k[0]].ground_truth, records[k]["response"]) for k in keys
        ]
        verdicts = verifier.verify(items)
        cache.append([{"problem_index": k[0], "sample": k[1], "verifier_correct": bool(v)} for k, v in zip(keys, verdicts)])
        judged.update(zip(keys, map(bool, verdicts)))
    return {
        key: g if g.rule_correct else GradedSample(g.problem_index, g.sample, g.pred, False, judged.get(key))
        for key, g in graded.items()
    }


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
