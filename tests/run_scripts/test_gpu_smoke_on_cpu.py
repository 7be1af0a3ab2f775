"""``run_scripts/gpu_smoke.sh`` in its CPU mode, end to end, and what it hands on: verl's real trainer
(tiny model, verl's vLLM rollout on vLLM's CPU build) trains STAPO one step with a checkpoint and the wandb logger (offline);
``eval.sh`` converts the verl checkpoint with verl's own model merger and evaluates 2 problems with the
HF backend (slow: one trainer run, ~1.5-2 min on 2 cores; every slow test reads what it left). A
relaunch resuming from the checkpoints and continuing the same wandb run is
tests/e2e/test_two_node_on_cpu.py's.

Its GPU mode at the paper's lengths (``LENGTHS=paper``) is checked as configs: the commands it would
run compose and pass the driver's preflight, GPU memory on an 80 GB GPU included.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from recipe.stapo.driver import PreflightError, compose, prepare
from recipe.stapo.methods import PAPER_METHODS
from recipe.stapo.metrics import read_metrics
from stapo_cpu.trainer import machine_turn
from tests.helpers.cluster_files import QWEN3_CONFIGS, fake_cluster, write_model
from tests.helpers.paths import REPO
from tests.helpers.wandb_offline import offline_runs

SMOKE = REPO / "run_scripts" / "gpu_smoke.sh"
TIMEOUT_S = 900
PROJECT, EXPERIMENT = "stapo_smoke", "smoke_stapo"  # what gpu_smoke.sh names the stapo run
WANDB = "trainer.logger=[console,file,wandb]"


@pytest.fixture(scope="module")
def smoke(assets, tmp_path_factory):
    """gpu_smoke.sh (CPU mode, METHODS=stapo, STEPS=1, wandb offline)."""
    root = tmp_path_factory.mktemp("gpu_smoke")
    out, wandb_dir = root / "smoke", root / "wandb_runs"
    wandb_dir.mkdir()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "STAPO_", "VERL_"))}
    wandb_env = {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}
    env = {**clean, **wandb_env, "SMOKE_DEVICE": "cpu", "ASSETS": str(assets), "OUT": str(out), "METHODS": "stapo",
           "STEPS": "1", "PYTHON": sys.executable}
    with machine_turn():  # the script's trainer run takes the machine's turn like run_cpu_trainer's
        proc = subprocess.run(["bash", str(SMOKE), WANDB], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    return {"proc": proc, "out": out, "wandb_dir": wandb_dir}


def _ok(smoke):
    proc = smoke["proc"]
    assert proc.returncode == 0, f"gpu_smoke.sh failed:\n{proc.stderr[-5000:]}"
    return smoke["out"]


@pytest.mark.slow
def test_smoke_script_trains_saves_and_evaluates(smoke):
    out = _ok(smoke)
    assert "[smoke] OK" in smoke["proc"].stderr
    steps = read_metrics(out / "stapo" / "metrics.jsonl")
    assert set(steps) == {1}
    assert any(key.startswith("actor/s2t/") for key in steps[1]), sorted(steps[1])
    assert (out / "stapo" / "checkpoints" / "global_step_1" / "actor").is_dir()


@pytest.mark.slow
def test_verl_checkpoint_is_converted_by_verls_merger(smoke):
    """The merged Hugging Face weights are the trained FSDP2 shard's (one rank: the whole tensors)."""
    import torch
    from safetensors.torch import load_file

    out = _ok(smoke)
    actor = out / "stapo" / "checkpoints" / "global_step_1" / "actor"
    merged = actor.parent / "merged_hf"  # beside actor/, out of checkpoint retention's reach
    assert (merged / "config.json").is_file() and (merged / "tokenizer_config.json").is_file()
    assert not (actor.parent / "merged_hf.partial").exists()
    tensors = {}
    for shard in merged.glob("*.safetensors"):
        tensors.update(load_file(shard))
    fsdp = torch.load(actor / "model_world_size_1_rank_0.pt", map_location="cpu", weights_only=False)
    local = {k: getattr(v, "_local_tensor", v) for k, v in fsdp.items()}
    # tied embeddings: lm_head is the embedding, stored once in the merged model
    assert set(local) - {"lm_head.weight"} == set(tensors)
    for key, value in tensors.items():
        assert value.shape == local[key].shape, key
        assert torch.equal(local[key].to(value.dtype), value), key


@pytest.mark.slow
def test_evaluation_of_the_checkpoint_covers_two_problems(smoke):
    out = _ok(smoke)
    evaluation = out / "eval"
    config = json.loads((evaluation / "run_config.json").read_text())
    assert config["model"].endswith("global_step_1/merged_hf") and config["backend"] == "hf"
    records = [json.loads(line) for f in (evaluation / "generations").glob("aime24__train.jsonl")
               for line in f.read_text().splitlines() if line.strip()]
    assert len(records) == 2  # 2 problems x 1 sample
    summary = json.loads((evaluation / "summary.json").read_text())
    assert "aime24" in json.dumps(summary)


@pytest.mark.slow
def test_wandb_offline_run_has_the_names_and_s2t_metrics(smoke):
    _ok(smoke)
    first = offline_runs(smoke["wandb_dir"])[0]
    assert (first["project"], first["name"]) == (PROJECT, EXPERIMENT)
    assert set(first["history"]) == {1}
    assert any(key.startswith("actor/s2t/") for key in first["history"][1]), sorted(first["history"][1])


# ------------------------------------------------------------------------------------------------
# GPU mode at the paper's lengths (LENGTHS=paper), as configs
# ------------------------------------------------------------------------------------------------


def _gpu_dry_run(tmp_path: Path, model: Path, data: str, **extra) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STAPO_", "LAUNCH", "CKPT_DIR", "GPU_MEM"))}
    env.update(MODEL=str(model), STAPO_DATA_DIR=data, STAPO_DRY_RUN="1", OUT=str(tmp_path / "smoke"),
               PYTHON=sys.executable, **extra)
    return subprocess.run(["bash", str(SMOKE)], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("extra, message", [
    ({}, "set MODEL to a local Hugging Face model folder"),
    ({"MODEL": "no_such_model"}, "no_such_model: no config.json"),
    ({"SMOKE_DEVICE": "tpu"}, "SMOKE_DEVICE: unknown device 'tpu'"),
    ({"LENGTHS": "long"}, "LENGTHS: unknown value 'long'"),
    ({"LENGTHS": "paper", "SMOKE_DEVICE": "cpu"}, "LENGTHS=paper needs SMOKE_DEVICE=gpu"),
    ({"STEPS": "0"}, "STEPS='0': expected a whole number >= 1"),
])
def test_a_refused_smoke_run_leaves_no_folder(tmp_path, extra, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STAPO_", "MODEL", "SMOKE_", "LENGTHS", "STEPS"))}
    env.update(OUT="smoke", PYTHON=sys.executable, **extra)
    proc = subprocess.run(["bash", str(SMOKE)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_dry_run_prints_the_commands_and_creates_nothing(tmp_path):
    env = fake_cluster(tmp_path / "shared")
    model = Path(env["STAPO_MODEL_DIR"]) / "Qwen3-1.7B-Base"
    proc = _gpu_dry_run(tmp_path, model, env["STAPO_DATA_DIR"])
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == len(PAPER_METHODS)
    assert not (tmp_path / "smoke").exists()


def _prepared(commands: list[list[str]], data: str, monkeypatch) -> list:
    monkeypatch.setenv("STAPO_DATA_DIR", data)  # what common.sh exports to the driver
    monkeypatch.delenv("GPU_MEM_GB", raising=False)
    configs = []
    for argv in commands:
        config = compose(argv[3:])
        logged = []
        prepare(config, log=logged.append, environ={})
        configs.append((config, "\n".join(logged)))
    return configs


def test_paper_lengths_runs_pass_the_preflight_on_one_gpu(tmp_path, monkeypatch):
    """LENGTHS=paper: every method at 1024 / 15360 tokens with Qwen3-1.7B's token budgets on one
    node, a small batch; the preflight passes them, its memory table at the 16k-token budgets."""
    env = fake_cluster(tmp_path / "shared")
    model = Path(env["STAPO_MODEL_DIR"]) / "Qwen3-1.7B-Base"
    proc = _gpu_dry_run(tmp_path, model, env["STAPO_DATA_DIR"], LENGTHS="paper", GPUS="1")
    assert proc.returncode == 0, proc.stderr
    commands = [shlex.split(line) for line in proc.stdout.strip().splitlines()]
    configs = _prepared(commands, env["STAPO_DATA_DIR"], monkeypatch)
    assert [c.recipe.method for c, _ in configs] == list(PAPER_METHODS)
    for config, logged in configs:
        assert (config.data.max_prompt_length, config.data.max_response_length) == (1024, 15360)
        assert (config.trainer.nnodes, config.trainer.n_gpus_per_node) == (1, 1)
        assert (config.data.train_batch_size, config.actor_rollout_ref.rollout.n) == (8, 4)
        assert config.actor_rollout_ref.actor.ppo_mini_batch_size == 4  # 2 updates per step
        assert config.actor_rollout_ref.model.path == str(model)
        assert config.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu >= 16384
        assert "preflight passed" in logged and "at 49152 tokens" in logged and "DOES NOT FIT" not in logged


def test_paper_lengths_with_a_model_too_large_for_the_gpus_is_refused(tmp_path, monkeypatch):
    """Qwen3-8B on one GPU: its training state alone outgrows 80 GB; the preflight says so, and names
    the GPU count that fits."""
    env = fake_cluster(tmp_path / "shared")
    model = Path(env["STAPO_MODEL_DIR"]) / "Qwen3-8B-Base"
    proc = _gpu_dry_run(tmp_path, model, env["STAPO_DATA_DIR"], LENGTHS="paper", GPUS="1", METHODS="stapo")
    assert proc.returncode == 0, proc.stderr
    (argv,) = [shlex.split(line) for line in proc.stdout.strip().splitlines()]
    with pytest.raises(PreflightError, match="only offload or more GPUs make it fit: run with trainer.n_gpus_per_node="):
        _prepared([argv], env["STAPO_DATA_DIR"], monkeypatch)


@pytest.mark.parametrize("extra, message", [
    ({"LENGTHS": "long"}, "LENGTHS: unknown value 'long'"),
    ({"LENGTHS": "paper", "SMOKE_DEVICE": "cpu"}, "LENGTHS=paper needs SMOKE_DEVICE=gpu"),
    ({"STEPS": "abc"}, "STEPS='abc': expected a whole number >= 1"),
    ({"STEPS": "0"}, "STEPS='0': expected a whole number >= 1"),
])
def test_bad_lengths_setting_fails(tmp_path, extra, message):
    model = write_model(tmp_path / "Qwen3-1.7B-Base", QWEN3_CONFIGS["Qwen3-1.7B-Base"])
    proc = _gpu_dry_run(tmp_path, model, str(tmp_path), **extra)
    assert proc.returncode == 2 and message in proc.stderr
