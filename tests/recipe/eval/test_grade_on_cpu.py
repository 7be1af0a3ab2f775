"""Evaluation grading: the verifier path (CompassVerifier's prompt and input, a tiny local judge),
cached verdicts and grades keyed by everything that decides them, summaries that accumulate
across invocations, and bad inputs refused before anything is written."""

import json
import re
from pathlib import Path

import pytest

from recipe.stapo.eval import grade, model_source, parallel, run_eval, verifier as verifier_mod
from recipe.stapo.eval.summary import grading_info
from recipe.stapo.eval.backends import HFBackend, render_chat
from recipe.stapo.eval.generate import JsonlStore, sample_seed
from recipe.stapo.eval.protocols import PROTOCOLS
from recipe.stapo.eval.run_eval import run_evaluation
from recipe.stapo.eval.verifier import AnswerVerifier, CompassVerifier, VerifyItem, load_verifier_prompt

from tests.helpers.eval_models import (
    CountingScripted, ScriptedBackend, answers, bench_dir, build_judge_model, fixture_rows, scripted_config,
)

# a template in CompassVerifier's format (str.format placeholders, doubled literal braces); not the
# official text, which the project does not ship
TEMPLATE = (
    "Judge the candidate against the standard answer; ignore \\\\boxed{{}}.\n"
    "<Original Question Begin>:\n{question}\n<Original Question End>\n"
    "<Standard Answer Begin>:\n{gold_answer}\n<Standard Answer End>\n"
    "<Candidate's Answer Begin>: \n{llm_response}\n<Candidate's Answer End>\n"
)
PAD = "Let me think step by step about it. " * 150  # responses of ~5,500 characters


def _prompts_py(path: Path, template: str = TEMPLATE, name: str = "CV_PROMPT") -> Path:
    """A prompts.py laid out like CompassVerifier's (a module-level string literal)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{name} = {template!r}\n\nOTHER = 'x'\n")
    return path


@pytest.fixture(scope="module")
def judges(tmp_path_factory):
    root = tmp_path_factory.mktemp("judges")
    return {letter: build_judge_model(root / letter, letter) for letter in "AB"}


@pytest.fixture()
def bench(tmp_path):
    return bench_dir(tmp_path / "bench", fixture_rows())


class RecordingBackend:
    """Wraps a judge backend and records the prompts it is asked to complete."""

    def __init__(self, inner):
        self.inner, self.tokenizer, self.prompts = inner, inner.tokenizer, []

    def greedy(self, prompts, max_new_tokens):
        self.prompts += list(prompts)
        return self.inner.greedy(prompts, max_new_tokens)

    def context_length(self):
        return self.inner.context_length()


def _compass(judge_dir, prompt_file, **kwargs):
    return CompassVerifier(RecordingBackend(HFBackend(str(judge_dir))), load_verifier_prompt(prompt_file), str(judge_dir), **kwargs)


def _rule_failures(bench, n=6, decoding="train"):
    """Samples ScriptedBackend gets wrong (seed % 3 != 0): what reaches the verifier."""
    problems = run_eval.load_problems(bench / "aime24.parquet")
    return {(p.index, s) for p in problems for s in range(n) if sample_seed(7, "aime24", decoding, p.problem_id, s) % 3}


def _verdicts(out, decoding="train"):
    return [r for _, r in JsonlStore(Path(out) / "verifier" / f"aime24__{decoding}.jsonl").read()]


# ----------------------------------------------------------------------------------------------
# the verifier path: CompassVerifier's format, the whole response, greedy, its parser
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["justrl", "compassverifier"])
def test_verifier_gets_the_whole_response_in_compassverifiers_format(bench, judges, tmp_path, protocol):
    prompt_file = _prompts_py(tmp_path / "cv" / "prompts.py")
    judge = _compass(judges["A"], prompt_file, protocol=PROTOCOLS[protocol])
    config = scripted_config(bench, tmp_path / "out", grading_protocol=protocol)
    summary = run_evaluation(config, lambda: ScriptedBackend(answers(bench), PAD), verifier=judge)
    failures = _rule_failures(bench)
    assert len(judge.backend.prompts) == len(failures) > 0
    # the expected prompts, built independently: the template filled by str.format with the
    # protocol's question (JustRL: empty; the README: the problem without the policy's instruction),
    # the reference answer and the WHOLE response, sent as one user turn of the chat template
    problems = {p.index: p for p in run_eval.load_problems(bench / "aime24.parquet")}
    records = JsonlStore(tmp_path / "out" / "generations" / "aime24__train.jsonl").load()
    expected = []
    for index, sample in sorted(failures):
        problem, response = problems[index], records[index, sample]["response"]
        assert len(response) > 5000
        user = problem.messages[-1]["content"]
        assert user.endswith(" Please reason step by step, and put your final answer within \\boxed{}.")  # JustRL's eval form
        question = "" if protocol == "justrl" else user[: user.rindex(" Please reason step by step")]
        content = TEMPLATE.format(question=question, gold_answer=problem.ground_truth, llm_response=response)
        expected.append(render_chat(judge.backend.tokenizer, [{"role": "user", "content": content}]))
    assert judge.backend.prompts == expected
    # the judge answers "A" to everything: every rule failure becomes correct
    block = summary["decodings"]["train"]["benchmarks"]["aime24"]
    assert block["mean_at_n"] == pytest.approx(100.0) and block["grader_mean_at_n"] < 100.0
    assert block["verifier_judged"] == block["verifier_accepted"] == len(failures)
    cached = _verdicts(tmp_path / "out")
    assert {(r["judgement"], r["output"], r["response_chars_dropped"]) for r in cached} == {("A", "A", 0)}
    assert summary["grading"]["protocol"] == protocol and protocol in summary["grading"]["description"]
    assert judge.identity()["question"] == ("empty" if protocol == "justrl" else "problem")


def test_the_configured_compass_verifier_runs_the_same_path(bench, judges, tmp_path):
    """--verifier compass with --verifier-model/--verifier-prompt-file builds the CompassVerifier
    above on the transformers backend: same verdicts as the object built by hand."""
    prompt_file = _prompts_py(tmp_path / "cv" / "prompts.py")
    by_hand = run_evaluation(scripted_config(bench, tmp_path / "a"), lambda: ScriptedBackend(answers(bench)),
                             verifier=_compass(judges["B"], prompt_file))
    configured = run_evaluation(
        scripted_config(bench, tmp_path / "b", verifier="compass", verifier_model=str(judges["B"]),
                        verifier_prompt_file=str(prompt_file)),
        lambda: ScriptedBackend(answers(bench)),
    )
    assert configured == by_hand
    block = configured["decodings"]["train"]["benchmarks"]["aime24"]
    assert block["mean_at_n"] == block["grader_mean_at_n"]  # "B" accepts nothing
    assert configured["grading"]["label"] == "rule+verifier"
    assert configured["grading"]["verifier"]["model"] == str(judges["B"])
    assert _verdicts(tmp_path / "a") == _verdicts(tmp_path / "b")


def test_a_prompt_longer_than_the_judges_context_keeps_the_end_of_the_response(tmp_path):
    judge_dir = build_judge_model(tmp_path / "short", "A", positions=256)
    judge = _compass(judge_dir, _prompts_py(tmp_path / "prompts.py"))
    item = VerifyItem("What is 1+1?", "2", PAD + "so the answer is \\boxed{2}")
    prompt, dropped = judge.fitted_prompt(item)
    tokens = len(judge.backend.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert 0 < dropped < len(item.response)
    assert tokens <= 256 - verifier_mod.CONTEXT_RESERVE_TOKENS
    assert prompt == judge.build_prompt(item, item.response[dropped:])  # the end of the response, kept whole
    (verdict,) = judge.verify([item])
    assert verdict.correct and verdict.response_chars_dropped == dropped


# ----------------------------------------------------------------------------------------------
# cache identity: every cached verdict and grade is keyed by what decides it
# ----------------------------------------------------------------------------------------------
def _judged(bench, out, verifier):
    run_evaluation(scripted_config(bench, out), lambda: ScriptedBackend(answers(bench)), verifier=verifier)
    return len(verifier.backend.prompts)


def test_another_verifier_model_judges_again(bench, judges, tmp_path):
    prompt_file = _prompts_py(tmp_path / "prompts.py")
    out = tmp_path / "out"
    failures = len(_rule_failures(bench))
    assert _judged(bench, out, _compass(judges["A"], prompt_file)) == failures
    second = _compass(judges["B"], prompt_file)
    summary = run_evaluation(scripted_config(bench, out), lambda: ScriptedBackend(answers(bench)), verifier=second)
    assert len(second.backend.prompts) == failures  # nothing reused from judge A
    block = summary["decodings"]["train"]["benchmarks"]["aime24"]
    assert block["mean_at_n"] == block["grader_mean_at_n"]  # judge B's verdicts, not A's
    assert summary["grading"]["verifier"]["model"] == str(judges["B"])
    assert _judged(bench, out, _compass(judges["A"], prompt_file)) == 0  # A's verdicts are still cached
    assert _judged(bench, out, _compass(judges["B"], prompt_file)) == 0


def test_another_prompt_text_judges_again(bench, judges, tmp_path):
    out = tmp_path / "out"
    first = _prompts_py(tmp_path / "one" / "prompts.py")
    second = _prompts_py(tmp_path / "two" / "prompts.py", TEMPLATE.replace("Judge", "Grade"))
    assert _judged(bench, out, _compass(judges["A"], first)) > 0
    assert _judged(bench, out, _compass(judges["A"], second)) == len(_rule_failures(bench))
    assert _judged(bench, out, _compass(judges["A"], tmp_path / "one" / "prompts.py")) == 0
    # the same text from another file is the same prompt
    copy = tmp_path / "copy.txt"
    copy.write_text(TEMPLATE)
    assert _judged(bench, out, _compass(judges["A"], copy)) == 0


def test_other_judgement_settings_judge_again(bench, judges, tmp_path):
    out = tmp_path / "out"
    prompt_file = _prompts_py(tmp_path / "prompts.py")
    assert _judged(bench, out, _compass(judges["A"], prompt_file)) > 0
    assert _judged(bench, out, _compass(judges["A"], prompt_file, max_new_tokens=16)) == len(_rule_failures(bench))


class AcceptAll(AnswerVerifier):
    name = "accept-all"

    def __init__(self):
        self.seen = 0

    def verify(self, items):
        self.seen += len(items)
        return [True] * len(items)


class RejectAll(AcceptAll):
    name = "reject-all"

    def verify(self, items):
        self.seen += len(items)
        return [False] * len(items)


def test_another_verifier_object_judges_again_and_the_summary_names_it(bench, tmp_path):
    out = tmp_path / "out"
    run_evaluation(scripted_config(bench, out), lambda: ScriptedBackend(answers(bench)), verifier=AcceptAll())
    reject = RejectAll()
    summary = run_evaluation(scripted_config(bench, out), lambda: ScriptedBackend(answers(bench)), verifier=reject)
    assert reject.seen == len(_rule_failures(bench))
    block = summary["decodings"]["train"]["benchmarks"]["aime24"]
    assert block["mean_at_n"] == block["grader_mean_at_n"]
    assert summary["verifier"] == "reject-all" and summary["grading"]["verifier"]["name"] == "reject-all"


@pytest.mark.parametrize("protocol, function", [("justrl", "justrl_grade_answer"), ("compassverifier", "lenient_grade_answer")])
def test_grades_are_cached_and_keyed_by_the_grader(bench, tmp_path, monkeypatch, protocol, function):
    calls = []
    real = getattr(grade, function)
    monkeypatch.setattr(grade, function, lambda *a: calls.append(a) or real(*a))
    out = tmp_path / "out"
    config = lambda **kw: scripted_config(bench, out, grading_protocol=protocol, **kw)  # noqa: E731
    first = run_evaluation(config(), lambda: ScriptedBackend(answers(bench)))
    assert len(calls) == 5 * 6
    calls.clear()
    assert run_evaluation(config(), lambda: ScriptedBackend(answers(bench))) == first
    assert calls == []  # every grade cached
    # another time limit per answer: graded again
    timed = run_evaluation(config(reward_timeout_s=2.0), lambda: ScriptedBackend(answers(bench)))
    assert len(calls) == 30 and timed["grading"]["grader"]["timeout_s"] == 2.0
    calls.clear()
    # another version of the rule's code: graded again
    monkeypatch.setattr(grade, "_grader_source_sha256", lambda grader: "0" * 64)
    again = run_evaluation(config(), lambda: ScriptedBackend(answers(bench)))
    assert len(calls) == 30 and again["grading"]["grader"]["code_sha256"] == "0" * 64
    assert again["decodings"] == first["decodings"]
    assert first["grading"]["grader"]["grader"] == PROTOCOLS[protocol].grader


def test_an_edited_response_is_graded_and_judged_again(bench, tmp_path, monkeypatch):
    out = tmp_path / "out"
    run_evaluation(scripted_config(bench, out), lambda: ScriptedBackend(answers(bench)), verifier=RejectAll())
    path = out / "generations" / "aime24__train.jsonl"
    lines = path.read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if "boxed{-1}" in line)  # a rule failure
    record = json.loads(lines[index])
    truth = {p.problem_id: p.ground_truth for p in run_eval.load_problems(bench / "aime24.parquet")}[record["problem_id"]]
    record["response"] = f"so \\boxed{{{truth}}}"
    lines[index] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    calls = []
    real = grade.justrl_grade_answer  # the default protocol's rule
    monkeypatch.setattr(grade, "justrl_grade_answer", lambda *a: calls.append(a) or real(*a))
    judge = RejectAll()
    summary = run_evaluation(scripted_config(bench, out), lambda: ScriptedBackend(answers(bench)), verifier=judge)
    assert [a[0] for a in calls] == [record["response"]]  # only the edited sample is graded again
    assert judge.seen == 0  # and it passes the rule now, so the verifier has nothing new to judge
    expected = len(_rule_failures(bench)) - 1
    assert summary["decodings"]["train"]["benchmarks"]["aime24"]["verifier_judged"] == expected


def test_grader_identity_hashes_the_grader_code(tmp_path, monkeypatch):
    import hashlib

    import recipe.stapo.reward as reward

    digest = hashlib.sha256()
    for path in sorted(Path(reward.__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    identity = grade.grader_identity(5.0)
    assert identity["code_sha256"] == digest.hexdigest() and identity["timeout_s"] == 5.0


# ----------------------------------------------------------------------------------------------
# the paper's grading by default, its prompt, checked before any generation
# ----------------------------------------------------------------------------------------------
def test_default_grading_is_the_verifiers_and_needs_its_prompt(bench, tmp_path, hub):
    _cache(hub, verifier_mod.DEFAULT_COMPASS_MODEL)
    backend = CountingScripted(answers(bench))
    config = scripted_config(bench, tmp_path / "out", verifier="auto")
    with pytest.raises(ValueError, match=r"fetch-prompt.*--verifier none"):
        run_evaluation(config, lambda: backend)
    assert backend.calls == 0 and not (tmp_path / "out").exists()
    # the prompt where the benchmarks are: found, and the verifier is CompassVerifier-3B by default
    _prompts_py(bench / "compassverifier" / "prompts.py")
    plan = run_eval.plan_run(config, injected_backend=True)
    assert plan.verifier_name == "compass" and plan.prompt.template == TEMPLATE
    # a --limit smoke test is rule-only (no table takes it)
    assert scripted_config(bench, tmp_path / "out", verifier="auto", limit=2).verifier_name() == "none"


@pytest.mark.parametrize("template, message", [
    (TEMPLATE.replace("\\\\boxed{{}}", "$\\frac{1}{2}$"), r"unknown field.*\{1\}.*doubled"),
    (TEMPLATE.replace("{llm_response}", "{response}"), r"lacks \['\{llm_response\}'\]"),
    (TEMPLATE + "{", r"cannot be used.*doubled"),
])
def test_a_bad_prompt_is_refused_before_any_generation(bench, tmp_path, template, message):
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text(template)
    backend = CountingScripted(answers(bench))
    config = scripted_config(bench, tmp_path / "out", verifier="compass", verifier_prompt_file=str(prompt_file))
    with pytest.raises(ValueError, match=message) as info:
        run_evaluation(config, lambda: backend)
    assert str(prompt_file) in str(info.value)
    assert backend.calls == 0 and not (tmp_path / "out").exists()


def test_official_prompt_is_recognised_by_its_hash(tmp_path, monkeypatch):
    custom = load_verifier_prompt(_prompts_py(tmp_path / "prompts.py"))
    assert custom.official is None and "custom prompt" in custom.label()
    monkeypatch.setitem(verifier_mod.OFFICIAL_PROMPT_SHA256, "CV_PROMPT", custom.sha256)
    official = load_verifier_prompt(tmp_path / "prompts.py")
    assert official.official == "CV_PROMPT" and verifier_mod.OFFICIAL_COMMIT[:7] in official.label()
    info = grading_info(CompassVerifier(None, official, "opencompass/CompassVerifier-3B"), 5.0)
    assert info["paper"] and info["label"] == "rule+verifier"
    assert not grading_info(CompassVerifier(None, custom, "opencompass/CompassVerifier-3B"), 5.0)["paper"]
    assert not grading_info(None, 5.0)["paper"] and grading_info(None, 5.0)["label"] == "rule-only"


def test_fetch_prompt_refuses_a_file_that_is_not_the_official_one(tmp_path):
    source = _prompts_py(tmp_path / "prompts.py")
    with pytest.raises(ValueError, match="not the official"):
        verifier_mod.fetch_prompt(tmp_path / "out" / "prompts.py", str(source))
    assert not (tmp_path / "out" / "prompts.py").exists()
    assert verifier_mod.main(["check-prompt", str(source)]) == 0


# ----------------------------------------------------------------------------------------------
# summary.json accumulates decodings and benchmarks
# ----------------------------------------------------------------------------------------------
def test_summary_accumulates_decodings_and_benchmarks(tmp_path):
    bench = bench_dir(tmp_path / "bench", fixture_rows(), names=("aime24", "math500"))
    answer = answers(bench)
    both = dict(benchmarks=("aime24", "math500"), n_samples={"aime24": 6, "math500": 2})
    one_shot = run_evaluation(scripted_config(bench, tmp_path / "all", decodings=("train", "justrl"), **both),
                              lambda: ScriptedBackend(answer))
    out = tmp_path / "out"
    run_evaluation(scripted_config(bench, out, decodings=("train",), **both), lambda: ScriptedBackend(answer))
    backend = CountingScripted(answer)
    second = run_evaluation(
        scripted_config(bench, out, decodings=("justrl",), benchmarks=("aime24",), n_samples={"aime24": 6}),
        lambda: backend,
    )
    assert backend.calls == 5 * 6  # only justrl/aime24 was generated
    assert set(second["decodings"]) == {"train", "justrl"}
    assert second["decodings"]["train"] == one_shot["decodings"]["train"]
    assert second["decodings"]["justrl"]["benchmarks"]["aime24"] == one_shot["decodings"]["justrl"]["benchmarks"]["aime24"]
    assert "math500" not in second["decodings"]["justrl"]["benchmarks"]
    third = run_evaluation(
        scripted_config(bench, out, decodings=("justrl",), benchmarks=("math500",), n_samples={"math500": 2}),
        lambda: ScriptedBackend(answer),
    )
    assert third == one_shot
    assert json.loads((out / "summary.json").read_text()) == one_shot
    recorded = json.loads((out / "run_config.json").read_text())["evaluated"]
    assert recorded == {"train": {"aime24": {"n_samples": 6, "limit": None}, "math500": {"n_samples": 2, "limit": None}},
                        "justrl": {"aime24": {"n_samples": 6, "limit": None}, "math500": {"n_samples": 2, "limit": None}}}


def test_a_later_verifier_grades_the_earlier_decodings_too(bench, tmp_path):
    out = tmp_path / "out"
    run_evaluation(scripted_config(bench, out, decodings=("train",)), lambda: ScriptedBackend(answers(bench)))
    accept = AcceptAll()
    summary = run_evaluation(scripted_config(bench, out, decodings=("justrl",)), lambda: ScriptedBackend(answers(bench)),
                             verifier=accept)
    assert accept.seen == len(_rule_failures(bench)) + len(_rule_failures(bench, decoding="justrl"))
    for decoding in ("train", "justrl"):
        assert summary["decodings"][decoding]["benchmarks"]["aime24"]["mean_at_n"] == pytest.approx(100.0)
    assert summary["grading"]["label"] == "rule+verifier"


# ----------------------------------------------------------------------------------------------
# bad inputs: named, with what to do, before anything is written
# ----------------------------------------------------------------------------------------------
def _cli(bench, out, *extra):
    return run_eval.main(["--model", "scripted", "--benchmarks-dir", str(bench), "--out", str(out), "--backend", "hf",
                          "--benchmarks", "aime24", "--decoding", "train", "--verifier", "none", *extra])


def test_corrupt_run_config_is_named_with_what_to_do(bench, tmp_path, capsys):
    out = tmp_path / "out"
    run_evaluation(scripted_config(bench, out), lambda: ScriptedBackend(answers(bench)))
    (out / "run_config.json").write_text('{"model": "scripted", "max_new')
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"run_config\.json is not valid JSON .*new --out"):
        run_evaluation(scripted_config(bench, out), lambda: ScriptedBackend(answers(bench)))
    assert _cli(bench, out) == 2
    err = capsys.readouterr().err
    assert "run_config.json is not valid JSON" in err and "Traceback" not in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_out_that_is_a_file_is_named(bench, tmp_path, capsys):
    target = tmp_path / "results.txt"
    target.write_text("keep me")
    assert _cli(bench, target) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert _cli(bench, target / "sub") == 2
    assert "cannot be created" in capsys.readouterr().err and target.read_text() == "keep me"


@pytest.mark.parametrize("edit, field", [
    (lambda r: r.pop("finish_reason"), "finish_reason"),
    (lambda r: r.update(num_tokens="5"), "num_tokens"),
    (lambda r: r.pop("response"), "response"),
])
def test_a_record_missing_a_field_is_named_then_regenerated_once_deleted(bench, tmp_path, edit, field):
    out = tmp_path / "out"
    reference = run_evaluation(scripted_config(bench, out), lambda: ScriptedBackend(answers(bench)))
    path = out / "generations" / "aime24__train.jsonl"
    lines = path.read_text().splitlines()
    record = json.loads(lines[3])
    edit(record)
    path.write_text("\n".join(lines[:3] + [json.dumps(record)] + lines[4:]) + "\n")
    backend = CountingScripted(answers(bench))
    with pytest.raises(ValueError, match=rf"aime24__train\.jsonl: line 4: .*'{field}'.*Delete that line"):
        run_evaluation(scripted_config(bench, out), lambda: backend)
    assert backend.calls == 0
    path.write_text("\n".join(lines[:3] + lines[4:]) + "\n")
    assert run_evaluation(scripted_config(bench, out), lambda: backend) == reference
    assert backend.calls == 1


def test_a_missing_model_path_is_refused_before_anything_is_written(bench, tmp_path, hub):
    for model in (str(tmp_path / "ck" / "run" / "global_step_200"), "ck/run/global_step_200"):
        config = scripted_config(bench, tmp_path / "out", model=model)
        with pytest.raises(FileNotFoundError, match="global_step_200: no such folder"):
            run_evaluation(config)
        assert not (tmp_path / "out").exists()
    half = tmp_path / "hf"
    half.mkdir()
    (half / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no weights"):
        run_evaluation(scripted_config(bench, tmp_path / "out", model=str(half)))
    shards = tmp_path / "global_step_3" / "actor"
    shards.mkdir(parents=True)
    with pytest.raises(ValueError, match="verl checkpoint .*eval.sh"):
        run_evaluation(scripted_config(bench, tmp_path / "out", model=str(shards.parent)))
    assert not (tmp_path / "out").exists()
    _cache(hub, "Qwen/Qwen3-8B")
    model_source.check_model_source("Qwen/Qwen3-8B")  # a hub id in the cache is left to the backend


def test_a_finished_folder_needs_no_model(bench, tmp_path):
    out = tmp_path / "out"
    summary = run_evaluation(scripted_config(bench, out), lambda: ScriptedBackend(answers(bench)))
    config = scripted_config(bench, out)
    assert run_evaluation(config) == summary  # nothing left to generate: model "scripted" never loaded


def test_a_second_evaluation_into_a_busy_folder_is_refused(bench, tmp_path):
    out = tmp_path / "out"
    lock = parallel.OutputLock(out)
    lock.acquire()
    try:
        with pytest.raises(ValueError, match="another evaluation is writing to this folder"):
            run_evaluation(scripted_config(bench, out), lambda: ScriptedBackend(answers(bench)))
    finally:
        lock.release()
    assert run_evaluation(scripted_config(bench, out), lambda: ScriptedBackend(answers(bench)))["decodings"]


def _model_copy(assets, tmp_path):
    """A copy of the tiny CPU model folder (a complete Hugging Face model folder)."""
    import shutil

    return Path(shutil.copytree(Path(assets) / "model", tmp_path / "hf"))


@pytest.mark.parametrize("damage, words", [
    (lambda m: (m / "model.safetensors").write_bytes((m / "model.safetensors").read_bytes()[:-100]), "cut off"),
    (lambda m: (m / "model.safetensors").write_bytes(b"\x05"), "not a safetensors file"),
    (lambda m: (m / "config.json").write_text('{"model_type": "qwen'), "config.json is not valid JSON"),
    (lambda m: (m / "config.json").write_text("[1]"), "config.json is not a JSON object"),
    (lambda m: (m / "tokenizer.json").unlink(), "no tokenizer file"),
    (lambda m: (m / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00002.safetensors"}}'),
     "names shard(s) that are not there: model-00002.safetensors"),
    (lambda m: (m / "pytorch_model.bin").write_bytes(b"PK\x03\x04 cut"), "not a complete PyTorch archive"),
])
def test_an_incomplete_or_corrupt_model_folder_is_refused_before_anything_is_written(assets, bench, tmp_path, damage, words):
    model = _model_copy(assets, tmp_path)
    damage(model)
    with pytest.raises(ValueError, match=re.escape(words)):
        run_evaluation(scripted_config(bench, tmp_path / "out", model=str(model)))
    assert not (tmp_path / "out").exists()


def test_a_complete_model_folder_passes_the_check(assets, tmp_path):
    model_source.check_model_source(str(_model_copy(assets, tmp_path)))


def test_a_missing_absolute_path_names_no_working_folder(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        model_source.check_model_source(str(tmp_path / "nope" / "global_step_2"))
    assert "relative paths" not in str(err.value)
    with pytest.raises(FileNotFoundError, match=re.escape(f"relative paths are taken from {Path.cwd()}")):
        model_source.check_model_source("nope/global_step_2")


@pytest.mark.parametrize("value", [5.0, 0.0, -0.7])
def test_gpu_memory_utilization_outside_0_1_is_refused(bench, tmp_path, value):
    config = scripted_config(bench, tmp_path / "out", gpu_memory_utilization=value)
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization .* in \(0, 1\]"):
        config.validate()


@pytest.mark.parametrize("change, message", [
    (dict(verifier_dtype="bf16"), "--verifier-dtype 'bf16' is not a dtype; one of auto, bfloat16, float16, float32"),
    (dict(gpus="0,1,0"), "--gpus 0,1,0: names GPU 0 more than once"),
])
def test_settings_known_to_fail_are_refused_before_anything_is_written(bench, tmp_path, capsys, change, message):
    """Each would have failed only after every sample was generated (the verifier's load) or taken
    one GPU twice."""
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=re.escape(message)):
        run_evaluation(scripted_config(bench, out, **change), lambda: ScriptedBackend(answers(bench)))
    assert not out.exists()
    option, value = {"verifier_dtype": "--verifier-dtype", "gpus": "--gpus"}[next(iter(change))], next(iter(change.values()))
    assert _cli(bench, out, option, value) == 2
    assert message in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("taken", ["grades", "generations", "workers", "summary.json"])
def test_an_output_path_the_run_cannot_write_is_refused_before_generating(bench, tmp_path, taken):
    """A file where the run writes a folder (or a folder where it writes a file) failed after the
    whole generation; it is named first."""
    out = tmp_path / "out"
    out.mkdir()
    (out / taken).mkdir() if taken.endswith(".json") else (out / taken).write_text("not a folder")
    with pytest.raises(ValueError, match=re.escape(str(out / taken))):
        run_evaluation(scripted_config(bench, out), lambda: ScriptedBackend(answers(bench)))
    assert sorted(p.name for p in out.iterdir()) == [taken]


@pytest.fixture()
def hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache and a hub that cannot be reached (nothing listens on port 9)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    return constants


def _cache(constants, model_id):
    """``model_id``'s config.json in the cache, as ``hf download`` leaves it."""
    repo = Path(constants.HF_HUB_CACHE) / f"models--{model_id.replace('/', '--')}"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "snapshots" / "abc" / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")


@pytest.mark.parametrize("offline", [True, False])
def test_a_verifier_model_neither_cached_nor_reachable_is_refused_before_generating(bench, tmp_path, capsys, hub,
                                                                                    monkeypatch, offline):
    """Offline, a hub id failed when the verifier loaded, after every sample, with a long traceback;
    it is one line before anything is written. A cached one passes."""
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", offline)
    prompt = _prompts_py(tmp_path / "prompts.py")
    out = tmp_path / "out"
    config = scripted_config(bench, out, verifier="compass", verifier_prompt_file=str(prompt),
                             verifier_model="opencompass/CompassVerifier-3B")
    why = "HF_HUB_OFFLINE is set" if offline else "the hub does not give it (ConnectError"
    with pytest.raises(ValueError, match=re.escape(f"--verifier-model opencompass/CompassVerifier-3B: not in the Hugging "
                                                   f"Face cache ({tmp_path / 'hub'}), and {why}")):
        run_evaluation(config, lambda: ScriptedBackend(answers(bench)))
    assert not out.exists()
    monkeypatch.setattr(run_eval, "run_evaluation", lambda config: run_evaluation(config, lambda: ScriptedBackend(answers(bench))))
    assert _cli(bench, out, "--verifier", "compass", "--verifier-prompt-file", str(prompt),
                "--verifier-model", "opencompass/CompassVerifier-3B") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --verifier-model") and not out.exists()  # one line
    _cache(hub, "opencompass/CompassVerifier-3B")
    assert model_source.hub_model_problem("opencompass/CompassVerifier-3B") is None
    assert run_eval.plan_run(config, injected_backend=True).verifier_name == "compass" and not out.exists()


def test_a_full_disk_is_one_line_and_the_rerun_resumes(bench, tmp_path, capsys, monkeypatch):
    import errno

    from recipe.stapo.eval import generate

    out = tmp_path / "out"
    real_append, real_run = generate.append_lines, run_evaluation
    written = []

    def fills_up(path, lines):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        written.append(path)
        real_append(path, lines)

    monkeypatch.setattr(generate, "append_lines", fills_up)
    monkeypatch.setattr(run_eval, "run_evaluation", lambda config: real_run(config, lambda: ScriptedBackend(answers(bench))))
    assert _cli(bench, out, "--batch-size", "4") == 2
    err = capsys.readouterr().err  # the progress bar, then one line
    (line,) = [line for line in err.splitlines() if "error" in line.lower()]
    assert line.startswith("error: [Errno 28] No space left on device") and "rerun the same command" in line
    assert "Traceback" not in err
    assert len((out / "generations" / "aime24__train.jsonl").read_text().splitlines()) == 4  # the first batch is kept
    monkeypatch.setattr(generate, "append_lines", real_append)  # space freed: the same command finishes
    assert _cli(bench, out, "--batch-size", "4") == 0
    problems = len(run_eval.load_problems(bench / "aime24.parquet"))
    assert len((out / "generations" / "aime24__train.jsonl").read_text().splitlines()) == problems * 32


# ----------------------------------------------------------------------------------------------
# an answer whose check could not run: ungraded, retried, counted, never a silent "wrong"
# ----------------------------------------------------------------------------------------------
def _flaky_grader(monkeypatch, status_of):
    """The default protocol's grader, except that the check of a wrong answer under the time limit
    ``t`` gets the status ``status_of(t)`` (None: it runs); returns the limits of those checks."""
    from recipe.stapo.reward.lenient import Graded

    real, limits = grade.justrl_grade_answer, []

    def flaky(response, truth, timeout_s):
        graded = real(response, truth, timeout_s)
        if graded.correct is False:
            limits.append(timeout_s)
            if status_of(timeout_s) is not None:
                return Graded(None, graded.pred, status_of(timeout_s))
        return graded

    monkeypatch.setattr(grade, "justrl_grade_answer", flaky)
    return limits


def test_an_ungraded_answer_is_retried_counted_not_cached_and_keeps_the_run_unfinished(bench, tmp_path, monkeypatch):
    out = tmp_path / "out"
    failures = len(_rule_failures(bench))
    limits = _flaky_grader(monkeypatch, lambda limit: "unavailable")  # no helper process ever starts
    summary = run_evaluation(scripted_config(bench, out), lambda: ScriptedBackend(answers(bench)))
    block = summary["decodings"]["train"]["benchmarks"]["aime24"]
    assert block["ungraded"] == failures and block["timed_out"] == 0
    assert summary["decodings"]["train"]["ungraded"] == failures
    assert sorted(limits) == [5.0] * failures + [10.0] * failures + [20.0] * failures  # retried with 2x, 4x the limit
    assert f"Not finished: {failures} answers are ungraded" in (out / "summary.md").read_text()
    cached = [r for _, r in JsonlStore(out / "grades" / "aime24__train.jsonl").read()]
    assert len(cached) == 30 - failures and all(r["grader_correct"] for r in cached)  # no ungraded one cached
    from recipe.stapo.eval import tables

    issues = tables.row_from_summary(dict(summary, scale="8B", method="STAPO"), "s.json").issues["train"]
    assert f"AIME24 (1.0/1.0): {failures} answers ungraded (their check could not run; rerun eval.sh on its " \
           "folder to grade them)" in issues
    # the next run grades them (the helpers start now) and finishes the block
    monkeypatch.undo()
    again = run_evaluation(scripted_config(bench, out), lambda: ScriptedBackend(answers(bench)))
    block = again["decodings"]["train"]["benchmarks"]["aime24"]
    assert block["ungraded"] == 0 and "Not finished" not in (out / "summary.md").read_text()
    issues = tables.row_from_summary(dict(again, scale="8B", method="STAPO"), "s.json").issues["train"]
    assert not [i for i in issues if "ungraded" in i]
    assert block["grader_mean_at_n"] == summary["decodings"]["train"]["benchmarks"]["aime24"]["grader_mean_at_n"]


def test_a_check_past_its_limit_on_every_try_is_wrong_and_counted_once_that_passes_is_graded(bench, tmp_path,
                                                                                          monkeypatch):
    failures = len(_rule_failures(bench))
    limits = _flaky_grader(monkeypatch, lambda limit: "timeout")
    summary = run_evaluation(scripted_config(bench, tmp_path / "a"), lambda: ScriptedBackend(answers(bench)))
    block = summary["decodings"]["train"]["benchmarks"]["aime24"]
    assert (block["ungraded"], block["timed_out"]) == (0, failures)
    assert sorted(limits) == [5.0] * failures + [10.0] * failures + [20.0] * failures
    monkeypatch.undo()
    limits = _flaky_grader(monkeypatch, lambda limit: "timeout" if limit == 5.0 else None)  # slow once
    summary = run_evaluation(scripted_config(bench, tmp_path / "b"), lambda: ScriptedBackend(answers(bench)))
    block = summary["decodings"]["train"]["benchmarks"]["aime24"]
    assert (block["ungraded"], block["timed_out"]) == (0, 0)
    assert sorted(limits) == [5.0] * failures + [10.0] * failures


# ----------------------------------------------------------------------------------------------
# --max-new-tokens beyond the model's context: refused before generation (vLLM would cap it silently)
# ----------------------------------------------------------------------------------------------
def _tiny_config(assets, out, max_new_tokens):
    return run_eval.EvalConfig(model=str(assets / "model"), benchmarks_dir=str(assets), out=str(out), benchmarks=("val",),
                               n_samples={"val": 1}, decodings=("justrl",), max_new_tokens=max_new_tokens, backend="hf",
                               verifier="none")


def test_max_new_tokens_beyond_the_models_context_is_refused_before_anything_is_written(assets, tmp_path):
    """The shipped tiny model's context is 256 tokens (max_position_embeddings)."""
    context = json.loads((assets / "model" / "config.json").read_text())["max_position_embeddings"]
    assert context == 256
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"--max-new-tokens 256: the model's context is 256 tokens \(max_position_embeddings "
                                         r"in .*config\.json\), prompt and response together"):
        run_evaluation(_tiny_config(assets, out, 256))
    with pytest.raises(ValueError, match=r"--max-new-tokens 250: .* the longest prompt \(val problem '\d+'\) has (\d+), so at "
                                         r"most \d+ new tokens fit; .* Pass --max-new-tokens \d+ or less") as refused:
        run_evaluation(_tiny_config(assets, out, 250))
    fits = int(re.search(r"at most (\d+) new tokens fit", str(refused.value)).group(1))
    assert not out.exists()
    plan = run_eval.plan_run(_tiny_config(assets, out, fits))  # the largest value that fits passes
    assert plan.pending == 64 and not out.exists()
    with pytest.raises(ValueError, match=rf"--max-new-tokens {fits + 1}: "):
        run_eval.plan_run(_tiny_config(assets, out, fits + 1))


def test_a_yarn_scaled_context_is_the_scaled_one(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "max_position_embeddings": 40960, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 32768}}))
    assert model_source.model_context(tmp_path)[0] == 131072
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 32768}))
    assert model_source.model_context(tmp_path) == (32768, f"max_position_embeddings in {tmp_path / 'config.json'}")


def test_mean_at_n_comes_with_the_standard_error_of_the_problems_spread():
    """Three problems, 2 samples each, right 2, 1 and 0 times: accuracies 1, 0.5, 0 (mean 50%); their
    sample standard deviation is 0.5, so the standard error is 100 * 0.5 / sqrt(3) percent."""
    from recipe.stapo.eval.generate import Problem

    problems = [Problem(i, str(i), ({"role": "user", "content": f"q{i}"},), "1", f"q{i}") for i in range(3)]
    graded = {(i, s): grade.GradedSample(i, s, "1", s < 2 - i) for i in range(3) for s in range(2)}
    mean, standard_error = grade.mean_at_n(graded, problems, 2)
    assert mean == pytest.approx(50.0) and standard_error == pytest.approx(100 * 0.5 / 3 ** 0.5)
    assert grade.mean_at_n(graded, problems[:1], 2) == (100.0, None)  # one problem: no spread to measure
