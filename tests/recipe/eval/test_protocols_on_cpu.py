"""The two grading protocols against their references: JustRL's ``evals/grade.py`` (its answer
grader, an empty question, only an output "A" counts) and CompassVerifier's README (the bare
problem, its verdict format); cases where the two graders disagree, and the readings of Unicode
digits and spaces each grader makes."""

import pytest
import torch

from recipe.stapo.eval import justrl_grader
from recipe.stapo.eval.protocols import DEFAULT_PROTOCOL, PROTOCOLS, bare_problem, get_protocol
from recipe.stapo.reward.lenient import grade_answer as lenient_grade

TAIL = " Checking the work once more gives nothing new." * 10  # 470 characters after the box

# (response, ground truth, JustRL's grader, the lenient grader): the two disagree on each
RULE_CASES = [
    ("so \\boxed{\\frac{10}{2}}", "5", False, True),  # an integer truth needs an integer spelling (JustRL)
    ("so \\boxed{5 kg}", "5", False, True),  # kg is no unit JustRL strips
    ("so \\boxed{42}." + TAIL, "42", True, False),  # JustRL reads the last box anywhere; lenient: last 300 chars
    ("\\fbox{7}", "7", False, True),  # JustRL extracts only \boxed
    ("\\boxed{3} and \\boxed 4", "3", False, True),  # JustRL's last \boxed has no brace: no answer
]
# cases where both agree (the rules are not opposite either)
AGREED = [
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", True),  # JustRL: the sympy stage, in the guard's helper
    ("\\boxed{5.0}", "5", True),
    ("\\boxed{7", "7", False),  # unclosed box
    ("no box at all: 12", "12", False),
]


@pytest.mark.parametrize("response, truth, justrl, lenient", RULE_CASES)
def test_the_two_rules_disagree_where_their_references_do(response, truth, justrl, lenient):
    assert justrl_grader.grade_answer(response, truth, 5.0)[0] is justrl
    assert lenient_grade(response, truth, 5.0)[0] is lenient


@pytest.mark.parametrize("response, truth, correct", AGREED)
def test_the_two_rules_agree_on_plain_answers(response, truth, correct):
    assert justrl_grader.grade_answer(response, truth, 5.0)[0] is correct
    assert lenient_grade(response, truth, 5.0)[0] is correct


def test_justrl_grader_ground_truth_handling():
    assert justrl_grader.grade_answer("\\boxed{12}", "\\boxed{12}", 5.0)[:2] == (True, "12")  # a boxed truth is unboxed
    assert justrl_grader.grade_answer("\\boxed{12}", "", 5.0)[:2] == (False, "12")  # no truth never matches
    assert justrl_grader.grade_answer("\\boxed{12}", None, 5.0)[0] is False
    assert justrl_grader.boxed_answer("a \\boxed{\\frac{1}{2}} b \\boxed{x{y}}") == "x{y}"
    assert justrl_grader.boxed_answer("\\boxed{1} then \\boxed{2") is None


# (verifier output, JustRL counts it correct, the compassverifier protocol counts it correct)
PARSER_CASES = [
    ("A", True, True),
    (" A\n", True, True),  # JustRL strips the output
    ("\\boxed{A}", False, True),
    ("Final Judgment: (A)", False, True),
    ("The answer is A", False, True),  # one letter standing alone
    ("B", False, False),
    ("CORRECT", False, True),  # CV_PROMPT: "Simply reply with either CORRECT, INCORRECT, or INVALID"
]


@pytest.mark.parametrize("output, justrl, compass", PARSER_CASES)
def test_the_two_parsers(output, justrl, compass):
    assert (PROTOCOLS["justrl"].judgement(output) == "A") is justrl
    assert (PROTOCOLS["compassverifier"].judgement(output) == "A") is compass


def readme_process_judgment(judgment_str):
    """CompassVerifier's ``process_judgment`` as its README and src/cv_eval.ipynb write it."""
    import re

    boxed_matches = re.findall(r'boxed{([A-C])}', judgment_str)
    if boxed_matches:
        return boxed_matches[-1]
    if judgment_str in ["A", "B", "C"]:
        return judgment_str
    final_judgment_str = judgment_str.split("Final Judgment:")[-1]
    matches = re.findall(r'\(([A-C])\)*', final_judgment_str)
    if matches:
        return matches[-1]
    matches = re.findall(r'([A-C])', final_judgment_str)
    if matches:
        return matches[-1]
    return ""


# (verifier output, the verdict as written, what the README's last-capital rule reads)
VERDICT_CASES = [
    ("Final Judgment: A - CORRECT", "A", "C"),  # CV_COT_PROMPT's format, unboxed: the C of CORRECT
    ("Final Judgment: A\nThe candidate's answer matches; B would need another value.", "A", "B"),
    ("Final Judgment: B - INCORRECT (the candidate wrote (A) instead)", "B", "A"),
    ("A. The candidate answered 12 where the standard answer (B) ...", "A", "B"),
    ("Final Judgment: **A**", "A", "A"),
    ("INCORRECT", "B", "C"),
    ("INVALID", "C", "A"),  # the A of INVALID: the README counts it correct
    ("Final Judgment: \\boxed{B} - INCORRECT", "B", "B"),  # boxed: the README's first rule, unchanged
    ("A", "A", "A"),
    ("The answer is A, not B", "", "B"),  # two letters and no leading verdict: unreadable
    ("I cannot tell.", "", ""),
]


@pytest.mark.parametrize("output, verdict, readme", VERDICT_CASES)
def test_an_unboxed_verdict_is_read_where_the_format_puts_it_not_flipped_by_a_later_letter(output, verdict, readme):
    assert readme_process_judgment(output) == readme  # the reference's reading, for the record
    assert PROTOCOLS["compassverifier"].judgement(output) == verdict


@pytest.mark.parametrize("joiner", [" ", "\n\n"])  # the evaluation's prompt form, the training one
def test_the_question_each_protocol_shows_the_verifier(joiner):
    message = "What is $1+1$?" + joiner + "Please reason step by step, and put your final answer within \\boxed{}."
    assert PROTOCOLS["justrl"].verifier_question(message) == ""
    assert PROTOCOLS["compassverifier"].verifier_question(message) == "What is $1+1$?"
    assert bare_problem("What is 2?") == "What is 2?"  # no instruction: unchanged


def test_protocol_names_and_default():
    assert DEFAULT_PROTOCOL == "justrl"
    assert (PROTOCOLS["justrl"].grader, PROTOCOLS["compassverifier"].grader) == ("justrl", "lenient")
    with pytest.raises(ValueError, match=r"--grading-protocol must be one of \['compassverifier', 'justrl'\], got 'paper'"):
        get_protocol("paper")
    from tests.helpers.eval_models import scripted_config

    with pytest.raises(ValueError, match="--grading-protocol"):
        scripted_config("bench", "out", grading_protocol="paper").validate()


def test_the_verifier_loads_in_its_checkpoints_dtype(tmp_path):
    """Both references load CompassVerifier in its checkpoint's dtype (``torch_dtype="auto"``,
    vLLM's default ``auto``); so does the evaluation unless --verifier-dtype says otherwise."""
    from recipe.stapo.eval.backends import HFBackend
    from recipe.stapo.eval.verifier import VerifierPrompt, build_verifier
    from transformers import AutoModelForCausalLM

    from tests.helpers.eval_models import build_judge_model

    path = build_judge_model(tmp_path / "judge", "A", positions=256)
    AutoModelForCausalLM.from_pretrained(path).to(torch.bfloat16).save_pretrained(path)
    prompt = VerifierPrompt("{question}{gold_answer}{llm_response}", "t", "0" * 64, None)
    verifier = build_verifier("compass", str(path), prompt, backend="hf")
    assert verifier.identity()["dtype"] == "auto"
    assert verifier.backend.get().model.dtype == torch.bfloat16  # the checkpoint's own
    assert HFBackend(str(path), dtype="float32").model.dtype == torch.float32  # set explicitly
    assert build_verifier("compass", str(path), prompt, backend="hf", dtype="float32").identity()["dtype"] == "float32"


# (response, ground truth, JustRL's grader, the lenient grader, the training reward): the readings
# docs/eval.md lists. JustRL's grader and the training reward are their references' code, unchanged.
UNICODE_CASES = [
    ("\\boxed{\uff14\uff12}", "42", True, True, False),  # full-width digits
    ("\\boxed{\u0664\u0662}", "42", True, True, False),  # Arabic-Indic digits
    ("\\boxed{\u0968\u0966}", "20", True, True, False),  # Devanagari digits
    ("\\boxed{1\u00a0000}", "1000", False, True, False),  # a no-break space as thousands separator
    ("\\boxed{1000}", "1\u202f000", False, True, False),  # a narrow no-break space in the ground truth
    ("\\boxed{12\u2009345}", "12345", False, True, False),  # a thin space
    ("\\boxed{x\u00b2}", "x2", False, False, False),  # a superscript stays a superscript
]


@pytest.mark.parametrize("response, truth, justrl, lenient, strict", UNICODE_CASES)
def test_unicode_digits_and_spaces_as_each_grader_reads_them(response, truth, justrl, lenient, strict):
    from recipe.stapo.reward import compute_score

    assert justrl_grader.grade_answer(response, truth, 5.0)[0] is justrl
    assert lenient_grade(response, truth, 5.0)[0] is lenient
    assert (compute_score("x", response, truth)["score"] == 1.0) is strict


# ----------------------------------------------------------------------------------------------
# the graders' helper processes: one set per grader, started once per process and kept
# ----------------------------------------------------------------------------------------------
@pytest.fixture()
def fresh_runners(monkeypatch):
    """No grader helpers yet in this process (as at the start of a run); the ones the test starts end
    with it."""
    from recipe.stapo.reward import guard

    monkeypatch.setattr(guard, "_RUNNERS", {})
    yield guard
    for runner in guard._RUNNERS.values():
        runner.close()


def test_each_grader_keeps_its_own_helpers_warmed_up_for_it(fresh_runners):
    """The suite's churn: the lenient grader graded first (its helpers import only math_verify), then
    JustRL's sympy stage imported verl inside its 5 s limit in those helpers; on a slow machine that
    ran past the limit, the helper was killed, a new one (warmed for the lenient grader again) started,
    and ``\\boxed{5.0}`` against ``5`` was scored wrong. Each grader now has its own helpers, warmed up
    with its own imports before any call, and they stay."""
    from recipe.stapo.reward import lenient
    from tests.helpers.process_probe import imported

    guard = fresh_runners
    assert lenient_grade("\\boxed{x^2+2x+1}", "(x+1)^2", 30.0)[0] is True  # the lenient grader first
    assert justrl_grader.grade_answer("\\boxed{x^2+2x+1}", "(x+1)^2", 30.0)[0] is True
    justrl_runner, lenient_runner = guard.get_runner(justrl_grader.WARM_UP), guard.get_runner(lenient._WARM_UP)
    assert justrl_runner is not lenient_runner and justrl_runner.warm_up == justrl_grader.WARM_UP
    # JustRL's helper imported verl and sympy in its warm-up, before it took a call; the lenient one never
    assert justrl_runner.call(imported, (("verl", "sympy"),), 30.0) == ("ok", ["sympy", "verl"])
    assert lenient_runner.call(imported, (("verl", "torch"),), 30.0) == ("ok", [])
    pids = (justrl_runner.helper_pids(), lenient_runner.helper_pids())
    assert all(pids)
    for response, truth in (("\\boxed{5.0}", "5"), ("\\boxed{x^2+2x+1}", "(x+1)^2"), ("\\boxed{0.5}", "\\frac{1}{2}")):
        assert justrl_grader.grade_answer(response, truth, 5.0)[0] is True
        assert lenient_grade(response, truth, 5.0)[0] is True
    assert (justrl_runner.helper_pids(), lenient_runner.helper_pids()) == pids  # the same helpers, never restarted


def test_a_helper_killed_while_idle_is_replaced_and_the_answer_graded(fresh_runners):
    import os
    import signal

    assert justrl_grader.grade_answer("\\boxed{x^2+2x+1}", "(x+1)^2", 30.0)[0] is True
    runner = fresh_runners.get_runner(justrl_grader.WARM_UP)
    [pid] = runner.helper_pids()
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert justrl_grader.grade_answer("\\boxed{x^2+2x+1}", "(x+1)^2", 30.0)[0] is True
    assert runner.helper_pids() != [pid]


@pytest.mark.parametrize("grader", ["justrl", "lenient"])
def test_an_answer_whose_check_cannot_run_is_ungraded_never_wrong(fresh_runners, grader):
    """No helper can start (here: a start limit no interpreter meets): the answer is ungraded, and
    the training reward scores it -1 and says so."""
    from recipe.stapo.reward import TimeLimitedRunner, compute_score_lenient, lenient

    warm_up = justrl_grader.WARM_UP if grader == "justrl" else lenient._WARM_UP
    fresh_runners._RUNNERS[warm_up] = TimeLimitedRunner(max_workers=1, startup_timeout_s=0.001, warm_up=warm_up)
    grade_answer = justrl_grader.grade_answer if grader == "justrl" else lenient.grade_answer
    graded = grade_answer("\\boxed{x^2+2x+1}", "(x+1)^2", 5.0)
    assert (graded.correct, graded.status) == (None, "unavailable")
    assert grade_answer("\\boxed{7}", "7", 5.0).correct is True  # equal strings need no helper
    if grader == "lenient":
        assert compute_score_lenient("x", "\\boxed{x^2+2x+1}", "(x+1)^2") == {
            "score": -1.0, "acc": False, "pred": "x^2+2x+1", "ungraded": True}
