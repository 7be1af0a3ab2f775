"""One ground-truth rule everywhere: the training reward, the lenient reward and the data preparation
read numbers and lists the same way (``recipe.stapo.reward.answers.ground_truth_conversion``).

References: verl 0.9.1's ``math_dapo.compute_score(..., strict_box_verify=True)`` called with the
expected text, and the text written out by hand for each value.
"""

import json

import numpy as np
import pandas as pd
import pytest
from verl.utils.reward_score.math_dapo import compute_score as verl_math_dapo_score

from recipe.stapo.data.prepare import main as prepare_main
from recipe.stapo.reward import compute_score, compute_score_lenient, ground_truth_problem, ground_truth_text

# (ground-truth cell, its text): every numeric kind the docstrings accept
NUMBERS = [
    (0.5, "0.5"),
    (-0.25, "-0.25"),
    (5.0, "5"),
    (12, "12"),
    (1e-7, "0.0000001"),
    (1e20, "100000000000000000000"),
    (np.float32(0.1), "0.1"),  # not .tolist()'s 0.10000000149011612
    (np.float64(2.5), "2.5"),
    (np.int64(7), "7"),
    ([0.5], "0.5"),
    (np.array([0.75]), "0.75"),
]

# (list cell, its text): several elements are one answer, joined with ", "
LISTS = [
    ([1, 2], "1, 2"),
    (("a", "b"), "a, b"),
    (np.array([3, 4]), "3, 4"),
    (["$1$", " 2 "], "1, 2"),
    (np.array(["x", "y"], dtype=object), "x, y"),
    ([0.5, -1.0], "0.5, -1"),
]


@pytest.mark.parametrize("value, text", NUMBERS + LISTS, ids=repr)
def test_ground_truth_text(value, text):
    assert ground_truth_text(value) == text and ground_truth_problem(value) is None


@pytest.mark.parametrize("value, text", NUMBERS + LISTS, ids=repr)
def test_training_reward_scores_numeric_and_list_ground_truths_as_their_text(value, text):
    response = f"The answer is \\boxed{{{text}}}."
    expected = verl_math_dapo_score(response, text, strict_box_verify=True)
    assert expected["score"] == 1.0
    assert compute_score("x", response, value) == {"score": 1.0, "acc": True, "pred": text}


@pytest.mark.parametrize("value, text", NUMBERS + LISTS, ids=repr)
def test_lenient_reward_scores_numeric_and_list_ground_truths_as_their_text(value, text):
    assert compute_score_lenient("x", f"The answer is \\boxed{{{text}}}.", value)["score"] == 1.0


INVISIBLE = [  # (ground-truth cell with invisible characters, the text every reader sees)
    ("6\u200b", "6"),
    ("\ufeff6", "6"),
    ("1\u20600", "10"),
    ("\\frac{1}{2}\u00ad", "\\frac{1}{2}"),
    (["1\u200b", "2"], "1, 2"),
]


@pytest.mark.parametrize("value, text", INVISIBLE, ids=repr)
def test_invisible_characters_in_a_ground_truth_are_removed_for_both_rewards(value, text):
    assert ground_truth_text(value) == text
    response = f"The answer is \\boxed{{{text}}}."
    assert compute_score("x", response, value) == {"score": 1.0, "acc": True, "pred": text}
    assert compute_score_lenient("x", response, value)["score"] == 1.0


def test_a_ground_truth_of_invisible_characters_only_is_empty():
    assert ground_truth_text("\u200b\ufeff") is None
    assert "empty" in ground_truth_problem("\u200b")


@pytest.mark.parametrize("value, text", LISTS, ids=repr)
def test_a_list_is_never_read_as_its_first_element(value, text):
    first = text.split(", ")[0]
    response = f"The answer is \\boxed{{{first}}}."
    assert compute_score("x", response, value)["score"] == -1.0
    assert compute_score_lenient("x", response, value)["score"] == -1.0


def test_data_preparation_writes_the_same_text(tmp_path):
    """JSONL cells (floats, ints, lists) and a parquet list column: what preparation writes is the
    rewards' text, stripped of surrounding spaces and $."""
    json_values = [(v, t) for v, t in NUMBERS + LISTS + INVISIBLE if not isinstance(v, (np.generic, np.ndarray))]
    rows = [{"id": f"j{i}", "problem": f"p{i}", "answer": value if not isinstance(value, tuple) else list(value)}
            for i, (value, _) in enumerate(json_values)]
    source = tmp_path / "amc.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert prepare_main(["bench", "--out-dir", str(tmp_path / "j"), "--benchmarks", "amc23", "--source", f"amc23={source}"]) == 0
    written = [r["ground_truth"] for r in pd.read_parquet(tmp_path / "j" / "amc23.parquet")["reward_model"]]
    assert written == [text for _, text in json_values]

    parquet = tmp_path / "amc.parquet"
    pd.DataFrame([{"id": "p1", "problem": "a", "answer": [1.5, 2.0]}, {"id": "p2", "problem": "b", "answer": [4.0]}]).to_parquet(parquet)
    assert prepare_main(["bench", "--out-dir", str(tmp_path / "p"), "--benchmarks", "amc23", "--source", f"amc23={parquet}"]) == 0
    written = [r["ground_truth"] for r in pd.read_parquet(tmp_path / "p" / "amc23.parquet")["reward_model"]]
    assert written == ["1.5, 2", "4"]
    # read back the way verl hands a cell to the reward, it still scores as its text
    assert [compute_score("x", f"\\boxed{{{t}}}", t)["score"] for t in written] == [1.0, 1.0]


@pytest.mark.parametrize("value, words", [
    ([[1, 2]], "a list inside a list"),
    ([1, [2]], "a list inside a list"),
    ([1, None], "NoneType"),
    (["1", " $ "], "a list with an empty element"),
    (10**5000, "an integer of more than MAX_GROUND_TRUTH_CHARS"),  # str() of it would raise
    (np.bool_(True), "bool"),
    (np.float64("nan"), "non-finite"),
], ids=range(7))
def test_unusable_ground_truths_never_match_and_never_raise(value, words):
    assert ground_truth_text(value) is None and words in ground_truth_problem(value)
    for fn in (compute_score, compute_score_lenient):
        assert fn("x", "\\boxed{1}", value)["score"] == -1.0
