"""The lenient reward (the evaluation's rule grader, a training option): a table of tricky answers,
robustness, the time guard, verl's signature. The strict training reward: tests/recipe/reward/test_strict_on_cpu.py."""

import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from recipe.stapo.reward import guard, lenient
from recipe.stapo.reward import TAIL_CHARS, RewardConfigError, TimeLimitedRunner, last_boxed_content, normalize_answer
from recipe.stapo.reward import compute_score_lenient
from tests.helpers.paths import REPO


@pytest.fixture(scope="module", autouse=True)
def verl_imported():
    """The normalisation is verl's (imported on first use, seconds on a busy machine): import it
    once up front so that the timing tests below measure grading, not verl's import."""
    import verl.utils.reward_score.math_dapo  # noqa: F401


PAD = "Let me think about this carefully. " * 20  # > TAIL_CHARS of reasoning before the answer

# (response, ground truth, expected score)
CASES = [
    ("So the answer is \\boxed{42}.", "42", 1.0),
    ("So the answer is \\boxed{41}.", "42", -1.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("\\boxed{\\tfrac34}", "\\frac{3}{4}", 1.0),
    ("\\boxed{0.5}", "\\frac12", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{3}}", "0.5", -1.0),
    ("\\boxed{5\\text{ cm}}", "5", 1.0),
    ("\\boxed{5 \\text{ meters}}", "5", 1.0),
    ("\\boxed{30^\\circ}", "30", 1.0),
    ("\\boxed{30^{\\circ}}", "30", 1.0),
    ("\\boxed{\\$12}", "12", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{x = 7}", "7", 1.0),
    ("\\boxed{7.}", "7", 1.0),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{2\\pi}", "2 \\pi", 1.0),
    ("\\boxed{3} wait, actually \\boxed{4}", "4", 1.0),  # the last box counts
    ("\\boxed{4} wait, actually \\boxed{3}", "4", -1.0),
    ("\\boxed{12}" + PAD, "12", -1.0),  # box outside the final 300 characters
    (PAD + "\\boxed{12}", "12", 1.0),
    ("The answer is 12.", "12", -1.0),  # no box
    ("\\boxed{12", "12", -1.0),  # unbalanced
    ("\\boxed{}", "12", -1.0),
    ("\\boxed{\\frac{\\frac{1}{2}}{\\frac{3}{4}}}", "\\frac{2}{3}", 1.0),  # nested braces
    ("\\fbox{9}", "9", 1.0),
    ("", "3", -1.0),
    ("数学 \\boxed{５}", "5", 1.0),  # a full-width digit is the digit (as JustRL's grader reads it)
    ("émoji 🙂 \\boxed{5}", "5", 1.0),
    # lower-case e-notation is a number, not Euler's number (math_verify alone: wrong)
    ("\\boxed{1e6}", "1000000", 1.0),
    ("\\boxed{1000000}", "1e6", 1.0),
    ("\\boxed{1e-3}", "0.001", 1.0),
    ("\\boxed{2.5e3}", "2500", 1.0),
    ("\\boxed{1E6}", "1000000", 1.0),
    ("\\boxed{1e6}", "100000", -1.0),
    ("\\boxed{2e}", "2", -1.0),
    # the empty set's spellings
    ("\\boxed{\\emptyset}", "\\varnothing", 1.0),
    ("\\boxed{\\varnothing}", "\\emptyset", 1.0),
    ("\\boxed{\u2205}", "\\emptyset", 1.0),
    # invisible characters (zero-width space, byte-order mark, word joiner) read as nothing
    ("\\boxed{6}", "6\u200b", 1.0),
    ("\\boxed{6}", "\ufeff6", 1.0),
    ("\\boxed{6\u2060}", "6", 1.0),
    ("\\boxed{7}", "6\u200b", -1.0),
]


@pytest.mark.parametrize("response,truth,expected", CASES)
def test_reward_table(response, truth, expected):
    result = compute_score_lenient("aime24", response, truth)
    assert result["score"] == expected
    assert result["acc"] is (expected == 1.0)
    assert set(result) == {"score", "acc", "pred", "ungraded"} and result["ungraded"] is False


def test_pred_is_last_box_in_tail():
    assert compute_score_lenient("x", "\\boxed{1} then \\boxed{2}", "2")["pred"] == "2"
    assert compute_score_lenient("x", "no box here", "2")["pred"] is None
    assert compute_score_lenient("x", "\\boxed{12}" + PAD, "12")["pred"] is None
    assert len(PAD) > TAIL_CHARS


def test_extraction_and_normalisation_units():
    assert last_boxed_content("a \\boxed{x^{2}} b") == "x^{2}"
    assert last_boxed_content("\\boxed{a} \\boxed{b{c}}") == "b{c}"
    assert last_boxed_content("\\boxed{a") is None
    assert last_boxed_content("nothing") is None
    assert normalize_answer("\\dfrac{1}{2}") == normalize_answer("\\frac12") == "\\frac{1}{2}"
    assert normalize_answer("5\\text{ cm}") == "5"
    assert normalize_answer("$1,234$.") == "1234"


@pytest.mark.parametrize(
    "response",
    [
        None,
        12345,
        b"\\boxed{1}",
        "\x00\x01\x02" * 100,
        "}" * 1000 + "{" * 1000 + "\\boxed{" * 50,
        "\\boxed{" + "{" * 290,
        "\\boxed{\\frac{" + "\\sqrt{" * 40 + "}" * 41 + "}",
        "\ud800 lone surrogate \\boxed{1}",
    ],
)
def test_garbage_never_raises(response):
    result = compute_score_lenient("x", response, "1")
    assert result["score"] in (1.0, -1.0)


#: slack a loaded 2-core machine cannot exceed for work that takes well under a second unloaded
#: (starting a replacement helper process, a linear scan of a megabyte)
SLACK_S = 20.0


def test_huge_output_is_fast():
    big = "x" * (1 << 20) + " \\boxed{7}"
    start = time.perf_counter()
    assert compute_score_lenient("x", big, "7")["score"] == 1.0
    assert compute_score_lenient("x", "\\boxed{7}" + "y" * (1 << 20), "7")["score"] == -1.0
    assert time.perf_counter() - start < SLACK_S  # a scan quadratic in the 1 MB response would take hours


def test_sympy_hostile_answer_is_bounded():
    start = time.perf_counter()
    result = compute_score_lenient("x", "\\boxed{9^{9^{9^{9^{9}}}}}", "1", timeout_s=3.0)
    elapsed = time.perf_counter() - start
    assert result["score"] == -1.0
    assert elapsed < 3.0 + SLACK_S  # limit + worker start


def _hang(*_args):
    """Stands in for a symbolic check that never returns (module level: picklable)."""
    while True:
        time.sleep(0.05)


def _slow_true(*_args):
    time.sleep(0.2)
    return True


def test_guard_kills_a_hanging_check_within_the_limit_from_a_thread(monkeypatch):
    runner = TimeLimitedRunner(max_workers=1, warm_up=lenient._WARM_UP)
    monkeypatch.setitem(guard._RUNNERS, lenient._WARM_UP, runner)
    assert runner.call(_slow_true, (), 10.0) == ("ok", True)  # warm worker: startup excluded below
    monkeypatch.setattr(lenient, "symbolic_check", _hang)
    results = {}

    def worker():  # a non-main thread, where signal-based timeouts cannot work
        start = time.perf_counter()
        results["score"] = compute_score_lenient("x", "\\boxed{0.5}", "\\frac{1}{2}", timeout_s=1.0)["score"]
        results["elapsed"] = time.perf_counter() - start

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=1.0 + 2 * SLACK_S)
    assert not thread.is_alive()
    assert results["score"] == -1.0
    # the check never returns by itself: the call ends at the limit (not before), when its helper is killed
    assert 1.0 <= results["elapsed"] < 1.0 + SLACK_S
    # the killed worker is replaced and the runner keeps working
    monkeypatch.setattr(lenient, "symbolic_check", _slow_true)
    assert compute_score_lenient("x", "\\boxed{0.5}", "\\frac{1}{2}", timeout_s=10.0)["score"] == 1.0


def test_a_right_answer_slow_to_check_is_never_graded_wrong():
    """``(x+1)^{40}`` against its expansion: math_verify parses the expansion in about 2 s. Its own
    time limit (once a third of the guard's) read that as "not equal", a wrong answer with status
    ok; the guard's limit is the only one now, so the answer is right, or ungraded if the machine is
    too slow for the limit, never wrong."""
    import sympy

    x = sympy.symbols("x")
    graded = lenient.grade_answer("\\boxed{(x+1)^{40}}", sympy.latex(sympy.expand((x + 1) ** 40)), timeout_s=5.0)
    assert graded.correct is True or (graded.correct is None and graded.status in guard.UNGRADED_STATUSES), graded


def test_runner_reports_errors_and_bad_size():
    runner = TimeLimitedRunner(max_workers=1)
    status, message = runner.call(int, ("not a number",), 10.0)
    assert status == "err" and "ValueError" in message
    assert runner.call(int, ("12",), 10.0) == ("ok", 12)
    with pytest.raises(ValueError, match="max_workers"):
        TimeLimitedRunner(max_workers=0)


def test_signature_matches_verl_reward_manager_call():
    """verl 0.9.1's NaiveRewardManager / DAPORewardManager call compute_score with these keywords."""
    spec = importlib.util.find_spec("verl")  # read the installed source without importing verl (slow)
    managers = Path(spec.origin).parent / "experimental" / "reward_loop" / "reward_manager"
    source = (managers / "naive.py").read_text() + (managers / "dapo.py").read_text()
    assert source.count("self.compute_score(") >= 4  # async and executor paths of both managers
    for keyword in ("data_source=", "solution_str=", "ground_truth=", "extra_info=", "**extra_reward_kwargs"):
        assert keyword in source
    assert 'score = result["score"]' in source  # verl accepts a dict result with "score"
    result = compute_score_lenient(
        data_source="math_dapo", solution_str="\\boxed{3}", ground_truth="3", extra_info={"index": 0},
        reward_router_address="ignored:0", reward_model_tokenizer=None,
    )
    assert result == {"score": 1.0, "acc": True, "pred": "3", "ungraded": False}


def test_works_when_loaded_by_file_path_like_verl():
    """verl loads reward.custom_reward_function.path files under a private module name."""
    spec = importlib.util.spec_from_file_location("custom_module_test", lenient.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.compute_score_lenient("x", "\\boxed{0.5}", "\\frac{1}{2}")["score"] == 1.0  # needs the symbolic stage
    assert module.compute_score_lenient("x", "\\boxed{0.25}", "\\frac{1}{2}")["score"] == -1.0


def _heavy_modules_loaded():
    """Runs in a guard helper: which heavy packages it has imported (module level: picklable)."""
    import sys

    return sorted(name for name in ("torch", "verl") if name in sys.modules)


def test_guard_helpers_never_import_verl_or_torch():
    """The symbolic stage gets the normalised answers from the caller, so a helper stays small."""
    from recipe.stapo.reward import symbolic_equal

    runner = TimeLimitedRunner(max_workers=1)
    assert runner.call(symbolic_equal, ("0.5", "\\frac12", "0.5", "\\frac{1}{2}"), 60.0) == ("ok", True)
    assert runner.call(_heavy_modules_loaded, (), 60.0) == ("ok", [])


# ----------------------------------------------------------------------------------------------
# inherited false positives, fixed in our layer where the intended answer is unambiguous
# ----------------------------------------------------------------------------------------------
LIST_AND_SET_CASES = [  # (boxed answer, ground truth, expected score)
    # a list of numbers is not the number its digits spell (verl's normalisation drops the commas)
    ("2, 3", "23", -1.0),
    ("23", "2, 3", -1.0),
    ("2,3", "23", -1.0),
    ("1, 2, 3", "123", -1.0),
    ("1,5", "15", -1.0),
    ("1, 23", "12, 3", -1.0),
    ("3 \\text{ and } 4", "34", -1.0),
    # an interval (or pair) is not a set, although math_verify counts them equal
    ("(1,2)", "\\{1,2\\}", -1.0),
    ("\\{1,2\\}", "(1,2)", -1.0),
    ("\\left( 1, 2 \\right)", "\\left\\{ 1, 2 \\right\\}", -1.0),
    ("[1,2)", "\\{1,2\\}", -1.0),
    # what stays correct
    ("2, 3", "2,3", 1.0),
    ("3, 2", "2, 3", 1.0),
    ("1,000", "1000", 1.0),
    ("1,234,567", "1234567", 1.0),
    ("-12,345.5", "-12345.5", 1.0),
    ("\\{1, 2\\}", "1, 2", 1.0),
    ("3 \\text{ and } 4", "3, 4", 1.0),
    ("(1,2)", "(1, 2)", 1.0),
    ("[0, \\infty)", "[0,\\infty)", 1.0),
    ("(1,2), (3,4)", "(3,4), (1,2)", 1.0),
]


@pytest.mark.parametrize("pred, truth, expected", LIST_AND_SET_CASES)
def test_lists_and_sets_are_not_confused(pred, truth, expected):
    assert compute_score_lenient("x", f"So the answer is \\boxed{{{pred}}}.", truth)["score"] == expected


# the readings docs/reward.md documents where the intended answer is ambiguous
AMBIGUOUS_CASES = [
    ("1,234", "1234", 1.0),  # commas in groups of three, no spaces: a thousands separator
    ("1,234", "1, 234", -1.0),  # ... so not the list 1, 234
    ("1234", "1, 234", -1.0),
    ("1, 2", "(1, 2)", 1.0),  # a bare list may be the pair written without parentheses (math_verify)
    ("1, 1, 2", "1, 2", 1.0),  # lists compare as sets (math_verify)
    ("\\{3\\}", "3", 1.0),  # a one-element set equals its element (math_verify)
]


@pytest.mark.parametrize("pred, truth, expected", AMBIGUOUS_CASES)
def test_ambiguous_lists_read_as_documented(pred, truth, expected):
    assert compute_score_lenient("x", f"\\boxed{{{pred}}}", truth)["score"] == expected


@pytest.mark.parametrize("answer, normalised", [
    ("2, 3", "2, 3"), ("2,3", "2, 3"), ("1, 234", "1, 234"), ("1,2345", "1, 2345"), ("1,234", "1234"),
    ("-12,345.5", "-12345.5"), ("1,000.", "1000"), ("1{,}000", "1000"), ("1,\\!000", "1000"),
    ("3 \\text{ and } 4", "3, 4"), ("1, 2, \\text{and} 3", "1, 2, 3"), ("x = 1, 2", "1, 2"),
    ("\\left( 1,2 \\right)", "(1, 2)"), ("\\{1,2\\}", "\\{1, 2\\}"),
])
def test_normalisation_keeps_list_commas(answer, normalised):
    assert normalize_answer(answer) == normalised


# ----------------------------------------------------------------------------------------------
# STAPO_REWARD_WORKERS: validated where it is read, before any work, naming the variable
# ----------------------------------------------------------------------------------------------
def test_workers_from_env_accepts_whole_numbers_only():
    default = min(4, os.cpu_count() or 1)
    assert guard.workers_from_env({}) == guard.workers_from_env({guard.WORKERS_ENV: ""}) == default
    assert guard.workers_from_env({guard.WORKERS_ENV: "3"}) == 3
    assert guard.workers_from_env({guard.WORKERS_ENV: " 2 "}) == 2
    for bad in ("abc", "0", "-1", "1.5", "+3", "1_0", "３"):
        with pytest.raises(RewardConfigError) as info:
            guard.workers_from_env({guard.WORKERS_ENV: bad})
        assert f"STAPO_REWARD_WORKERS={bad!r}: expected a whole number >= 1" in str(info.value)


_SYMBOLIC_ONLY = "print(compute_score_lenient('x', '\\\\boxed{x+1}', '1+x')['score'])"  # needs the symbolic check


def _python(code, **env):
    root = REPO
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])), **env)
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=environ, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("value", ["abc", "0"])
def test_invalid_workers_stop_the_process_before_any_grading(value):
    done = _python("from recipe.stapo.reward import compute_score_lenient; " + _SYMBOLIC_ONLY, STAPO_REWARD_WORKERS=value)
    assert done.returncode != 0 and done.stdout == ""  # never a score
    assert f"RewardConfigError: STAPO_REWARD_WORKERS={value!r}: expected a whole number >= 1" in done.stderr
    # the evaluation's grader fails when it is imported, i.e. before generation
    done = _python("import recipe.stapo.eval.grade", STAPO_REWARD_WORKERS=value)
    assert done.returncode != 0 and f"STAPO_REWARD_WORKERS={value!r}" in done.stderr


def test_valid_workers_grade_in_a_fresh_process():
    done = _python("from recipe.stapo.reward import compute_score_lenient; " + _SYMBOLIC_ONLY, STAPO_REWARD_WORKERS="1")
    assert done.returncode == 0 and done.stdout.strip() == "1.0", done.stderr


def test_workers_made_invalid_after_import_raise_instead_of_scoring(monkeypatch):
    monkeypatch.setattr(guard, "_RUNNERS", {})  # a runner is created (and the variable read) on first use
    monkeypatch.setenv(guard.WORKERS_ENV, "abc")
    with pytest.raises(RewardConfigError, match="STAPO_REWARD_WORKERS='abc'"):
        compute_score_lenient("x", "\\boxed{x+1}", "1+x")
    assert compute_score_lenient("x", "\\boxed{7}", "7")["score"] == 1.0  # equal strings need no helper
