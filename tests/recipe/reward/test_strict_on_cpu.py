"""The training reward is JustRL's (verl's strict math_dapo), the lenient one differs where expected.

Reference: verl 0.9.1's own ``math_dapo.compute_score(..., strict_box_verify=True)`` called
directly; the reward under test is the one the composed recipe config names, loaded the way verl
loads it (``get_custom_reward_fn``).
"""

from types import SimpleNamespace

import pytest
from verl.trainer.ppo.reward import get_custom_reward_fn
from verl.utils.reward_score.math_dapo import compute_score as verl_math_dapo_score

from recipe.stapo.driver import compose
from recipe.stapo.eval import grade
from recipe.stapo.reward import compute_score, compute_score_lenient

FILLER = "I double-checked every step of the computation above. " * 2  # 110 characters
assert 100 < len(FILLER) < 300 - len("\\boxed{42}")
LONG = "Let me think about this carefully. " * 40  # > 300 characters

# (response, ground truth, strict score, lenient score)
TABLE = [
    ("The answer is \\boxed{42}.", "42", 1.0, 1.0),
    ("The answer is \\boxed{41}.", "42", -1.0, -1.0),
    ("\\boxed{42.0}", "42", -1.0, 1.0),  # decimal vs integer
    ("\\boxed{0.5}", "\\frac{1}{2}", -1.0, 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", -1.0, 1.0),
    ("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}", 1.0, 1.0),
    ("\\boxed{ 42 }", "42", -1.0, 1.0),  # spaces
    ("\\boxed{42}", " 42", -1.0, 1.0),  # space in the ground truth
    ("\\boxed{1000}", "1,000", -1.0, 1.0),
    ("\\boxed{x = 7}", "7", -1.0, 1.0),
    ("\\boxed{5\\text{ cm}}", "5", -1.0, 1.0),
    ("The answer is 42.", "42", -1.0, -1.0),  # no box
    ("\\boxed{42", "42", -1.0, -1.0),  # never closed
    ("\\boxed{}", "42", -1.0, -1.0),
    ("\\boxed{42}" + FILLER, "42", -1.0, 1.0),  # in the last 300, not in the last 100 characters
    ("\\boxed{42}" + LONG, "42", -1.0, -1.0),  # outside the last 300 characters
    ("\\boxed{42}" + FILLER[: 100 - len("\\boxed{42}") + 3], "42", -1.0, 1.0),  # box straddles the 100 mark
    (LONG + "\\boxed{42}", "42", 1.0, 1.0),
    ("\\boxed{41} no, wait: \\boxed{42}", "42", 1.0, 1.0),  # several boxes: the last counts
    ("\\boxed{42} no, wait: \\boxed{41}", "42", -1.0, -1.0),
    ("\\fbox{42}", "42", -1.0, 1.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt{2}}{2}", 1.0, 1.0),  # nested braces
    ("x" * 1_000_000 + " so \\boxed{42}", "42", 1.0, 1.0),  # very long response
    ("\\boxed{42}" + "y" * 1_000_000, "42", -1.0, -1.0),
]


@pytest.fixture(scope="module")
def configured():
    """The training reward and the one-override lenient option, as verl loads them from the config."""
    base = get_custom_reward_fn(compose(["method=stapo", "model=qwen3_8b"]))
    lenient = get_custom_reward_fn(
        compose(["method=stapo", "model=qwen3_8b", "reward.custom_reward_function.name=compute_score_lenient"])
    )
    return base, lenient


def _call(fn, response, truth):
    """The keywords verl 0.9.1's reward managers pass."""
    return fn(data_source="math_dapo", solution_str=response, ground_truth=truth, extra_info={"index": 0})


@pytest.mark.parametrize("response,truth,strict,lenient", TABLE, ids=range(len(TABLE)))
def test_training_reward_is_verls_strict_score(configured, response, truth, strict, lenient):
    reference = verl_math_dapo_score(response, truth, strict_box_verify=True)
    assert reference["score"] == strict  # the table's closed-form reading of verl's rule
    result = _call(configured[0], response, truth)
    assert result == {"score": reference["score"], "acc": reference["acc"], "pred": reference["pred"]}
    assert compute_score("x", response, truth) == result


@pytest.mark.parametrize("response,truth,strict,lenient", TABLE, ids=range(len(TABLE)))
def test_lenient_option_differs_where_expected(configured, response, truth, strict, lenient):
    result = _call(configured[1], response, truth)
    assert result["score"] == lenient and result["acc"] is (lenient == 1.0)
    assert compute_score_lenient("x", response, truth)["score"] == lenient


def test_the_table_separates_the_two_rewards():
    assert sum(s != l for _, _, s, l in TABLE) >= 10 and sum(s == l for _, _, s, l in TABLE) >= 10


def test_the_lenient_answer_grader_of_the_evaluation_is_not_the_strict_reward():
    problems = [SimpleNamespace(index=i, ground_truth=truth) for i, (_, truth, _, _) in enumerate(TABLE)]  # what grade_answers reads
    records = {(i, 0): {"response": response} for i, (response, _, _, _) in enumerate(TABLE)}
    graded = grade.grade_answers(records, problems)
    assert [graded[(i, 0)].grader_correct for i in range(len(TABLE))] == [l == 1.0 for _, _, _, l in TABLE]


def test_training_reward_ignores_the_extra_keywords_verl_passes():
    result = compute_score(
        data_source="math_dapo", solution_str="\\boxed{3}", ground_truth="3", extra_info={"index": 0},
        reward_router_address="ignored:0", reward_model_tokenizer=None,
    )
    assert result == verl_math_dapo_score("\\boxed{3}", "3", strict_box_verify=True) == {"score": 1.0, "acc": True, "pred": "3"}
