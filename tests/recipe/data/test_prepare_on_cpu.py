"""Data preparation on the fixture files shipped in recipe/stapo/data/fixtures (never the hub)."""

import hashlib
import json
from pathlib import Path

import pandas as pd
import pytest

from recipe.stapo.data import prepare
from recipe.stapo.data.prepare import PROMPT_JOINER, PROMPT_SUFFIX, main
from recipe.stapo.reward import MAX_GROUND_TRUTH_CHARS

FIXTURES = Path(prepare.__file__).parent / "fixtures"


def _jsonl(name):
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line.strip()]


def _sha(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_train_from_dapo_format_jsonl(tmp_path):
    assert main(["train", "--out-dir", str(tmp_path), "--source", str(FIXTURES / "dapo_sample.jsonl")]) == 0
    frame = pd.read_parquet(tmp_path / "train.parquet")
    source = _jsonl("dapo_sample.jsonl")
    unique = {(r["prompt"][0]["content"], r["reward_model"]["ground_truth"]) for r in source}
    assert len(frame) == len(unique) == len(source) - 1  # the fixture repeats one problem once
    first = frame.iloc[0]
    raw = source[0]["prompt"][0]["content"]
    problem = raw[len(prepare.DAPO_PREFIX) : -len(prepare.DAPO_SUFFIX)]
    assert list(first["prompt"]) == [{"role": "user", "content": problem + PROMPT_JOINER + PROMPT_SUFFIX}]
    assert "Answer:" not in first["prompt"][0]["content"]
    assert first["prompt"][0]["content"].endswith("put your final answer within \\boxed{}.")
    assert first["data_source"] == "math_dapo" and first["ability"] == "math"
    assert dict(first["reward_model"]) == {"style": "rule", "ground_truth": source[0]["reward_model"]["ground_truth"]}
    assert first["extra_info"]["index"] == 0 and first["extra_info"]["id"] == source[0]["extra_info"]["index"]
    manifest = json.loads((tmp_path / "manifest.json").read_text())["datasets"]["train"]
    assert manifest["rows"] == len(frame) and manifest["duplicates_removed"] == 1
    assert manifest["output_sha256"] == _sha(tmp_path / "train.parquet")
    assert manifest["source_sha256"] == _sha(FIXTURES / "dapo_sample.jsonl")


def test_bench_from_parquet_and_jsonl_manifest_merges(tmp_path):
    rows = _jsonl("bench_sample.jsonl")
    src = tmp_path / "src.parquet"
    pd.DataFrame([dict(r, answer=str(r["answer"])) for r in rows]).to_parquet(src)
    out = tmp_path / "out"
    args = ["bench", "--out-dir", str(out), "--benchmarks", "aime24,math500"]
    assert main(args + ["--source", f"aime24={src}", "--source", f"math500={FIXTURES / 'bench_sample.jsonl'}"]) == 0
    for name, source in (("aime24", src), ("math500", FIXTURES / "bench_sample.jsonl")):
        frame = pd.read_parquet(out / f"{name}.parquet")
        assert list(frame["data_source"]) == [name] * len(rows)
        assert [r["ground_truth"] for r in frame["reward_model"]] == [str(r["answer"]) for r in rows]
        assert [e["id"] for e in frame["extra_info"]] == [r["id"] for r in rows]
        entry = json.loads((out / "manifest.json").read_text())["datasets"][name]
        assert entry["output_sha256"] == _sha(out / f"{name}.parquet")
        assert entry["source_sha256"] == _sha(source)
        assert entry["rows"] == entry["source_rows"] == len(rows)
    # a later train preparation into the same folder keeps the bench entries
    main(["train", "--out-dir", str(out), "--source", str(FIXTURES / "dapo_sample.jsonl")])
    assert set(json.loads((out / "manifest.json").read_text())["datasets"]) == {"aime24", "math500", "train"}


def test_invalid_rows_error_names_file_and_rows_and_writes_nothing(tmp_path):
    source = FIXTURES / "bench_malformed.jsonl"
    with pytest.raises(ValueError) as err:
        prepare.prepare_dataset(prepare.BENCHMARK_SPECS["amc23"], tmp_path / "amc23.parquet", str(source))
    message = str(err.value)
    assert str(source.resolve()) in message and "3 invalid row(s)" in message
    assert "row 2: missing answer" in message
    assert "row 4: duplicate id 'm1' (first at row 1)" in message
    assert "row 5: empty problem" in message
    assert not (tmp_path / "amc23.parquet").exists() and not list(tmp_path.iterdir())
    # the CLI reports it as an error exit, not a traceback
    assert main(["bench", "--out-dir", str(tmp_path), "--benchmarks", "amc23", "--source", f"amc23={source}"]) == 2


def test_drop_invalid_counts_and_keeps_valid_rows(tmp_path):
    source = FIXTURES / "bench_malformed.jsonl"
    args = ["bench", "--out-dir", str(tmp_path), "--benchmarks", "amc23", "--source", f"amc23={source}", "--drop-invalid"]
    assert main(args) == 0
    frame = pd.read_parquet(tmp_path / "amc23.parquet")
    assert [e["id"] for e in frame["extra_info"]] == ["m1", "m3", "m6"]
    entry = json.loads((tmp_path / "manifest.json").read_text())["datasets"]["amc23"]
    assert entry["dropped_invalid"] == 3 and entry["rows"] == 3 and entry["source_rows"] == 6
    assert entry["output_sha256"] == _sha(tmp_path / "amc23.parquet")


def test_failure_keeps_earlier_outputs_and_old_file(tmp_path):
    good = FIXTURES / "bench_sample.jsonl"
    bad = FIXTURES / "bench_malformed.jsonl"
    assert main(["bench", "--out-dir", str(tmp_path), "--benchmarks", "aime24", "--source", f"aime24={good}"]) == 0
    before = _sha(tmp_path / "aime24.parquet")
    code = main(["bench", "--out-dir", str(tmp_path), "--benchmarks", "aime25,aime24",
                 "--source", f"aime25={good}", "--source", f"aime24={bad}"])
    assert code == 2
    assert _sha(tmp_path / "aime24.parquet") == before  # the failed rewrite left the old file
    manifest = json.loads((tmp_path / "manifest.json").read_text())["datasets"]
    assert set(manifest) == {"aime24", "aime25"}  # aime25 (done before the failure) is recorded
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_truncated_jsonl_line_is_a_named_invalid_row(tmp_path):
    source = tmp_path / "cut.jsonl"
    source.write_text((FIXTURES / "bench_sample.jsonl").read_text() + '{"id": "b6", "problem": "What')
    with pytest.raises(ValueError, match=r"row 6: not valid JSON"):
        prepare.prepare_dataset(prepare.BENCHMARK_SPECS["aime24"], tmp_path / "x.parquet", str(source))


def test_answer_to_text_and_field_lookup():
    assert prepare.answer_to_text(9) == "9"
    assert prepare.answer_to_text(5.0) == "5"
    assert prepare.answer_to_text(["$x=3$"]) == "x=3"
    assert prepare.answer_to_text(["1", "2"]) == "1, 2"
    row = {"prompt": [{"content": "hi"}], "reward_model": {"ground_truth": "4"}}
    assert prepare._lookup(row, "prompt.0.content") == "hi"
    assert prepare._lookup(row, "prompt.1.content") is None
    assert prepare._lookup(row, "reward_model.missing") is None


def test_bad_cli_arguments_are_clear(tmp_path):
    assert main(["bench", "--out-dir", str(tmp_path), "--benchmarks", "aime99"]) == 2
    assert main(["bench", "--out-dir", str(tmp_path), "--source", "nonsense"]) == 2
    assert main(["train", "--out-dir", str(tmp_path), "--source", str(tmp_path / "missing.jsonl")]) == 2


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_train_never_takes_a_worked_solution_as_the_answer(tmp_path):
    source = _write_jsonl(tmp_path / "math.jsonl", [
        {"id": "s1", "problem": "What is 1 + 1?", "solution": "We add one and one, so the answer is $\\boxed{2}$."},
        {"id": "s2", "problem": "What is 2 + 2?", "answer": "4"},
    ])
    with pytest.raises(ValueError) as err:
        prepare.prepare_dataset(prepare.TRAIN_SPEC, tmp_path / "train.parquet", str(source))
    assert "row 1: missing answer (looked for reward_model.ground_truth, answer)" in str(err.value)
    assert "row 2" not in str(err.value) and not (tmp_path / "train.parquet").exists()


LONGEST = "1" * MAX_GROUND_TRUTH_CHARS
BAD_TRUTHS = [  # (answer cell, words the error names)
    ([None], "NoneType"),
    (True, "bool"),
    (float("nan"), "non-finite"),  # Python's json reads the NaN literal
    ({"value": 3}, "dict"),
    ([], "empty list"),
    (["7", None], "NoneType"),
    ("9" * (MAX_GROUND_TRUTH_CHARS + 1), f"more than MAX_GROUND_TRUTH_CHARS={MAX_GROUND_TRUTH_CHARS}"),
]


def test_bad_ground_truths_are_errors_naming_file_row_and_problem(tmp_path):
    rows = [{"id": "ok1", "problem": "p0", "answer": LONGEST}]
    rows += [{"id": f"bad{i}", "problem": f"p{i}", "answer": value} for i, (value, _) in enumerate(BAD_TRUTHS, start=1)]
    source = _write_jsonl(tmp_path / "amc.jsonl", rows)
    with pytest.raises(ValueError) as err:
        prepare.prepare_dataset(prepare.BENCHMARK_SPECS["amc23"], tmp_path / "amc23.parquet", str(source))
    message = str(err.value)
    assert str(source.resolve()) in message and f"{len(BAD_TRUTHS)} invalid row(s)" in message
    for row, (_, words) in enumerate(BAD_TRUTHS, start=2):
        line = next(line for line in message.splitlines() if f": row {row}: " in line)
        assert "invalid answer (field answer)" in line and words in line, line
    assert ": row 1: " not in message and not list(tmp_path.glob("*.parquet"))


def test_drop_invalid_drops_and_counts_bad_ground_truths(tmp_path):
    rows = [{"id": "ok1", "problem": "p0", "answer": LONGEST}, {"id": "ok2", "problem": "p", "answer": 12.0}]
    rows += [{"id": f"bad{i}", "problem": f"p{i}", "answer": value} for i, (value, _) in enumerate(BAD_TRUTHS, start=1)]
    source = _write_jsonl(tmp_path / "amc.jsonl", rows)
    assert main(["bench", "--out-dir", str(tmp_path), "--benchmarks", "amc23", "--source", f"amc23={source}", "--drop-invalid"]) == 0
    frame = pd.read_parquet(tmp_path / "amc23.parquet")
    assert [r["ground_truth"] for r in frame["reward_model"]] == [LONGEST, "12"]
    entry = json.loads((tmp_path / "manifest.json").read_text())["datasets"]["amc23"]
    assert entry["dropped_invalid"] == len(BAD_TRUTHS) and entry["rows"] == 2
