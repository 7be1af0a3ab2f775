"""The configured reward gives each row JustRL's reward for its data_source: Math-Verify for the
benchmarks (in-training validation, as JustRL's trainer grades AIME24/AIME25/AMC23), the strict
reward for training rows and every other source (the tiny task's keeps it: the quickstart's numbers).

Reference for Math-Verify: JustRL's ``reward_score/math_verify.py`` restated (``math_metric`` with
the gold read as LaTeX from ``\\boxed{gt}``, the response as an expression or LaTeX), called here in
the test's main thread, where its signal-based limits work.
"""

import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from math_verify.metric import math_metric
from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig
from verl.trainer.ppo.reward import get_custom_reward_fn

from recipe.stapo.data import prepare
from recipe.stapo.driver import compose
from recipe.stapo.reward import SCORE_BY_SOURCE, dispatch, math_verify_score, strict_score

FIXTURES = Path(prepare.__file__).parent / "fixtures"


def justrl_math_verify(response: str, truth: str) -> float:
    """JustRL's Math-Verify reward, restated (main thread only)."""
    check = math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                        pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))
    try:
        return float(check(["\\boxed{" + truth + "}"], [response])[0])
    except Exception:  # noqa: BLE001 - as JustRL's
        return 0.0


CASES = [  # (response, ground truth): Math-Verify reads all of these its own way
    ("So the answer is \\boxed{\\frac{1}{2}}.", "0.5"),
    ("So the answer is \\boxed{0.4}.", "0.5"),
    ("The answer is 0.5", "0.5"),  # no box: Math-Verify reads the whole response
    ("\\boxed{204}", "\\boxed{204}"),  # JustRL's AIME24 answers are boxed
    ("so \\boxed{x = 2^{1009}}", "$2^{1009}$"),
    ("\\boxed{ 42 }", "42"),
    ("no answer at all", "42"),
    ("", "42"),
    ("\\boxed{(1,2)}", "\\{1,2\\}"),
]


@pytest.fixture(scope="module")
def configured():
    """The reward the recipe's YAML names, loaded as verl loads it."""
    return get_custom_reward_fn(compose(["method=stapo", "model=qwen3_8b"]))


def _call(fn, source, response, truth):
    return fn(data_source=source, solution_str=response, ground_truth=truth, extra_info={"index": 0})


SOURCES = {  # data_source -> the reward it gets
    "math_dapo": "strict",  # training rows (DAPO-Math-17k)
    "stapo_tiny_addition": "strict",  # the quickstart's tiny task (tests/recipe/cpu checks its rows)
    "train": "strict",
    "AIME24": "strict",  # JustRL's own name: the preparation writes the recipe's
    **{name: "math_verify" for name in prepare.BENCHMARK_SPECS},
}


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_each_data_source_gets_its_reward(configured, source):
    for response, truth in CASES:
        expected = strict_score(response, truth) if SOURCES[source] == "strict" else \
            {**math_verify_score(response, truth), "score": justrl_math_verify(response, truth)}
        result = _call(configured, source, response, truth)
        assert result == expected and set(result) == {"score", "acc", "pred"}
        assert result["acc"] is (result["score"] > 0)
    assert _call(configured, source, "\\boxed{\\frac{1}{2}}", "0.5")["score"] == (1.0 if SOURCES[source] != "strict" else -1.0)


def test_the_math_verify_sources_are_the_prepared_benchmarks():
    assert set(SCORE_BY_SOURCE) == set(prepare.BENCHMARK_SPECS)
    assert sorted({justrl_math_verify(r, t) for r, t in CASES}) == [0.0, 1.0]  # the cases tell the two apart


def test_math_verify_works_from_the_threads_verl_calls_rewards_from():
    """verl 0.9.1 calls rewards from executor threads, where math_verify's signal-based limits fail
    (JustRL's function would score every answer 0 there); the check runs in a guard helper."""
    results = {}

    def worker():
        results["guarded"] = dispatch.compute_score("aime24", "\\boxed{\\frac{1}{2}}", "0.5")["score"]
        results["direct"] = justrl_math_verify("\\boxed{\\frac{1}{2}}", "0.5")

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=300)
    assert results == {"guarded": 1.0, "direct": 0.0}


def _hang(*_args):
    """Stands in for a check that never returns (module level: the helper imports it)."""
    while True:
        time.sleep(0.05)


def test_a_check_past_its_limit_scores_justrls_timeout_score(monkeypatch):
    math_verify_score("\\boxed{1}", "1")  # a warm helper: its start is not timed below
    monkeypatch.setattr(dispatch, "_MATH_VERIFY", _hang)
    monkeypatch.setattr(dispatch, "MATH_VERIFY_TIMEOUT_S", 1.0)
    start = time.perf_counter()
    assert math_verify_score("\\boxed{1}", "1") == {"score": 0.0, "acc": False, "pred": None}
    assert time.perf_counter() - start < 30


def test_validation_rows_are_graded_with_math_verify(tmp_path, configured):
    """The validation copy the preparation writes (the YAML's data.val_files) is graded by its
    data_source: a right answer the strict reward refuses (a space in the box) counts."""
    assert prepare.main(["bench", "--out-dir", str(tmp_path), "--benchmarks", "aime24",
                         "--source", f"aime24={FIXTURES / 'bench_sample.jsonl'}"]) == 0
    for row in pd.read_parquet(tmp_path / "aime24_val.parquet").itertuples():
        response = "\\boxed{ " + row.reward_model["ground_truth"] + " }"
        assert _call(configured, row.data_source, response, row.reward_model["ground_truth"])["score"] == 1.0
        assert strict_score(response, row.reward_model["ground_truth"])["score"] == -1.0
