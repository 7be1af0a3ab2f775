"""The two grading protocols against the rules of their references: JustRL's ``evals/grade.py``
(its rule stage, an empty question, only an output "A" counts) and CompassVerifier's README (the
bare problem, its ``process_judgment`` parser); cases where the two disagree."""

import pytest
import torch

from recipe.stapo.eval import justrl_rule
from recipe.stapo.eval.protocols import DEFAULT_PROTOCOL, PROTOCOLS, bare_problem, get_protocol
from recipe.stapo.reward.lenient import grade_solution as lenient_grade

TAIL = " Checking the work once more gives nothing new." * 10  # 470 characters after the box

# (response, ground truth, JustRL's rule, the lenient rule): the rule stages disagree on each
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
    assert justrl_rule.grade_solution(response, truth, 5.0)[0] is justrl
    assert lenient_grade(response, truth, 5.0)[0] is lenient


@pytest.mark.parametrize("response, truth, correct", AGREED)
def test_the_two_rules_agree_on_plain_answers(response, truth, correct):
    assert justrl_rule.grade_solution(response, truth, 5.0)[0] is correct
    assert lenient_grade(response, truth, 5.0)[0] is correct


def test_justrl_rule_ground_truth_handling():
    assert justrl_rule.grade_solution("\\boxed{12}", "\\boxed{12}", 5.0) == (True, "12")  # a boxed truth is unboxed
    assert justrl_rule.grade_solution("\\boxed{12}", "", 5.0) == (False, "12")  # no truth never matches
    assert justrl_rule.grade_solution("\\boxed{12}", None, 5.0)[0] is False
    assert justrl_rule.boxed_answer("a \\boxed{\\frac{1}{2}} b \\boxed{x{y}}") == "x{y}"
    assert justrl_rule.boxed_answer("\\boxed{1} then \\boxed{2") is None


# (verifier output, JustRL counts it correct, the README's parser counts it correct)
PARSER_CASES = [
    ("A", True, True),
    (" A\n", True, True),  # JustRL strips the output
    ("\\boxed{A}", False, True),
    ("Final Judgment: (A)", False, True),
    ("The answer is A", False, True),  # the README reads the last capital A/B/C
    ("B", False, False),
    ("CORRECT", False, False),  # the README reads a bare "CORRECT" as "C"
]


@pytest.mark.parametrize("output, justrl, readme", PARSER_CASES)
def test_the_two_parsers(output, justrl, readme):
    assert (PROTOCOLS["justrl"].judgement(output) == "A") is justrl
    assert (PROTOCOLS["compassverifier"].judgement(output) == "A") is readme


def test_the_question_each_protocol_shows_the_verifier():
    message = "What is $1+1$?\n\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert PROTOCOLS["justrl"].verifier_question(message) == ""
    assert PROTOCOLS["compassverifier"].verifier_question(message) == "What is $1+1$?"
    assert bare_problem("What is 2?") == "What is 2?"  # no instruction: unchanged


def test_protocol_names_and_default():
    assert DEFAULT_PROTOCOL == "justrl"
    assert (PROTOCOLS["justrl"].rule, PROTOCOLS["compassverifier"].rule) == ("justrl", "lenient")
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
