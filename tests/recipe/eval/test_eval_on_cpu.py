"""Evaluation end to end on CPU: a tiny random Qwen3 through the HF backend, resume, grading."""

import json
from pathlib import Path

import pytest

from recipe.stapo.data import prepare
from recipe.stapo.eval import run_eval
from recipe.stapo.eval.backends import GenerationBackend, HFBackend, SamplingConfig
from recipe.stapo.eval.generate import JsonlStore, sample_seed
from recipe.stapo.eval.run_eval import EvalConfig, run_evaluation
from recipe.stapo.eval.protocols import compass_judgement
from recipe.stapo.eval.verifier import AnswerVerifier

from tests.helpers.eval_models import (
    FIXTURES, CountingScripted, ScriptedBackend, answers as _answers, bench_dir as _bench_dir,
    build_tiny_model, fixture_rows as _fixture_rows, scripted_config as _scripted_config,
)

N_SAMPLES = {"aime24": 2, "math500": 1}
LIMIT = 3  # problems per benchmark in the HF runs (generation costs ~0.1 s per sample on CPU)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_assets")
    bench_dir = root / "bench"
    for name in N_SAMPLES:
        prepare.prepare_dataset(prepare.BENCHMARK_SPECS[name], bench_dir / f"{name}.parquet", str(FIXTURES / "bench_sample.jsonl"))
    return {"model": build_tiny_model(root / "model"), "bench": bench_dir}


def _config(assets, out, **overrides):
    values = dict(
        model=str(assets["model"]), benchmarks_dir=str(assets["bench"]), out=str(out), benchmarks=tuple(N_SAMPLES),
        n_samples=dict(N_SAMPLES), max_new_tokens=6, backend="hf", batch_size=2, seed=7, verifier="none",
    )
    values.update(overrides)
    return EvalConfig(**values)


class CountingBackend(GenerationBackend):
    """Wraps a backend and counts the completions it is asked for."""

    def __init__(self, inner):
        self.inner, self.tokenizer, self.calls = inner, inner.tokenizer, 0

    def generate(self, prompts, seeds, sampling):
        self.calls += len(prompts)
        return self.inner.generate(prompts, seeds, sampling)


def _generations(out):
    return {p.name: JsonlStore(p).load() for p in sorted((Path(out) / "generations").glob("*.jsonl"))}


class Interrupt(Exception):
    pass


@pytest.mark.slow
def test_interrupted_run_resumes_to_the_uninterrupted_result(assets, tmp_path):
    total = 2 * sum(n * LIMIT for n in N_SAMPLES.values())  # 2 decodings x LIMIT problems x N
    # uninterrupted, through the CLI
    code = run_eval.main([
        "--model", str(assets["model"]), "--benchmarks-dir", str(assets["bench"]), "--out", str(tmp_path / "a"),
        "--backend", "hf", "--benchmarks", "aime24,math500", "--n-samples", "aime24=2,math500=1", "--limit", str(LIMIT),
        "--max-new-tokens", "6", "--batch-size", "2", "--seed", "7",
    ])
    assert code == 0
    reference = _generations(tmp_path / "a")
    assert sum(len(v) for v in reference.values()) == total

    # interrupted after 3 batches (6 samples), then resumed
    backend = CountingBackend(HFBackend(str(assets["model"])))
    batches = []

    def interrupt(records):
        batches.append(records)
        if len(batches) == 2:
            raise Interrupt

    with pytest.raises(Interrupt):
        run_evaluation(_config(assets, tmp_path / "b", limit=LIMIT), lambda: backend, after_batch=interrupt)
    assert backend.calls == 4
    first = tmp_path / "b" / "generations" / "aime24__train.jsonl"
    with open(first, "a") as handle:  # a crash mid-write leaves a truncated line
        handle.write('{"problem_index": 2, "sample": 0, "resp')
    resumed = CountingBackend(HFBackend(str(assets["model"])))
    summary = run_evaluation(_config(assets, tmp_path / "b", limit=LIMIT), lambda: resumed)
    assert resumed.calls == total - 4  # nothing regenerated
    assert _generations(tmp_path / "b") == reference  # same texts, seeds and order-independent keys
    assert all(line.strip() for line in first.read_text().splitlines())
    assert summary == json.loads((tmp_path / "a" / "summary.json").read_text())

    # a rerun of a complete folder never builds the backend
    def forbidden():
        raise AssertionError("backend must not be built")

    assert run_evaluation(_config(assets, tmp_path / "b", limit=LIMIT), forbidden) == summary
    assert (tmp_path / "b" / "summary.md").read_text().count("|") > 10


class AcceptAll(AnswerVerifier):
    name = "accept-all"

    def __init__(self):
        self.seen = 0

    def verify(self, items):
        self.seen += len(items)
        return [True] * len(items)


def _scripted_expectation(assets, benchmark, decoding, n):
    """mean@N computed independently from the seeds (closed form of ScriptedBackend)."""
    problems = run_eval.load_problems(Path(assets["bench"]) / f"{benchmark}.parquet")
    per_problem = [sum(sample_seed(7, benchmark, decoding, p.problem_id, s) % 3 == 0 for s in range(n)) / n for p in problems]
    return 100.0 * sum(per_problem) / len(per_problem), problems


def test_mean_at_n_and_verifier_on_scripted_samples(assets, tmp_path):
    problems = run_eval.load_problems(Path(assets["bench"]) / "aime24.parquet")
    answers = {p.messages[-1]["content"]: p.ground_truth for p in problems}
    verifier = AcceptAll()
    config = _config(assets, tmp_path, n_samples={"aime24": 6, "math500": 3})
    summary = run_evaluation(config, lambda: ScriptedBackend(answers), verifier=verifier)
    failures = 0
    for decoding in ("train", "justrl"):
        block = summary["decodings"][decoding]
        assert (block["temperature"], block["top_p"]) == run_eval.DECODINGS[decoding]
        for bench, n in (("aime24", 6), ("math500", 3)):
            expected, probs = _scripted_expectation(assets, bench, decoding, n)
            got = block["benchmarks"][bench]
            assert got["grader_mean_at_n"] == pytest.approx(expected, abs=1e-9)
            assert got["mean_at_n"] == pytest.approx(100.0)  # the verifier accepts every rule failure
            failures += round((100.0 - expected) / 100.0 * len(probs) * n)
        assert block["avg"] == pytest.approx(100.0)
    assert verifier.seen == failures  # only rule-based failures reach the verifier
    again = AcceptAll()
    run_evaluation(config, lambda: ScriptedBackend(answers), verifier=again)
    assert again.seen == 0  # verdicts are cached on disk


def test_changed_model_in_same_out_is_refused(assets, tmp_path):
    problems = run_eval.load_problems(Path(assets["bench"]) / "aime24.parquet")
    answers = {p.messages[-1]["content"]: p.ground_truth for p in problems}
    run_evaluation(_config(assets, tmp_path, benchmarks=("aime24",)), lambda: ScriptedBackend(answers))
    with pytest.raises(ValueError, match="model="):
        run_evaluation(_config(assets, tmp_path, benchmarks=("aime24",), model="other"), lambda: ScriptedBackend(answers))


def test_bad_settings_are_named(assets, tmp_path):
    with pytest.raises(ValueError, match="--decoding"):
        _config(assets, tmp_path, decodings=("greedy",)).validate()
    with pytest.raises(ValueError, match="--benchmarks"):
        _config(assets, tmp_path, benchmarks=("../gsm8k",)).validate()
    with pytest.raises(ValueError, match="math500"):
        _config(assets, tmp_path, n_samples={"aime24": 1, "math500": 0}).validate()
    with pytest.raises(FileNotFoundError, match="prepare bench"):
        run_eval.load_problems(tmp_path / "aime24.parquet")
    with pytest.raises(FileNotFoundError, match=r"outside the paper's six .* <benchmarks-dir>/<name>\.parquet"):
        run_eval.load_problems(tmp_path / "gsm8k.parquet")
    with pytest.raises(ValueError, match="--n-samples"):
        run_eval.parse_n_samples("aime 99=3", ["aime24"])
    assert run_eval.parse_n_samples("5", ["aime24"]) == {"aime24": 5}
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(0.0, 1.0, 10)


def test_jsonl_store_repairs_only_the_last_line(tmp_path):
    store = JsonlStore(tmp_path / "g.jsonl")
    store.append([{"problem_index": 0, "sample": s, "response": str(s)} for s in range(3)])
    with open(store.path, "a") as handle:
        handle.write('{"problem_index": 0, "sample": 3, "respo')
    assert sorted(store.load()) == [(0, 0), (0, 1), (0, 2)]
    store.append([{"problem_index": 0, "sample": 3, "response": "3"}])
    assert sorted(store.load()) == [(0, s) for s in range(4)]
    lines = store.path.read_text().splitlines()
    store.path.write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="line 2"):
        store.load()


def test_compass_judgement_follows_the_authors_parsing():
    # reference: the rules of CompassVerifier's README for boxed and bare letters, the prompts'
    # output format for the rest (docs/eval.md), applied by hand to each output
    cases = {
        "A": "A", "B": "B", "C": "C",                       # the whole output is the letter
        "\\boxed{A} - CORRECT": "A",                        # a boxed letter wins
        "Analysis... \\boxed{B} then \\boxed{A}": "A",      # the last boxed letter
        "Final Judgment: (B)": "B",                          # a (X) letter after "Final Judgment:"
        "A\n": "A",                                          # the letter with whitespace around it
        "CORRECT": "A",                                      # CV_PROMPT's label word (the README reads its C)
        "correct": "", "": "", "maybe": "",                 # nothing readable
    }
    for text, label in cases.items():
        assert compass_judgement(text) == label, text


# ----------------------------------------------------------------------------------------------
# resume identity: saved samples belong to problems by (id, prompt hash), never by row position
# ----------------------------------------------------------------------------------------------
def _file_bytes(out):
    return {p.relative_to(out): p.read_bytes() for p in sorted(Path(out).rglob("*.jsonl"))}


def test_resume_on_reordered_data_matches_samples_by_problem_not_row(tmp_path):
    rows = _fixture_rows()
    forward = _bench_dir(tmp_path / "forward", rows)
    reverse = _bench_dir(tmp_path / "reverse", rows[::-1])
    answers = _answers(forward)
    run_evaluation(_scripted_config(forward, tmp_path / "out"), lambda: ScriptedBackend(answers))
    saved = _file_bytes(tmp_path / "out")
    resumed_backend = CountingScripted(answers)
    resumed = run_evaluation(_scripted_config(reverse, tmp_path / "out"), lambda: resumed_backend)
    fresh = run_evaluation(_scripted_config(reverse, tmp_path / "fresh"), lambda: ScriptedBackend(answers))
    assert resumed_backend.calls == 0  # every saved sample is reused
    assert _file_bytes(tmp_path / "out") == saved  # and nothing on disk was touched
    assert resumed == fresh
    # the closed form (ScriptedBackend is right exactly when seed % 3 == 0; seeds follow the problem id)
    problems = run_eval.load_problems(reverse / "aime24.parquet")
    expected = 100.0 * sum(sum(sample_seed(7, "aime24", "train", p.problem_id, s) % 3 == 0 for s in range(6)) / 6 for p in problems) / len(problems)
    assert resumed["decodings"]["train"]["benchmarks"]["aime24"]["grader_mean_at_n"] == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("change", ["edited_prompt", "other_problem"])
def test_resume_on_different_problems_is_refused_and_keeps_the_samples(tmp_path, change):
    rows = _fixture_rows()
    original = _bench_dir(tmp_path / "original", rows)
    changed_rows = [dict(r) for r in rows]
    if change == "edited_prompt":
        changed_rows[2]["problem"] = "Simplify $\\frac{6}{9}$."  # same id b3, another problem
        culprit = "b3"
    else:
        changed_rows[1] = {"id": "x9", "problem": "What is $2+2$?", "answer": "4"}  # b2 gone, x9 new
        culprit = "b2"
    changed = _bench_dir(tmp_path / "changed", changed_rows)
    run_evaluation(_scripted_config(original, tmp_path / "out"), lambda: ScriptedBackend(_answers(original)))
    saved = _file_bytes(tmp_path / "out")
    summary_before = (tmp_path / "out" / "summary.json").read_bytes()
    backend = CountingScripted(_answers(changed))
    with pytest.raises(ValueError) as info:
        run_evaluation(_scripted_config(changed, tmp_path / "out"), lambda: backend)
    message = str(info.value)
    assert "aime24" in message and repr(culprit) in message and "--out" in message
    assert backend.calls == 0
    assert _file_bytes(tmp_path / "out") == saved
    assert (tmp_path / "out" / "summary.json").read_bytes() == summary_before


def test_old_format_samples_without_identity_are_refused(tmp_path):
    bench = _bench_dir(tmp_path / "bench", _fixture_rows())
    problems = run_eval.load_problems(bench / "aime24.parquet")
    old = JsonlStore(tmp_path / "out" / "generations" / "aime24__train.jsonl")
    old.append([  # what the previous version wrote: no hash of the problem
        {"problem_index": p.index, "problem_id": p.problem_id, "sample": 0, "seed": sample_seed(7, "aime24", "train", p.problem_id, 0),
         "response": "\\boxed{1}", "num_tokens": 3, "finish_reason": "stop"}
        for p in problems
    ])
    before = old.path.read_bytes()
    backend = CountingScripted(_answers(bench))
    with pytest.raises(ValueError, match=r"aime24__train\.jsonl.*new --out"):
        run_evaluation(_scripted_config(bench, tmp_path / "out"), lambda: backend)
    assert backend.calls == 0 and old.path.read_bytes() == before


def test_resume_with_added_problems_generates_only_the_new_ones(tmp_path):
    rows = _fixture_rows()
    small = _bench_dir(tmp_path / "small", rows[:3])
    full = _bench_dir(tmp_path / "full", rows[::-1])  # two more problems, and another order
    answers = _answers(full)
    run_evaluation(_scripted_config(small, tmp_path / "out"), lambda: ScriptedBackend(answers))
    backend = CountingScripted(answers)
    resumed = run_evaluation(_scripted_config(full, tmp_path / "out"), lambda: backend)
    assert backend.calls == 2 * 6
    assert resumed == run_evaluation(_scripted_config(full, tmp_path / "fresh"), lambda: ScriptedBackend(answers))


def test_smaller_limit_in_the_same_out_reuses_samples(tmp_path):
    bench = _bench_dir(tmp_path / "bench", _fixture_rows())
    answers = _answers(bench)
    run_evaluation(_scripted_config(bench, tmp_path / "out"), lambda: ScriptedBackend(answers))
    backend = CountingScripted(answers)
    limited = run_evaluation(_scripted_config(bench, tmp_path / "out", limit=2), lambda: backend)
    assert backend.calls == 0
    assert limited == run_evaluation(_scripted_config(bench, tmp_path / "fresh", limit=2), lambda: ScriptedBackend(answers))


class AcceptIfGold(AnswerVerifier):
    """Accepts every response to a problem whose reference answer is ``gold``; counts its calls."""

    name = "accept-if-gold"

    def __init__(self, gold):
        self.gold, self.seen = gold, 0

    def verify(self, items):
        self.seen += len(items)
        return [item.gold_answer == self.gold for item in items]


def test_verifier_cache_follows_the_problem_and_its_answer(tmp_path):
    rows = _fixture_rows()
    original = _bench_dir(tmp_path / "original", rows)
    fixed = [dict(r) for r in rows][::-1]
    fixed[-2]["answer"] = "8"  # b2's reference answer corrected (same prompt), and the rows reversed
    fixed_dir = _bench_dir(tmp_path / "fixed", fixed)
    answers = _answers(original)
    run_evaluation(_scripted_config(original, tmp_path / "out"), lambda: ScriptedBackend(answers), verifier=AcceptIfGold("7"))
    again = AcceptIfGold("7")
    resumed = run_evaluation(_scripted_config(fixed_dir, tmp_path / "out"), lambda: ScriptedBackend(answers), verifier=again)
    fresh = run_evaluation(_scripted_config(fixed_dir, tmp_path / "fresh"), lambda: ScriptedBackend(answers), verifier=AcceptIfGold("7"))
    assert resumed == fresh
    # only b2's samples are judged again (all 6 fail the rule now: the scripted answer is the old "7")
    assert again.seen == 6


def test_run_config_records_the_benchmark_data(tmp_path):
    import hashlib

    bench = _bench_dir(tmp_path / "bench", _fixture_rows(), manifest=True)
    run_evaluation(_scripted_config(bench, tmp_path / "out"), lambda: ScriptedBackend(_answers(bench)))
    stored = json.loads((tmp_path / "out" / "run_config.json").read_text())
    assert stored["data"]["aime24"]["sha256"] == hashlib.sha256((bench / "aime24.parquet").read_bytes()).hexdigest()
    assert stored["data"]["aime24"]["problems"] == 5
    assert stored["data_manifest_sha256"] == hashlib.sha256((bench / "manifest.json").read_bytes()).hexdigest()


def test_old_format_verdicts_are_refused_before_any_generation(tmp_path):
    bench = _bench_dir(tmp_path / "bench", _fixture_rows())
    old = JsonlStore(tmp_path / "out" / "verifier" / "aime24__train.jsonl")
    old.append([{"problem_index": 0, "sample": 0, "verifier_correct": True}])  # no identity: previous version
    backend = CountingScripted(_answers(bench))
    with pytest.raises(ValueError, match=r"verifier/aime24__train\.jsonl.*new --out"):
        run_evaluation(_scripted_config(bench, tmp_path / "out"), lambda: backend, verifier=AcceptAll())
    assert backend.calls == 0


def test_repeated_problem_id_in_a_benchmark_file_is_named(tmp_path):
    import pandas as pd

    bench = _bench_dir(tmp_path / "bench", _fixture_rows())
    frame = pd.read_parquet(bench / "aime24.parquet")
    frame.at[3, "extra_info"] = dict(frame.at[3, "extra_info"], id="b2")  # row 3 claims row 1's id
    frame.to_parquet(bench / "aime24.parquet", index=False)
    with pytest.raises(ValueError, match=r"aime24\.parquet: rows 1 and 3 .*'b2'"):
        run_eval.load_problems(bench / "aime24.parquet")


def test_a_row_with_an_empty_prompt_is_named(tmp_path):
    import pandas as pd

    bench = _bench_dir(tmp_path / "bench", _fixture_rows())
    frame = pd.read_parquet(bench / "aime24.parquet")
    frame.at[2, "prompt"] = []
    frame.to_parquet(bench / "aime24.parquet", index=False)
    with pytest.raises(ValueError, match=r"aime24\.parquet: row 2: empty prompt"):
        run_eval.load_problems(bench / "aime24.parquet")


def test_a_benchmark_file_without_rows_is_named_as_empty(tmp_path):
    import pandas as pd

    bench = _bench_dir(tmp_path / "bench", _fixture_rows(), names=("aime24", "amc23"))
    pd.DataFrame([]).to_parquet(bench / "aime24.parquet", index=False)  # no columns either
    frame = pd.read_parquet(bench / "amc23.parquet")
    frame.iloc[:0].to_parquet(bench / "amc23.parquet", index=False)  # the columns, no rows
    for name in ("aime24", "amc23"):
        with pytest.raises(ValueError, match=rf"{name}\.parquet: no problems \(0 rows\)"):
            run_eval.load_problems(bench / f"{name}.parquet")


# ----------------------------------------------------------------------------------------------
# the prompt form: samples generated from the old evaluation prompt are never mixed with new ones
# ----------------------------------------------------------------------------------------------
def _bench_of_form(root, form):
    source = root / "source.jsonl"
    root.mkdir(parents=True)
    source.write_text("".join(json.dumps(r) + "\n" for r in _fixture_rows()))
    prepare.prepare_dataset(prepare.BENCHMARK_SPECS["aime24"], root / "aime24.parquet", str(source), form=form)
    return root


def test_samples_of_the_old_prompt_form_are_refused_not_mixed_into_a_new_evaluation(tmp_path):
    """A folder evaluated on benchmark data prepared with the old form (problem + "\\n\\n" +
    instruction), resumed on data prepared now (JustRL's problem + " " + instruction): refused before
    anything is generated or graded, naming the form; a new folder evaluates the new form."""
    old, new = _bench_of_form(tmp_path / "old", "train"), _bench_of_form(tmp_path / "new", "justrl-eval")
    out = tmp_path / "out"
    first = run_evaluation(_scripted_config(old, out), lambda: ScriptedBackend(_answers(old)))
    assert first["prompt_form"] == "train"
    saved = _file_bytes(out)
    backend = CountingScripted(_answers(new))
    with pytest.raises(ValueError, match=r"problem 'b\d' .* prompt form 'train' .* the data now has 'justrl-eval': "
                                         r"samples of two prompt forms are never mixed"):
        run_evaluation(_scripted_config(new, out), lambda: backend)
    assert backend.calls == 0 and _file_bytes(out) == saved
    fresh = run_evaluation(_scripted_config(new, tmp_path / "fresh"), lambda: ScriptedBackend(_answers(new)))
    assert fresh["prompt_form"] == "justrl-eval"
    assert fresh["decodings"]["train"]["benchmarks"]["aime24"]["prompt_form"] == "justrl-eval"
    assert "Prompt form: justrl-eval" in (tmp_path / "fresh" / "summary.md").read_text()
