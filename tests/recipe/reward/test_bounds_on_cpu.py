"""Every reward path returns within a few seconds with a defined score whatever the ground truth,
and a missing or empty ground truth never matches.

Paths: the configured training reward (``compute_score``), the lenient option
(``compute_score_lenient`` / ``grade_answer``) and the evaluation's answer grading (``grade_answers``).
Each call runs in a non-main thread (where verl's reward managers call rewards, and where
signal-based timeouts cannot work) and must return before a deadline.
"""

import threading
import time
from types import SimpleNamespace

import pytest

import recipe.stapo.reward as reward
from recipe.stapo.eval import grade

# Worst case found for the answer normalisation's regular expressions (quadratic in the length):
# 40k characters took over 10 s, 200k characters several minutes before the bound existed.
PATHOLOGICAL = "\\overline{" * 20_000
assert len(PATHOLOGICAL) == 200_000
#: every grading below returns within this (timeouts of 2 s, warm helpers): far above what a loaded
#: 2-core machine needs, far below the minutes an unbounded normalisation of 200k characters takes
DEADLINE_S = 20.0


def _lenient(response, truth):
    return reward.compute_score_lenient("x", response, truth, timeout_s=2.0)


def _strict(response, truth):
    return reward.compute_score("x", response, truth)


def _eval_grader(response, truth):
    graded = grade.grade_answers({(0, 0): {"response": response}}, [SimpleNamespace(index=0, ground_truth=truth)], timeout_s=2.0)
    correct = graded[(0, 0)].grader_correct
    return {"score": 1.0 if correct else -1.0, "acc": correct}


PATHS = {"strict": _strict, "lenient": _lenient, "eval_grader": _eval_grader}


def _bounded(fn, *args, deadline_s=DEADLINE_S):
    """``fn(*args)`` and its wall time; fails if it has not returned after ``deadline_s``."""
    out = {}

    def run():
        start = time.perf_counter()
        out["result"] = fn(*args)
        out["elapsed"] = time.perf_counter() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(deadline_s)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {deadline_s}s"
    return out["result"], out["elapsed"]


@pytest.fixture(scope="module", autouse=True)
def warm():
    """Import verl and start a guard helper once, so the deadlines measure grading only."""
    reward.compute_score("x", "\\boxed{1}", "1")
    reward.compute_score_lenient("x", "\\boxed{0.5}", "\\frac{1}{2}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "response",
    [
        PATHOLOGICAL + "\\boxed{1}",
        "\\boxed{" + PATHOLOGICAL + "}",
        "The answer is \\boxed{" + PATHOLOGICAL[-250:] + "}",  # a box whose content is the truth's tail
    ],
    ids=["long_response", "truth_in_a_box_at_the_start", "tail_of_truth_boxed"],
)
def test_pathological_200k_ground_truth_returns_quickly_with_a_defined_score(path, response):
    result, elapsed = _bounded(PATHS[path], response, PATHOLOGICAL)
    assert result["score"] == -1.0 and result["acc"] is False
    assert elapsed < DEADLINE_S


@pytest.mark.parametrize("path", ["lenient", "eval_grader"])
def test_longest_allowed_ground_truth_normalises_within_a_bound(path, monkeypatch):
    """The bound is on the work, not the clock: verl's normalisation (quadratic in its input) is
    handed at most MAX_GROUND_TRUTH_CHARS characters per call, whatever the machine's load."""
    from verl.utils.reward_score import math_dapo

    seen, normalize = [], math_dapo.normalize_final_answer

    def spy(text):
        seen.append(len(text))
        return normalize(text)

    monkeypatch.setattr(math_dapo, "normalize_final_answer", spy)
    truth = PATHOLOGICAL[: reward.MAX_GROUND_TRUTH_CHARS]
    response = "so \\boxed{" + "\\overline{1}" * 20 + "}"  # a box in the graded tail: compared with the truth
    result, _ = _bounded(PATHS[path], response, truth)
    assert result["score"] == -1.0
    # both answers were normalised (the box's 240 characters, the truth's 1000), none longer
    assert len(seen) >= 2 and max(seen) <= reward.MAX_GROUND_TRUTH_CHARS, seen


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("truth", [None, "", "   ", "\n", [], [None], float("nan"), True, {"answer": "1"}], ids=repr)
@pytest.mark.parametrize(
    "response",
    ["\\boxed{None}", "no box at all", "\\boxed{}", "\\boxed{   }", "\\boxed{\n}", "\\boxed{nan}", "\\boxed{True}",
     "\\boxed{[]}", "\\boxed{[None]}", "\\boxed{{'answer': '1'}}"],
)
def test_missing_or_empty_ground_truth_never_matches(path, truth, response):
    result, _ = _bounded(PATHS[path], response, truth)
    assert result["score"] == -1.0 and result["acc"] is False


@pytest.mark.parametrize("path", PATHS)
def test_valid_ground_truths_still_match(path):
    for truth in ("12", 12, 12.0, ["12"], ("12",)):
        result, _ = _bounded(PATHS[path], "The answer is \\boxed{12}.", truth)
        assert result["score"] == 1.0, (path, truth)
    # a longer list is all its elements (joined with ", ", as the data preparation writes it), never its first
    for response, score in (("The answer is \\boxed{12, 13}.", 1.0), ("The answer is \\boxed{12}.", -1.0)):
        result, _ = _bounded(PATHS[path], response, ("12", "13"))
        assert result["score"] == score, (path, response)
