"""The vLLM backend run for real on CPU (vLLM's CPU build), next to the transformers backend on the
same float32 model: an evaluation through run_scripts/eval.sh graded by a vLLM judge, greedy
agreement, sampling reproducible per seed, and a clean shutdown.

One in-process engine serves the module's tests (loading one costs ~30-40 s of CPU); the last test
closes it. The eval.sh run loads two more in its own processes (the policy's, the judge's). An
evaluation killed with SIGKILL and resumed is tests/recipe/eval/test_documented_commands_on_cpu.py's
(the documented CPU evaluation, killed after its first saved batch and run again).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipe.stapo.eval import run_eval
from recipe.stapo.eval.backends import HFBackend, SamplingConfig, VLLMBackend

from tests.helpers.eval_models import (
    FIXTURES, SessionSegments, bench_dir, build_judge_model, build_tiny_model, engine_processes, fixture_rows,
    mapped_segments, outliving,
)
from tests.helpers.paths import REPO

EVAL = REPO / "run_scripts" / "eval.sh"
TEMPLATE = (
    "Judge the candidate against the standard answer.\n<Original Question Begin>:\n{question}\n"
    "<Original Question End>\n<Standard Answer Begin>:\n{gold_answer}\n<Standard Answer End>\n"
    "<Candidate's Answer Begin>: \n{llm_response}\n<Candidate's Answer End>\n"
)

GREEDY_TOKENS = 24
LOGIT_TOLERANCE = 1e-4
"""How far below transformers' best logit vLLM's greedy token may be (float32 on both sides: the
two compute the same sums in other orders, ~1e-6 apart)."""

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("vllm_tiny") / "model")


@pytest.fixture(scope="module")
def vllm_backend(model_dir):
    backend = VLLMBackend(str(model_dir))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def hf_backend(model_dir):
    return HFBackend(str(model_dir))


@pytest.fixture(scope="module")
def prompts(hf_backend, tmp_path_factory):
    from recipe.stapo.data import prepare

    path = tmp_path_factory.mktemp("vllm_bench") / "math500.parquet"
    prepare.prepare_dataset(prepare.BENCHMARK_SPECS["math500"], path, str(FIXTURES / "bench_sample.jsonl"))
    return [hf_backend.render(p.messages) for p in run_eval.load_problems(path)]


def test_the_cpu_engine_loads_in_float32_with_its_cpu_settings(vllm_backend, model_dir):
    config = vllm_backend.llm.llm_engine.model_config
    assert config.dtype == torch.float32
    assert config.enforce_eager
    assert vllm_backend.context_length() == 512  # the tiny model's max_position_embeddings
    assert os.environ["VLLM_TARGET_DEVICE"] == "cpu"
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] and os.environ["VLLM_CPU_OMP_THREADS_BIND"]


def test_greedy_tokens_are_transformers_best_at_every_step(vllm_backend, hf_backend, prompts):
    """vLLM's greedy continuation of each prompt, fed back to transformers: at every step vLLM's token
    is transformers' argmax, or within LOGIT_TOLERANCE of it (a near tie the two may break apart),
    and the two log-probabilities of that token agree to LOGIT_TOLERANCE; the backends' greedy texts
    are the same. (Measured: every token is transformers' argmax, the best two logits of a step at
    least 0.29 apart.)"""
    vllm = vllm_backend._vllm
    token_prompts = vllm_backend._token_prompts(prompts)
    outputs = vllm_backend.llm.generate(
        token_prompts, vllm.SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )
    model = hf_backend.model
    steps = 0
    for prompt, output in zip(token_prompts, outputs):
        ids = list(prompt["prompt_token_ids"])
        hf_ids = hf_backend.tokenizer(hf_backend.tokenizer.decode(ids), add_special_tokens=False)["input_ids"]
        assert output.prompt_token_ids == ids == hf_ids  # both backends see the same prompt tokens
        generated = list(output.outputs[0].token_ids)
        assert len(generated) == GREEDY_TOKENS
        with torch.no_grad():
            logits = model(torch.tensor([ids + generated])).logits[0, len(ids) - 1 : -1]
        steps_index, chosen = torch.arange(len(generated)), torch.tensor(generated)
        gaps = logits.max(dim=-1).values - logits[steps_index, chosen]
        assert gaps.max().item() <= LOGIT_TOLERANCE, (prompt, generated, gaps.tolist())
        hf_logprobs = torch.log_softmax(logits, dim=-1)[steps_index, chosen]
        vllm_logprobs = torch.tensor([step[token].logprob for step, token in zip(output.outputs[0].logprobs, generated)])
        assert torch.allclose(vllm_logprobs, hf_logprobs, rtol=0, atol=LOGIT_TOLERANCE), (vllm_logprobs, hf_logprobs)
        steps += len(generated)
    assert steps == len(prompts) * GREEDY_TOKENS and len(prompts) == 5
    assert vllm_backend.greedy(prompts, GREEDY_TOKENS) == hf_backend.greedy(prompts, GREEDY_TOKENS)


def test_a_sample_depends_only_on_its_prompt_and_seed(vllm_backend, prompts):
    """What resuming an evaluation relies on: the same (prompt, seed) gives the same text whatever it
    is batched with; another seed gives another sample (a random model samples nearly uniformly)."""
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=16)
    batch = vllm_backend.generate([prompts[0], prompts[1], prompts[0], prompts[0]], [11, 11, 11, 12], sampling)
    alone = vllm_backend.generate([prompts[0]], [11], sampling)
    assert batch[0] == batch[2] == alone[0]
    assert batch[0].text != batch[3].text
    assert batch[0].num_tokens == 16 and batch[0].finish_reason == "length"
    later = vllm_backend.generate([prompts[0], prompts[0]], [12, 11], sampling)
    assert later == [batch[3], batch[0]]


def _schema(value):
    """The shape of a JSON value: key -> schema for objects, the element schemas for lists, else the
    type's name (int and float both "number": a mean is 0 or 50.0 whatever the backend)."""
    if isinstance(value, dict):
        return {k: _schema(v) for k, v in value.items()}
    if isinstance(value, list):
        return sorted({json.dumps(_schema(v), sort_keys=True) for v in value})
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    return "number" if isinstance(value, (int, float)) else type(value).__name__


def _outputs(out: Path) -> dict:
    """Every record file of an evaluation folder (its workers/ scratch folder aside): relative path ->
    its JSON value (a .jsonl file: the list of its records)."""
    found = {}
    for path in sorted(out.rglob("*.json*")):
        rel = path.relative_to(out).as_posix()
        if rel.startswith("workers/"):
            continue
        text = path.read_text(encoding="utf-8")
        found[rel] = [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" else json.loads(text)
    return found


def test_eval_sh_with_vllm_writes_the_records_the_hf_backend_writes(model_dir, tmp_path):
    """run_scripts/eval.sh --backend vllm on CPU: the policy's engine in a worker process, the
    CompassVerifier judge's engine (build_verifier(..., backend="vllm")) in the main one, as on GPUs.
    Its records have the keys and types of the same evaluation with --backend hf, the judge's
    verdicts are the same, and no engine process or shared-memory segment outlives the run."""
    judge = build_judge_model(tmp_path / "judge", "A")
    bench = bench_dir(tmp_path / "bench", fixture_rows())
    prompt = tmp_path / "prompts.py"
    prompt.write_text(f"CV_PROMPT = {TEMPLATE!r}\n")
    args = ["--benchmarks", "aime24", "--n-samples", "aime24=2", "--limit", "2", "--max-new-tokens", "8",
            "--seed", "7", "--verifier-model", str(judge)]
    env = {**os.environ, "MODEL": str(model_dir), "OUT": str(tmp_path / "vllm"), "STAPO_DATA_DIR": str(bench),
           "PYTHON": sys.executable, "BACKEND": "vllm", "VERIFIER": "compass", "VERIFIER_PROMPT": str(prompt),
           "DECODING": "train"}
    proc = subprocess.Popen(["bash", str(EVAL), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    watch = SessionSegments(proc.pid).start()
    log, _ = proc.communicate(timeout=600)
    used = watch.stop()
    assert proc.returncode == 0, log[-4000:]
    assert "worker 0: 4 samples" in log  # the policy was sampled in a worker process, as on GPUs
    assert not outliving(proc.pid), "engine processes outlived the evaluation"
    assert any(name.startswith("psm_") for name in used), used  # vLLM's message queues were seen
    assert not [name for name in used if Path("/dev/shm", name).exists()], "the evaluation left /dev/shm segments"

    assert run_eval.main(["--model", str(model_dir), "--benchmarks-dir", str(bench), "--out", str(tmp_path / "hf"),
                          "--backend", "hf", "--decoding", "train", "--verifier", "compass",
                          "--verifier-prompt-file", str(prompt), *args]) == 0
    vllm_run, hf_run = _outputs(tmp_path / "vllm"), _outputs(tmp_path / "hf")
    assert set(vllm_run) == set(hf_run)
    assert {"generations/aime24__train.jsonl", "verifier/aime24__train.jsonl", "summary.json"} <= set(vllm_run)
    for name in vllm_run:
        assert _schema(vllm_run[name]) == _schema(hf_run[name]), name
    samples = vllm_run["generations/aime24__train.jsonl"]
    assert len(samples) == 4 and all(0 < r["num_tokens"] <= 8 for r in samples)
    assert vllm_run["run_config.json"]["backend"] == "vllm" and hf_run["run_config.json"]["backend"] == "hf"

    def judged(run):
        return sorted((r["problem_index"], r["sample"], r["judgement"], r["output"], r["verifier_correct"])
                      for r in run["verifier/aime24__train.jsonl"])

    assert judged(vllm_run) == judged(hf_run) and len(judged(hf_run)) == 4  # a random policy fails the rule
    assert {row[2:] for row in judged(vllm_run)} == {("A", "A", True)}


def test_close_ends_the_engine_processes_and_removes_their_shared_memory(vllm_backend):
    """Runs last in this module: it closes the module's engine."""
    processes = engine_processes(os.getpid())
    segments = mapped_segments([os.getpid(), *(p.pid for p in processes)])
    assert processes, "the engine runs in child processes"
    assert segments, "vLLM's message queues are /dev/shm segments"
    # close() waits for the engine's processes, not for the resource tracker, which outlives it
    waited = [" ".join(p.cmdline()) for p in vllm_backend._engine_processes]
    assert waited and not [c for c in waited if "resource_tracker" in c], waited
    vllm_backend.close()
    for process in processes:
        process.wait(timeout=30)  # ended (and reaped when it is this process's child)
    assert not [s for s in segments if Path("/dev/shm", s).exists()]
    vllm_backend.close()  # a second close is harmless
