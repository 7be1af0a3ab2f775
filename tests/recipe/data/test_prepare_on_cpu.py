"""Data preparation on the fixture files shipped in recipe/stapo/data/fixtures (never the hub)."""

import hashlib
import json
from pathlib import Path

import pandas as pd
import pytest

from recipe.stapo.data import prepare
from recipe.stapo.data.prepare import PROMPT_SUFFIX, main
from recipe.stapo.driver import compose
from recipe.stapo.reward import MAX_GROUND_TRUTH_CHARS

FIXTURES = Path(prepare.__file__).parent / "fixtures"


def _jsonl(name):
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line.strip()]


def _sha(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_train_from_dapo_format_jsonl(tmp_path, capsys):
    assert main(["train", "--out-dir", str(tmp_path), "--source", str(FIXTURES / "dapo_sample.jsonl")]) == 0
    err = capsys.readouterr().err  # not a terminal, as in a log: no progress bar, no cursor escapes
    assert "read train" not in err and "\r" not in err and "\x1b[" not in err
    frame = pd.read_parquet(tmp_path / "train.parquet")
    source = _jsonl("dapo_sample.jsonl")
    unique = {(r["prompt"][0]["content"], r["reward_model"]["ground_truth"]) for r in source}
    assert len(frame) == len(unique) == len(source) - 1  # the fixture repeats one problem once
    first = frame.iloc[0]
    raw = source[0]["prompt"][0]["content"]
    problem = raw[len(prepare.DAPO_PREFIX) : -len(prepare.DAPO_SUFFIX)]
    assert list(first["prompt"]) == [{"role": "user", "content": problem + "\n\n" + PROMPT_SUFFIX}]
    assert "Answer:" not in first["prompt"][0]["content"]
    assert first["prompt"][0]["content"].endswith("put your final answer within \\boxed{}.")
    assert first["data_source"] == "math_dapo" and first["ability"] == "math"
    assert dict(first["reward_model"]) == {"style": "rule", "ground_truth": source[0]["reward_model"]["ground_truth"]}
    assert first["extra_info"]["index"] == 0 and first["extra_info"]["id"] == source[0]["extra_info"]["index"]
    manifest = json.loads((tmp_path / "manifest.json").read_text())["datasets"]["train"]
    assert manifest["rows"] == len(frame) and manifest["duplicates_removed"] == 1
    assert manifest["output_sha256"] == _sha(tmp_path / "train.parquet")
    assert manifest["source_sha256"] == _sha(FIXTURES / "dapo_sample.jsonl")


# JustRL's evals/gen_vllm.py (the evaluation Table 2 follows), copied as it is written there
JUSTRL_EVAL_TEMPLATE = """{problem} Please reason step by step, and put your final answer within \\boxed{{}}."""


def test_benchmark_prompts_are_justrls_evaluation_template_and_training_prompts_keep_the_blank_line(tmp_path):
    """JustRL evaluates with ``problem + " " + instruction`` and trains on ``problem + "\\n\\n" +
    instruction``, which its trainer also gives its validation sets: the benchmark rows hold the
    first, the training rows and the trainer's validation copy (``aime24_val``, the YAML's
    ``data.val_files``) the second, and the manifest names each dataset's form."""
    assert main(["bench", "--out-dir", str(tmp_path), "--benchmarks", "aime24",
                 "--source", f"aime24={FIXTURES / 'bench_sample.jsonl'}"]) == 0
    assert main(["train", "--out-dir", str(tmp_path), "--source", str(FIXTURES / "dapo_sample.jsonl")]) == 0
    bench = pd.read_parquet(tmp_path / "aime24.parquet")
    source = {r["id"]: r for r in _jsonl("bench_sample.jsonl")}
    for prompt, extra in zip(bench["prompt"], bench["extra_info"]):
        problem = source[extra["id"]]["problem"].strip()  # JustRL strips the stored problem too
        assert list(prompt) == [{"role": "user", "content": JUSTRL_EVAL_TEMPLATE.format(problem=problem)}]
    train = pd.read_parquet(tmp_path / "train.parquet")
    raw = _jsonl("dapo_sample.jsonl")[0]["prompt"][0]["content"]
    problem = raw[len(prepare.DAPO_PREFIX) : -len(prepare.DAPO_SUFFIX)]
    assert train.iloc[0]["prompt"][0]["content"] == (
        problem + "\n\nPlease reason step by step, and put your final answer within \\boxed{}.")
    validation = pd.read_parquet(tmp_path / "aime24_val.parquet")
    for prompt, row in zip(validation["prompt"], bench.itertuples()):
        assert prompt[0]["content"] == row.prompt[0]["content"][: -len(" " + PROMPT_SUFFIX)] + "\n\n" + PROMPT_SUFFIX
    assert list(validation["data_source"]) == list(bench["data_source"]) == ["aime24"] * len(bench)
    assert list(validation["reward_model"]) == list(bench["reward_model"])
    datasets = json.loads((tmp_path / "manifest.json").read_text())["datasets"]
    assert (datasets["aime24"]["prompt_form"], datasets["train"]["prompt_form"]) == ("justrl-eval", "train")
    assert datasets["aime24_val"]["prompt_form"] == "train"
    config = compose(["method=stapo", "model=qwen3_8b"])
    assert Path(config.data.val_files).name == "aime24_val.parquet"
    assert prepare.prompt_form(bench.iloc[0]["prompt"][0]["content"]) == "justrl-eval"
    assert prepare.prompt_form(train.iloc[0]["prompt"][0]["content"]) == "train"
    assert prepare.prompt_form("What is 2?") == "custom"


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
    assert set(json.loads((out / "manifest.json").read_text())["datasets"]) == {"aime24", "aime24_val", "math500", "train"}


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
    assert set(manifest) == {"aime24", "aime24_val", "aime25", "aime25_val"}  # aime25 (done before the failure) is recorded
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_truncated_jsonl_line_is_a_named_invalid_row(tmp_path):
    source = tmp_path / "cut.jsonl"
    source.write_text((FIXTURES / "bench_sample.jsonl").read_text() + '{"id": "b6", "problem": "What')
    with pytest.raises(ValueError, match=r"row 6: not valid JSON"):
        prepare.prepare_dataset(prepare.BENCHMARK_SPECS["aime24"], tmp_path / "x.parquet", str(source))


def test_answer_to_text_and_field_lookup():
    assert prepare.answer_to_text(9) == "9"
    assert prepare.answer_to_text(5.0) == "5"
    assert prepare.answer_to_text(["$x=3$"]) == "$x=3$"  # a benchmark's answer as written (JustRL grades it so)
    assert prepare.answer_to_text(["$x=3$"], strip_dollars=True) == "x=3"  # a training answer, compared exactly
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


# ----------------------------------------------------------------------------------------------
# bad input: every problem is a named bad row or a named error, never a silent wrong prompt
# ----------------------------------------------------------------------------------------------
GOOD = {"id": "g1", "problem": "What is 2 + 2?", "answer": "4"}


def _bench(tmp_path, source, *extra):
    return main(["bench", "--out-dir", str(tmp_path / "out"), "--benchmarks", "amc23", "--source", f"amc23={source}", *extra])


def test_non_text_problems_are_named_invalid_rows(tmp_path, capsys):
    source = tmp_path / "amc.jsonl"
    source.write_text(
        json.dumps(GOOD) + "\n"
        + '{"id": "n1", "problem": NaN, "answer": "1"}\n'  # Python's json reads the NaN literal
        + json.dumps({"id": "n2", "problem": {"text": "What is 1 + 1?"}, "answer": "2"}) + "\n"
        + json.dumps({"id": "n3", "problem": 12, "answer": "3"}) + "\n"
        + json.dumps({"id": "n4", "problem": ["What is 1 + 1?"], "answer": "2"}) + "\n"
    )
    assert _bench(tmp_path, source) == 2
    err = capsys.readouterr().err
    assert "4 invalid row(s)" in err and not (tmp_path / "out" / "amc23.parquet").exists()
    for row, got in ((2, "got float nan"), (3, "got dict {'text'"), (4, "got int 12"), (5, "got list")):
        line = next(line for line in err.splitlines() if f": row {row}: " in line)
        assert str(source.resolve()) in line and "problem (field problem) is not text" in line and got in line, line
    assert _bench(tmp_path, source, "--drop-invalid") == 0
    frame = pd.read_parquet(tmp_path / "out" / "amc23.parquet")
    assert [e["id"] for e in frame["extra_info"]] == ["g1"]
    assert [p[0]["content"] for p in frame["prompt"]] == [GOOD["problem"] + " " + PROMPT_SUFFIX]
    entry = json.loads((tmp_path / "out" / "manifest.json").read_text())["datasets"]["amc23"]
    assert entry["dropped_invalid"] == 4 and entry["rows"] == 1 and entry["source_rows"] == 5


def test_empty_parquet_problem_cell_is_an_invalid_row_not_nan(tmp_path, capsys):
    source = tmp_path / "amc.parquet"
    pd.DataFrame([GOOD, {"id": "e1", "problem": None, "answer": "5"}]).to_parquet(source)
    assert _bench(tmp_path, source) == 2
    assert f"{source.resolve()}: row 2: problem (field problem) is not text" in capsys.readouterr().err
    assert not (tmp_path / "out" / "amc23.parquet").exists()
    # an empty cell of an earlier candidate field is skipped: the next field holds the problem
    both = tmp_path / "both.parquet"
    pd.DataFrame([{"id": "q1", "question": None, "problem": "What is 3 + 3?", "answer": "6"},
                  {"id": "q2", "question": "What is 4 + 4?", "problem": None, "answer": "8"}]).to_parquet(both)
    assert _bench(tmp_path, both) == 0
    frame = pd.read_parquet(tmp_path / "out" / "amc23.parquet")
    assert [p[0]["content"].split(" " + PROMPT_SUFFIX)[0] for p in frame["prompt"]] == ["What is 3 + 3?", "What is 4 + 4?"]


def test_non_utf8_jsonl_line_is_a_named_invalid_row(tmp_path, capsys):
    source = tmp_path / "amc.jsonl"
    source.write_bytes((json.dumps(GOOD) + "\n").encode() + b'{"id": "l1", "problem": "caf\xe9 au lait?", "answer": "1"}\n')
    assert _bench(tmp_path, source) == 2
    err = capsys.readouterr().err
    assert f"{source.resolve()}: row 2: not UTF-8 text (byte 0xe9" in err and "re-save the file as UTF-8" in err
    assert _bench(tmp_path, source, "--drop-invalid") == 0
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["datasets"]["amc23"]["dropped_invalid"] == 1


def test_lone_surrogates_are_named_invalid_rows(tmp_path, capsys):
    source = tmp_path / "amc.jsonl"
    source.write_text(json.dumps(GOOD) + "\n"
                      + '{"id": "s1", "problem": "x \\ud800 y", "answer": "1"}\n'
                      + '{"id": "s2", "problem": "ok", "answer": "2\\udfff"}\n'
                      + '{"id": "s3\\ud800", "problem": "ok", "answer": "3"}\n')
    assert _bench(tmp_path, source) == 2
    err = capsys.readouterr().err
    assert f"{source.resolve()}: row 2: problem (field problem) has a lone surrogate (U+D800) at character 3" in err
    assert "row 3: invalid answer (field answer): a lone surrogate (U+DFFF) at character 2" in err
    assert "row 4: id (field id) has a lone surrogate (U+D800)" in err
    assert _bench(tmp_path, source, "--drop-invalid") == 0
    assert [e["id"] for e in pd.read_parquet(tmp_path / "out" / "amc23.parquet")["extra_info"]] == ["g1"]


@pytest.mark.parametrize("name, content, words", [
    ("bad.json", b'[{"problem": "caf\xe9"}]', "not UTF-8 text (byte 0xe9 at offset 17)"),
    ("bad.json", b'[{"problem": ', "not valid JSON"),
    ("bad.parquet", b"not a parquet file", "cannot be read as a parquet file"),
])
def test_unreadable_source_file_is_an_error_naming_it(tmp_path, capsys, name, content, words):
    source = tmp_path / name
    source.write_bytes(content)
    assert _bench(tmp_path, source) == 2
    err = capsys.readouterr().err
    assert f"error: {source}: {words}" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("manifest", ["{corrupt", "[1, 2]", '{"datasets": "aime24"}', b"\xff\xfe"])
def test_corrupt_manifest_is_named_and_nothing_is_replaced(tmp_path, capsys, manifest):
    out = tmp_path / "out"
    good = FIXTURES / "bench_sample.jsonl"
    assert main(["bench", "--out-dir", str(out), "--benchmarks", "aime24", "--source", f"aime24={good}"]) == 0
    path = out / "manifest.json"
    path.write_bytes(manifest if isinstance(manifest, bytes) else manifest.encode())
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    other = _write_jsonl(tmp_path / "other.jsonl", [GOOD])  # would change aime24.parquet
    capsys.readouterr()
    assert main(["bench", "--out-dir", str(out), "--benchmarks", "aime24", "--source", f"aime24={other}"]) == 2
    err = capsys.readouterr().err
    assert f"error: {path}: corrupt manifest" in err and "move it aside" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the parquet was not replaced
    assert main(["train", "--out-dir", str(out), "--source", str(FIXTURES / "dapo_sample.jsonl")]) == 2
    assert not (out / "train.parquet").exists()


def test_manifest_write_failure_keeps_the_old_parquet(tmp_path, monkeypatch):
    out = tmp_path / "out"
    good = FIXTURES / "bench_sample.jsonl"
    assert main(["bench", "--out-dir", str(out), "--benchmarks", "aime24", "--source", f"aime24={good}"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(path, obj):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(prepare, "atomic_write_json", full_disk)
    other = _write_jsonl(tmp_path / "other.jsonl", [GOOD])
    assert main(["bench", "--out-dir", str(out), "--benchmarks", "aime24", "--source", f"aime24={other}"]) == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_parquet_rename_failure_puts_the_manifest_back(tmp_path, monkeypatch):
    out = tmp_path / "out"
    good = FIXTURES / "bench_sample.jsonl"
    assert main(["bench", "--out-dir", str(out), "--benchmarks", "aime24", "--source", f"aime24={good}"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_replace = prepare.os.replace

    def failing_replace(src, dst):
        if str(dst).endswith(".parquet"):
            raise OSError(5, "Input/output error", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(prepare.os, "replace", failing_replace)
    other = _write_jsonl(tmp_path / "other.jsonl", [GOOD])
    assert main(["bench", "--out-dir", str(out), "--benchmarks", "aime24", "--source", f"aime24={other}"]) == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("command", ["train", "bench"])
def test_out_dir_that_is_a_file_is_a_clear_error(tmp_path, capsys, command):
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    source = ["--source", str(FIXTURES / "dapo_sample.jsonl")] if command == "train" else [
        "--benchmarks", "aime24", "--source", f"aime24={FIXTURES / 'bench_sample.jsonl'}"]
    assert main([command, "--out-dir", str(afile), *source]) == 2
    assert f"error: --out-dir {afile} is a file, not a folder" in capsys.readouterr().err
    assert main([command, "--out-dir", str(afile / "sub"), *source]) == 2
    assert f"cannot be created: {afile} is a file" in capsys.readouterr().err
    assert afile.read_text() == "not a folder"


ANSWERS = [  # (answer cell, ground truth written): the rewards' rule (ground_truth_text), then stripped of spaces
    (0.5, "0.5"),
    (1e-7, "0.0000001"),
    (5.0, "5"),
    (12, "12"),
    ([1, 2], "1, 2"),
    (["$1$", " 2 "], "1, 2"),
    (["  $x=3$ "], "$x=3$"),
]


def test_answers_are_written_by_the_rewards_rule(tmp_path):
    from recipe.stapo.reward import ground_truth_text

    rows = [{"id": f"a{i}", "problem": f"p{i}", "answer": value} for i, (value, _) in enumerate(ANSWERS)]
    assert main(["bench", "--out-dir", str(tmp_path), "--benchmarks", "amc23",
                 "--source", f"amc23={_write_jsonl(tmp_path / 'amc.jsonl', rows)}"]) == 0
    written = [r["ground_truth"] for r in pd.read_parquet(tmp_path / "amc23.parquet")["reward_model"]]
    assert written == [text for _, text in ANSWERS]
    assert written == [ground_truth_text(value).strip() for value, _ in ANSWERS]


def test_list_answers_from_a_parquet_list_column(tmp_path):
    source = tmp_path / "amc.parquet"
    pd.DataFrame([{"id": "l1", "problem": "Roots?", "answer": [2, 3]}, {"id": "l2", "problem": "Root?", "answer": [7]}]).to_parquet(source)
    assert main(["bench", "--out-dir", str(tmp_path), "--benchmarks", "amc23", "--source", f"amc23={source}"]) == 0
    assert [r["ground_truth"] for r in pd.read_parquet(tmp_path / "amc23.parquet")["reward_model"]] == ["2, 3", "7"]


def test_overlapping_preparations_into_one_folder_keep_both_manifest_entries(tmp_path, monkeypatch):
    """A second preparation finishes while the first is still reading its source: the first one's
    manifest update keeps the second's entry (the earlier code wrote the manifest it read at its start)."""
    out = tmp_path / "out"
    good = FIXTURES / "bench_sample.jsonl"
    real_collect = prepare.collect_records
    calls = []

    def collect_while_another_run_finishes(spec, rows, label, drop_invalid):
        calls.append(spec.name)
        if len(calls) == 1:  # the first run is reading its rows: the overlapping run writes amc23
            assert main(["bench", "--out-dir", str(out), "--benchmarks", "amc23", "--source", f"amc23={good}"]) == 0
        return real_collect(spec, rows, label, drop_invalid)

    monkeypatch.setattr(prepare, "collect_records", collect_while_another_run_finishes)
    assert main(["bench", "--out-dir", str(out), "--benchmarks", "aime24", "--source", f"aime24={good}"]) == 0
    datasets = json.loads((out / "manifest.json").read_text())["datasets"]
    assert set(datasets) == {"aime24", "amc23", "aime24_val", "amc23_val"}
    for name in ("aime24", "amc23", "aime24_val", "amc23_val"):
        assert datasets[name]["output_sha256"] == _sha(out / f"{name}.parquet")


#: a preparation (argv[2:]) killed at the rename onto a file whose name ends with argv[1]
_KILLED_AT_RENAME = """
import os, signal, sys
from recipe.stapo.data import prepare
real_replace = os.replace
def kill_at_rename(src, dst):
    if str(dst).endswith(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst)
os.replace = kill_at_rename
sys.exit(prepare.main(sys.argv[2:]))
"""


def _aime24_prepared_then_a_bigger_one(tmp_path):
    """``(out, small, big)``: aime24 prepared into ``out`` from a one-row ``small`` source; ``big`` a
    50-row source to prepare next."""
    out = tmp_path / "out"
    small = _write_jsonl(tmp_path / "small.jsonl", [GOOD])
    big = _write_jsonl(tmp_path / "big.jsonl", [dict(GOOD, id=f"g{i}", problem=f"What is {i} + 2?") for i in range(50)])
    assert main(["bench", "--out-dir", str(out), "--benchmarks", "aime24", "--source", f"aime24={small}"]) == 0
    return out, small, big


def _prepare_killed_at_rename(out, source, suffix: str) -> None:
    """aime24 prepared from ``source`` in a process killed (SIGKILL) as it renames onto ``*suffix``."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    killed = subprocess.run([sys.executable, "-c", _KILLED_AT_RENAME, suffix, "bench", "--out-dir", str(out),
                             "--benchmarks", "aime24", "--source", f"aime24={source}"], env=env, capture_output=True,
                            timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]


def test_a_kill_between_manifest_and_rename_is_finished_by_the_next_run(tmp_path):
    out, small, big = _aime24_prepared_then_a_bigger_one(tmp_path)
    _prepare_killed_at_rename(out, big, ".parquet")
    assert list(out.glob(".aime24.parquet.*.tmp"))  # the kill left the temp file
    # any reader of the manifest (here: the next preparation of another benchmark) finishes the rename
    assert main(["bench", "--out-dir", str(out), "--benchmarks", "amc23", "--source", f"amc23={small}"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert "pending" not in manifest
    assert manifest["datasets"]["aime24"]["rows"] == len(pd.read_parquet(out / "aime24.parquet")) == 50
    assert manifest["datasets"]["aime24"]["output_sha256"] == _sha(out / "aime24.parquet")
    assert not list(out.glob(".*.tmp"))


def test_a_stale_temp_file_of_a_kill_before_the_manifest_is_removed(tmp_path):
    out = tmp_path / "out"
    good = FIXTURES / "bench_sample.jsonl"
    out.mkdir()
    (out / ".aime24.parquet.abc123.tmp").write_bytes(b"half a parquet")
    assert main(["bench", "--out-dir", str(out), "--benchmarks", "aime24", "--source", f"aime24={good}"]) == 0
    assert not list(out.glob(".*.tmp"))


@pytest.mark.parametrize("names", ["", " , "])
def test_benchmarks_naming_nothing_is_an_error(tmp_path, capsys, names):
    assert main(["bench", "--out-dir", str(tmp_path / "out"), "--benchmarks", names]) == 2
    assert f"error: --benchmarks {names!r} names no benchmark" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_each_benchmark_has_one_size_everywhere():
    """The size of each benchmark's default source (``expected_rows``; a preparation notes another
    count) is the one docs/eval.md and docs/method.md state, and the one the evaluation's sample
    count (docs/eval.md, "Expected time") is made of."""
    import re

    from recipe.stapo.eval.run_eval import DEFAULT_N_SAMPLES
    from tests.helpers.paths import REPO

    sizes = {name: spec.expected_rows for name, spec in prepare.BENCHMARK_SPECS.items()}
    eval_md = (REPO / "docs" / "eval.md").read_text()
    method_md = (REPO / "docs" / "method.md").read_text()
    for name, size in sizes.items():
        row = next(line for line in eval_md.splitlines() if line.startswith(f"| {name} | "))
        assert [cell.strip() for cell in row.split("|")][5] == str(size), row  # its "problems" column
    labels = {"aime24": "AIME24", "aime25": "AIME25", "amc23": "AMC23", "math500": "MATH500", "minerva": "Minerva",
              "olympiadbench": "OlympiadBench"}
    protocol = method_md[method_md.index("## Evaluation protocol"):]
    for name, label in labels.items():
        assert re.search(rf"{label} \({sizes[name]}[;)\s]", protocol), (label, sizes[name])
    per_decoding = sum(sizes[n] * DEFAULT_N_SAMPLES[n] for n in sizes)
    assert f"One checkpoint is {per_decoding:,} samples per decoding setting" in eval_md.replace("\n", " ")
    for name, label in labels.items():
        assert f"{label} {sizes[name]} x {DEFAULT_N_SAMPLES[name]}" in eval_md.replace("\n", " ")


def test_a_kill_between_the_manifests_update_and_its_rename_leaves_nothing_behind(tmp_path):
    """Killed after writing the manifest's temp file, before renaming it: the folder keeps the old
    manifest and parquet file (consistent), and the next preparation, of any dataset, removes both
    temp files the kill left (the manifest's and the half-prepared parquet file's)."""
    out, small, big = _aime24_prepared_then_a_bigger_one(tmp_path)
    before = {p.name: p.read_bytes() for p in (out / "aime24.parquet", out / "manifest.json")}
    _prepare_killed_at_rename(out, big, "manifest.json")
    assert {p.name: p.read_bytes() for p in (out / "aime24.parquet", out / "manifest.json")} == before
    assert list(out.glob(".manifest.json.*.tmp")) and list(out.glob(".aime24.parquet.*.tmp"))
    assert main(["bench", "--out-dir", str(out), "--benchmarks", "amc23", "--source", f"amc23={small}"]) == 0
    assert not list(out.glob(".*.tmp"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["datasets"]) == {"aime24", "aime24_val", "amc23", "amc23_val"} and manifest["datasets"]["aime24"]["rows"] == 1
    assert manifest["datasets"]["aime24"]["output_sha256"] == _sha(out / "aime24.parquet")


_PREPARE = "import sys; from recipe.stapo.data.prepare import main; sys.exit(main(sys.argv[1:]))"


def test_two_concurrent_preparations_into_one_folder_keep_every_dataset(tmp_path):
    """Two processes preparing into one folder at the same moment (one benchmark in common): each
    writes under the folder's lock, the manifest lists every dataset with the hash of the file on
    disk, no temp file stays."""
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    source = FIXTURES / "bench_sample.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    runs = [subprocess.Popen([sys.executable, "-c", _PREPARE, "bench", "--out-dir", str(out), "--benchmarks",
                              f"{name},amc23", "--source", f"{name}={source}", "--source", f"amc23={source}"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for name in ("aime24", "math500")]
    for run in runs:
        assert run.wait(timeout=300) == 0, run.stderr.read()
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["datasets"]) == {"aime24", "math500", "amc23", "aime24_val", "amc23_val"} and "pending" not in manifest
    for name, entry in manifest["datasets"].items():
        assert entry["output_sha256"] == _sha(out / f"{name}.parquet")
    assert not list(out.glob(".*.tmp"))


# rows as JustRL's data/Olympiad-Bench/test.parquet holds them: verl's layout, the bare problem as the
# one chat message (its trainer adds the instruction), the answer with its $...$ as written there
JUSTRL_ROWS = [
    ("Xenia and Sergey play a game. How many moves does Sergey need?", "2"),
    ("Find the largest $k$ such that $2^k$ divides the sum.", "$2^{1009}$"),
    ("Find the angles.", "$\\angle B E A_{1}=90$,$\\angle A E B_{1}=90$"),
]


def _justrl_parquet(path, system=False):
    rows = [{"prompt": ([{"role": "system", "content": "Be brief."}] if system else []) + [{"role": "user", "content": p}],
             "data_source": "Olympiad-Bench", "ability": "math", "reward_model": {"ground_truth": a, "style": "rule"},
             "extra_info": {"index": f"Olympiad-Bench-{i}", "split": "test"}} for i, (p, a) in enumerate(JUSTRL_ROWS)]
    pd.DataFrame(rows).to_parquet(path)
    return path


@pytest.mark.parametrize("system", [False, True])
def test_a_benchmark_in_verls_row_layout_is_prepared_as_written(tmp_path, system):
    """JustRL's benchmark files (verl's layout: prompt messages, reward_model.ground_truth,
    extra_info.index) give exactly their problems and answers, `$...$` kept as JustRL grades them;
    the preparation's own output as a source gives the same rows again (its instruction is not doubled)."""
    source = _justrl_parquet(tmp_path / "test.parquet", system)
    out = tmp_path / "out"
    assert main(["bench", "--out-dir", str(out), "--benchmarks", "olympiadbench", "--source", f"olympiadbench={source}"]) == 0
    frame = pd.read_parquet(out / "olympiadbench.parquet")
    assert [list(p) for p in frame["prompt"]] == [[{"role": "user", "content": f"{p} {PROMPT_SUFFIX}"}] for p, _ in JUSTRL_ROWS]
    assert [r["ground_truth"] for r in frame["reward_model"]] == [a for _, a in JUSTRL_ROWS]
    assert [e["id"] for e in frame["extra_info"]] == [f"Olympiad-Bench-{i}" for i in range(len(JUSTRL_ROWS))]
    assert list(frame["data_source"]) == ["olympiadbench"] * len(JUSTRL_ROWS)
    again = tmp_path / "again"
    assert main(["bench", "--out-dir", str(again), "--benchmarks", "olympiadbench",
                 "--source", f"olympiadbench={out / 'olympiadbench.parquet'}"]) == 0
    assert _sha(again / "olympiadbench.parquet") == _sha(out / "olympiadbench.parquet")


def test_dollars_are_stripped_from_training_answers_only_which_decides_justrls_verdict(tmp_path):
    """A benchmark answer keeps its `$...$` (JustRL's copy of OlympiadBench writes 265 of its 674 so):
    JustRL's grader then finds `x = 2^{1009}` wrong against `$2^{1009}$`, as JustRL's evaluation does;
    the stripped text would flip it to right. Training answers are stripped (the strict reward
    compares them character for character)."""
    from recipe.stapo.eval import justrl_grader

    source = _justrl_parquet(tmp_path / "test.parquet")
    assert main(["bench", "--out-dir", str(tmp_path), "--benchmarks", "olympiadbench", "--source", f"olympiadbench={source}"]) == 0
    assert main(["train", "--out-dir", str(tmp_path), "--source", str(source)]) == 0
    bench = [r["ground_truth"] for r in pd.read_parquet(tmp_path / "olympiadbench.parquet")["reward_model"]]
    train = [r["ground_truth"] for r in pd.read_parquet(tmp_path / "train.parquet")["reward_model"]]
    assert bench[1:] == ["$2^{1009}$", "$\\angle B E A_{1}=90$,$\\angle A E B_{1}=90$"]
    assert train[1:] == ["2^{1009}", "\\angle B E A_{1}=90$,$\\angle A E B_{1}=90"]
    response = "so \\boxed{x = 2^{1009}}"
    assert justrl_grader.grade_answer(response, bench[1], 5.0).correct is False
    assert justrl_grader.grade_answer(response, train[1], 5.0).correct is True


def test_a_float32_answer_column_is_written_as_its_shortest_digits(tmp_path):
    """A parquet float32 column reaches Python as 0.10000000149011612: written as 0.1, its value as the
    file's author wrote it, at the top level and inside verl's reward_model."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    flat = tmp_path / "flat.parquet"
    pd.DataFrame({"id": ["a", "b"], "problem": ["p", "q"], "answer": np.array([0.1, 2.5], dtype=np.float32)}).to_parquet(flat)
    nested = tmp_path / "nested.parquet"
    schema = pa.schema([("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                        ("reward_model", pa.struct([("ground_truth", pa.float32())]))])
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "r"}]], "reward_model": [{"ground_truth": 0.3}]},
                            schema=schema), nested)
    assert main(["bench", "--out-dir", str(tmp_path), "--benchmarks", "amc23,minerva",
                 "--source", f"amc23={flat}", "--source", f"minerva={nested}"]) == 0
    assert [r["ground_truth"] for r in pd.read_parquet(tmp_path / "amc23.parquet")["reward_model"]] == ["0.1", "2.5"]
    assert [r["ground_truth"] for r in pd.read_parquet(tmp_path / "minerva.parquet")["reward_model"]] == ["0.3"]
    assert prepare.answer_to_text(0.1) == prepare.answer_to_text(np.float64(0.1)) == "0.1"  # a float64 is its own digits
    assert prepare.answer_to_text(0.30000000000000004) == "0.30000000000000004"
