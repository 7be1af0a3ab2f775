"""Launch scripts: ``run_scripts/common.sh`` in both modes (``LAUNCH=local`` / ``submit``) passes
absolute paths taken from the launching directory, a submitted job carries only the allowed
variables (secrets through a private file, never the command line or the Hydra config), checkpoints
are bounded by default, and ``run_scripts/eval.sh`` picks its interpreter and output folder as
documented."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from omegaconf import OmegaConf

from recipe.stapo.driver import FORWARDED_ENV_NAMES, FORWARDED_ENV_PREFIXES, compose
from tests.helpers.paths import REPO

COMMON = REPO / "run_scripts" / "common.sh"
EVAL = REPO / "run_scripts" / "eval.sh"
SECRET = "wandb-secret-0123456789abcdef"


def _env(**extra) -> dict:
    """The test process's environment without what a launch would forward (those come from each test)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WANDB_", "HF_", "LAUNCH", "CKPT_DIR", *FORWARDED_ENV_PREFIXES))
           and k not in FORWARDED_ENV_NAMES}
    env.update(extra)
    return env


def _run(script: Path, *args: str, cwd: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], cwd=cwd, env=_env(**env), capture_output=True, text=True)


def _value(argv: list[str], key: str):
    """The value of ``key`` in ``argv`` as Hydra's override parser reads it (the key given once)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (arg,) = [a for a in argv if a.startswith(key + "=")]
    return OverridesParser.create().parse_override(arg).value()


def _submit_dry_run(tmp_path, **env):
    proc = _run(COMMON, "stapo", "qwen3_8b", "actor_rollout_ref.actor.policy_loss.q=0.5", cwd=tmp_path,
                LAUNCH="submit", STAPO_DRY_RUN="1", PYTHON=sys.executable, **env)
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.strip().splitlines()
    argv = shlex.split(line)
    sep = argv.index("--")
    runtime_env = json.loads(proc.stderr.split("secret values masked:\n", 1)[1])
    return proc, argv[:sep], argv[sep + 1:], runtime_env["env_vars"]


def test_submit_mode_submits_a_detached_job_named_after_the_run(tmp_path):
    from recipe.stapo.driver import wandb_run_id

    proc, head, entry, _ = _submit_dry_run(tmp_path, RAY_API_SERVER_ADDRESS="http://head:8265", STAPO_DATA_DIR="rel/data",
                                           CKPT_DIR="ck")
    assert head[:3] == ["ray", "job", "submit"] and "--no-wait" in head
    assert head[head.index("--address") + 1] == "http://head:8265"
    assert head[head.index("--submission-id") + 1] == wandb_run_id("stapo", "qwen3_8b_stapo")
    assert head[head.index("--working-dir") + 1] == str(REPO)
    runtime_env_file = Path(head[head.index("--runtime-env") + 1])
    assert not runtime_env_file.exists(), "the runtime env file (it holds secrets) must not outlive the launcher"
    # what the deleted file held is printed, and the message says the file is gone
    assert f"[stapo] {runtime_env_file} (deleted when this script exits; a launch writes its own)" in proc.stderr
    env_vars = json.loads(proc.stderr.split("secret values masked:\n", 1)[1])["env_vars"]
    assert env_vars["STAPO_DATA_DIR"] == str(tmp_path / "rel/data") and env_vars["STAPO_LAUNCH_DIR"] == str(tmp_path)
    assert entry[:3] == [sys.executable, "-m", "recipe.stapo.main_stapo"]
    assert _value(entry, "trainer.default_local_dir") == str(tmp_path / "ck/stapo/qwen3_8b_stapo")
    assert _value(entry, "actor_rollout_ref.actor.policy_loss.q") == 0.5


def test_a_dashboard_address_in_ray_address_still_reaches_the_jobs_client(tmp_path):
    _, head, _, _ = _submit_dry_run(tmp_path, RAY_ADDRESS="http://old:8265")
    assert head[head.index("--address") + 1] == "http://old:8265"
    _, head, _, _ = _submit_dry_run(tmp_path, RAY_ADDRESS="http://old:8265", RAY_API_SERVER_ADDRESS="http://new:8265")
    assert head[head.index("--address") + 1] == "http://new:8265"


def test_submit_mode_forwards_only_the_allow_list(tmp_path):
    """The recipe's variables, the launch directory, NCCL / Gloo / vLLM / CUDA / allocator settings and
    listed wandb / HF ones; nothing set per node, nothing else; secret values never printed."""
    forwarded = {"HF_HOME": "/shared/hf", "NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "mlx5", "GLOO_SOCKET_IFNAME": "eth0",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "VLLM_ATTENTION_BACKEND": "FLASH_ATTN",
                 "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                 "STAPO_DATA_DIR": "rel/data"}
    dropped = {"AWS_SECRET_ACCESS_KEY": "aws", "CUDA_VISIBLE_DEVICES": "0,1", "VLLM_HOST_IP": "10.0.0.1",
               "RAY_AUTH_TOKEN": "ray-token", "PATH_TO_NOTHING": "x"}
    proc, _, _, names = _submit_dry_run(tmp_path, WANDB_API_KEY=SECRET, HF_TOKEN="hf_" + SECRET, **forwarded, **dropped)
    # no VERL_USE_EXTERNAL_MODULES: the node's own list reaches the driver, which puts the recipe's patches first
    assert set(names) == set(forwarded) | {"WANDB_API_KEY", "HF_TOKEN", "STAPO_LAUNCH_DIR", "RAY_OVERRIDE_JOB_RUNTIME_ENV"}
    assert SECRET not in proc.stdout + proc.stderr
    assert names["WANDB_API_KEY"] == names["HF_TOKEN"] == "<secret, not shown>"
    assert {k: names[k] for k in forwarded if k != "STAPO_DATA_DIR"} == {k: v for k, v in forwarded.items()
                                                                          if k != "STAPO_DATA_DIR"}
    assert "warning: WANDB_API_KEY, HF_TOKEN travel in the job's runtime env" in proc.stderr


def test_with_a_secrets_file_the_job_carries_no_secret(tmp_path):
    proc, _, _, names = _submit_dry_run(tmp_path, WANDB_API_KEY=SECRET, HF_TOKEN="hf_" + SECRET,
                                        STAPO_SECRETS_FILE="/shared/home/me/secrets.env")
    assert "WANDB_API_KEY" not in names and "HF_TOKEN" not in names and "STAPO_SECRETS_FILE" in names
    assert "travel in the job's runtime env" not in proc.stderr


@pytest.mark.parametrize("override", [f"+ray_kwargs.ray_init.runtime_env.env_vars.WANDB_API_KEY={SECRET}",
                                      f"+ray_kwargs.ray_init.runtime_env.env_vars={{HF_TOKEN:{SECRET}}}"])
def test_a_credential_override_is_refused_before_the_job_exists(tmp_path, override):
    """`ray job list` shows a job's command line: the launcher refuses it before asking Ray anything."""
    calls = tmp_path / "ray_calls"
    ray = tmp_path / "ray"
    ray.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\n')
    ray.chmod(0o755)
    for dry in ("0", "1"):
        proc = _run(REPO / "run_scripts" / "qwen3_8b_stapo.sh", override, cwd=tmp_path, LAUNCH="submit",
                    STAPO_DRY_RUN=dry, PYTHON=sys.executable, RAY=str(ray), TMPDIR=str(tmp_path))
        assert proc.returncode == 1 and proc.stdout == "", proc.stderr
        assert "override refused (nothing was submitted)" in proc.stderr and "names a credential" in proc.stderr
        assert SECRET not in proc.stderr
    assert not calls.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ray"]  # the runtime env file is gone too


def test_a_local_launch_refuses_a_credential_override_before_hydra_starts(tmp_path):
    override = f"+ray_kwargs.ray_init.runtime_env.env_vars.WANDB_API_KEY={SECRET}"
    proc = _run(REPO / "run_scripts" / "qwen3_1.7b_stapo.sh", override, cwd=tmp_path, PYTHON=sys.executable)
    assert proc.returncode == 1 and "override refused (nothing was started)" in proc.stderr, proc.stderr[-3000:]
    assert SECRET not in proc.stdout + proc.stderr and list(tmp_path.iterdir()) == []  # no Hydra outputs/


def _env_printer(tmp_path: Path) -> Path:
    """An interpreter stand-in printing the variables the local driver would see."""
    fake = tmp_path / "envpython"
    fake.write_text('#!/usr/bin/env bash\necho "RAY_ADDRESS=${RAY_ADDRESS-<unset>}"\necho "STAPO_LAUNCH_DIR=$STAPO_LAUNCH_DIR"\n')
    fake.chmod(0o755)
    return fake


def test_local_mode_ignores_a_dashboard_address_and_exports_the_launch_directory(tmp_path):
    fake = _env_printer(tmp_path)
    proc = _run(COMMON, "stapo", "qwen3_8b", cwd=tmp_path, PYTHON=str(fake), RAY_ADDRESS="http://head:8265")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["RAY_ADDRESS=<unset>", f"STAPO_LAUNCH_DIR={tmp_path}"]
    assert "dashboard address" in proc.stderr
    kept = _run(COMMON, "stapo", "qwen3_8b", cwd=tmp_path, PYTHON=str(fake), RAY_ADDRESS="head:6379")
    assert kept.stdout.splitlines()[0] == "RAY_ADDRESS=head:6379"


def test_local_mode_is_unchanged_and_paths_come_from_the_launch_directory(tmp_path):
    proc = _run(COMMON, "grpo", "qwen3_1_7b", cwd=tmp_path, STAPO_DRY_RUN="1", CKPT_DIR="ck", WANDB_API_KEY=SECRET,
                PYTHON="python3")
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    assert argv[:3] == ["python3", "-m", "recipe.stapo.main_stapo"]
    assert _value(argv, "trainer.default_local_dir") == str(tmp_path / "ck/stapo/qwen3_1_7b_grpo")
    assert SECRET not in proc.stdout + proc.stderr
    default = _run(COMMON, "grpo", "qwen3_1_7b", cwd=tmp_path, STAPO_DRY_RUN="1")
    assert _value(shlex.split(default.stdout), "trainer.default_local_dir") == str(REPO / "checkpoints/stapo/qwen3_1_7b_grpo")


def test_dry_run_check_validates_with_the_launching_shells_paths(tmp_path):
    from tests.helpers.cluster_files import QWEN3_CONFIGS, write_dataset, write_model

    write_model(tmp_path / "models" / "Qwen3-1.7B-Base", QWEN3_CONFIGS["Qwen3-1.7B-Base"])
    for name in ("train", "aime24_val"):  # the preflight reads them (docs/preflight.md)
        write_dataset(tmp_path / "rel" / "data" / f"{name}.parquet")
    proc = _run(COMMON, "stapo", "qwen3_1_7b", cwd=tmp_path, STAPO_DRY_RUN="check", PYTHON=sys.executable,
                STAPO_DATA_DIR="rel/data", STAPO_MODEL_DIR="models", CKPT_DIR="ck",
                WANDB_MODE="offline")  # the default LOGGER is wandb: no credentials on a test machine
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "config OK" in proc.stderr
    assert f"data.train_files = {tmp_path}/rel/data/train.parquet" in proc.stderr
    assert f"actor_rollout_ref.model.path = {tmp_path}/models/Qwen3-1.7B-Base" in proc.stderr
    assert f"trainer.default_local_dir = {tmp_path}/ck/stapo/qwen3_1_7b_stapo" in proc.stderr
    bad = _run(COMMON, "stapo", "qwen3_1_7b", "actor_rollout_ref.actor.policy_loss.loss_mode=stapoo", cwd=tmp_path,
               STAPO_DRY_RUN="check", PYTHON=sys.executable)
    assert bad.returncode != 0 and "actor_rollout_ref.actor.policy_loss.loss_mode='stapoo'" in bad.stderr


def test_the_jobs_interpreter_outside_the_project_is_not_warned_about(tmp_path):
    python = _python3(tmp_path / "env", with_requirements=True) / "python3"  # an environment outside the project
    proc = _run(COMMON, "stapo", "qwen3_8b", cwd=tmp_path, LAUNCH="submit", STAPO_DRY_RUN="1", PYTHON=str(python))
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    assert argv[argv.index("--") + 1] == str(python) and "is not uploaded with the job" not in proc.stderr


# ------------------------------------------------------------------------------------------------
# the run's names, the script's identity, each key once
# ------------------------------------------------------------------------------------------------


def _dry_command(tmp_path: Path, *args: str, script: str = "qwen3_8b_stapo.sh", **env) -> list[str]:
    """The overrides a run script hands Hydra (``STAPO_DRY_RUN=1``, local mode)."""
    proc = _run(REPO / "run_scripts" / script, *args, cwd=tmp_path, STAPO_DRY_RUN="1", PYTHON=sys.executable, **env)
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    assert argv[:3] == [sys.executable, "-m", "recipe.stapo.main_stapo"]
    return argv[3:]


@pytest.mark.parametrize("name", ["lr=1e-6", "it's a \"run\", v2", "null", "1e-6", "données", "a/b", "$x"])
def test_names_reach_hydra_as_written(tmp_path, name):
    """Hydra's grammar would read `=`, `,`, quotes and spaces, and type null or 1e-6: the names come quoted."""
    overrides = _dry_command(tmp_path, EXPERIMENT=name, PROJECT=f"p {name}", CKPT_DIR="ck")
    cfg = compose(overrides)
    OmegaConf.resolve(cfg)
    assert (cfg.trainer.project_name, cfg.trainer.experiment_name) == (f"p {name}", name)
    assert cfg.trainer.default_local_dir == f"{tmp_path}/ck/p {name}/{name}"


@pytest.mark.parametrize("env, named", [
    ({"EXPERIMENT": "${oc.env:HOME}"}, "EXPERIMENT=${oc.env:HOME}: '${' would be read as an interpolation"),
    ({"PROJECT": "a\\b"}, "PROJECT=a\\b: a backslash would be read as an escape"),
    ({"EXPERIMENT": "../.."}, "EXPERIMENT=../..: an absolute name or a '.' or '..' part would put the run's folder"),
    ({"PROJECT": ".."}, "PROJECT=..: an absolute name"),
    ({"EXPERIMENT": "/tmp/elsewhere"}, "EXPERIMENT=/tmp/elsewhere: an absolute name"),
    ({"EXPERIMENT": "runs/./x"}, "EXPERIMENT=runs/./x: an absolute name"),
    ({"CKPT_DIR": "ck${x}"}, "CKPT_DIR="),
])
def test_a_name_hydra_or_the_folder_cannot_keep_is_refused_naming_its_variable(tmp_path, env, named):
    for mode in ("local", "submit"):
        proc = _run(REPO / "run_scripts" / "qwen3_8b_stapo.sh", cwd=tmp_path, STAPO_DRY_RUN="1", LAUNCH=mode,
                    PYTHON=sys.executable, **env)
        assert proc.returncode == 2 and proc.stderr.startswith(named) and proc.stdout == "", proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script, override, instead", [
    ("qwen3_8b_stapo.sh", "method=grpo", "run run_scripts/qwen3_8b_grpo.sh instead"),
    ("qwen3_8b_stapo.sh", "model=qwen3_1_7b", "run run_scripts/qwen3_1.7b_stapo.sh instead"),
    ("qwen3_1.7b_grpo.sh", "model=qwen3_14b", "run run_scripts/qwen3_14b_grpo.sh instead"),
    ("qwen3_14b_justrl.sh", "~method", "drop the override"),
])
def test_a_run_script_refuses_an_override_contradicting_its_name(tmp_path, script, override, instead):
    proc = _run(REPO / "run_scripts" / script, override, cwd=tmp_path, STAPO_DRY_RUN="1", PYTHON=sys.executable)
    key = override.lstrip("~").split("=")[0]
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith(f"{script} runs {key}=") and f"the override {override} would train another {key}" in proc.stderr
    assert instead in proc.stderr
    agreeing = _dry_command(tmp_path, "method=stapo", "model=qwen3_8b")
    assert [o for o in agreeing if o.startswith(("method=", "model="))] == ["method=stapo", "model=qwen3_8b"]


@pytest.mark.parametrize("override, variable", [("trainer.experiment_name=mine", "EXPERIMENT"),
                                                ("+trainer.project_name=team", "PROJECT")])
def test_the_runs_names_come_from_their_variables_only(tmp_path, override, variable):
    """An override would rename the wandb run but leave the folder and the Ray job those of the default name."""
    proc = _run(REPO / "run_scripts" / "qwen3_8b_stapo.sh", override, cwd=tmp_path, STAPO_DRY_RUN="1",
                PYTHON=sys.executable)
    assert proc.returncode == 2 and proc.stderr.startswith(f"{override}: the run's names come from PROJECT and")
    assert f"set {variable} instead" in proc.stderr


def test_every_run_script_is_the_method_and_model_it_is_named_for(tmp_path):
    """What each of the 12 scripts hands the interpreter (a stand-in printing its arguments)."""
    fake = _fake_python(tmp_path)
    scripts = sorted((REPO / "run_scripts").glob("qwen3_*_*.sh"))
    assert len(scripts) == 12
    for script in scripts:
        proc = _run(script, cwd=tmp_path, PYTHON=str(fake))
        assert proc.returncode == 0, proc.stderr
        size, method = script.stem[len("qwen3_"):].split("_")
        argv = proc.stdout.splitlines()
        assert [a for a in argv if a.startswith(("method=", "model="))] == [f"method={method}",
                                                                           f"model=qwen3_{size.replace('.', '_')}"]


def test_a_dry_run_prints_each_key_once_with_its_final_value(tmp_path):
    overrides = _dry_command(tmp_path, "trainer.logger=[console,file]", "trainer.nnodes=2", "trainer.nnodes=1",
                             f"trainer.default_local_dir={tmp_path}/mine", "+trainer.extra=1", NNODES="4")
    keys = [o.split("=", 1)[0] for o in overrides]
    assert len(keys) == len(set(keys)), keys
    assert _value(overrides, "trainer.logger") == ["console", "file"] and _value(overrides, "trainer.nnodes") == 1
    assert _value(overrides, "trainer.default_local_dir") == f"{tmp_path}/mine"
    cfg = compose(overrides)
    assert (cfg.trainer.nnodes, list(cfg.trainer.logger), cfg.trainer.extra) == (1, ["console", "file"], 1)


def test_the_check_prints_what_the_config_runs_each_key_once(tmp_path):
    """STAPO_DRY_RUN=check: the summary of the validated config, not the command beside it."""
    from tests.helpers.cluster_files import fake_cluster

    proc = _run(REPO / "run_scripts" / "qwen3_1.7b_stapo.sh", "trainer.logger=[console,file]", cwd=tmp_path,
                STAPO_DRY_RUN="check", PYTHON=sys.executable, EXPERIMENT="lr=1e-6, it's", **fake_cluster(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == ""
    out = proc.stderr
    for key, value in [("trainer.logger", "['console', 'file']"), ("trainer.experiment_name", "lr=1e-6, it's"),
                       ("trainer.project_name", "stapo"), ("recipe.model", "qwen3_1_7b")]:
        assert out.count(f"{key} =") == 1 and f"  {key} = {value}\n" in out, out[-3000:]
    assert "trainer.logger=" not in out and "model=qwen3_1_7b" not in out


def test_unknown_launch_mode_fails(tmp_path):
    proc = _run(COMMON, "stapo", "qwen3_8b", cwd=tmp_path, LAUNCH="slurm", STAPO_DRY_RUN="1")
    assert proc.returncode == 2 and "LAUNCH: unknown mode 'slurm'" in proc.stderr


def test_checkpoints_are_bounded_by_default_and_overridable():
    cfg = compose(["method=stapo"])
    keep = cfg.trainer.max_actor_ckpt_to_keep
    assert isinstance(keep, int) and 1 <= keep <= 5
    # enough to resume and to fall back once
    assert keep >= 2
    assert compose(["method=stapo", "trainer.max_actor_ckpt_to_keep=null"]).trainer.max_actor_ckpt_to_keep is None


# ------------------------------------------------------------------------------------------------
# eval.sh: interpreter and output folder (the conversion of a verl checkpoint: tests/run_scripts/test_gpu_smoke_on_cpu.py)
# ------------------------------------------------------------------------------------------------


def _fake_python(tmp_path: Path) -> Path:
    """An interpreter stand-in that prints its argv (one per line) and exits."""
    fake = tmp_path / "fakepython"
    fake.write_text('#!/usr/bin/env bash\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    return fake


def test_eval_uses_python_not_a_stray_venv(tmp_path):
    """PYTHON when set; else a python3 on PATH that has the requirements (a cluster's environment) wins
    over a project .venv (which may hold the CPU stack)."""
    fake = _fake_python(tmp_path)
    proc = _run(EVAL, cwd=tmp_path, MODEL="Qwen/Qwen3-8B", PYTHON=str(fake))
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.splitlines()
    assert argv[:2] == ["-m", "recipe.stapo.eval.run_eval"]
    checkout = _checkout(tmp_path, venv=True)
    env_bin = tmp_path / "env"
    env_bin.mkdir()
    (env_bin / "python3").symlink_to(fake)  # answers the requirements check (exit 0), prints its arguments
    proc = _shell_run(checkout / "run_scripts" / "eval.sh", cwd=tmp_path, path=f"{env_bin}:/usr/bin:/bin",
                      MODEL="Qwen/Qwen3-8B")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[:2] == ["-m", "recipe.stapo.eval.run_eval"]
    assert f"[stapo] python: {env_bin}/python3 (python3 on PATH, not the project's .venv" in proc.stderr


def test_eval_without_a_model_names_the_cpu_preset(tmp_path):
    proc = _run(EVAL, cwd=tmp_path, PYTHON=str(_fake_python(tmp_path)))
    assert proc.returncode != 0 and proc.stdout == ""
    assert "set MODEL to a checkpoint" in proc.stderr and "PRESET=cpu: the quickstart tiny model on a CPU" in proc.stderr


@pytest.mark.parametrize("model, env, expected", [
    ("ckpt/stapo/qwen3_8b_stapo/global_step_300/actor/merged_hf", {}, "qwen3_8b_stapo_step300"),
    ("ckpt/stapo/qwen3_8b_grpo/global_step_300/actor/merged_hf", {}, "qwen3_8b_grpo_step300"),
    ("ckpt/stapo/qwen3_8b_stapo/global_step_200/actor/merged_hf", {}, "qwen3_8b_stapo_step200"),
    ("/models/stapo-8b/hf", {"SCALE": "8B", "METHOD": "STAPO"}, "8B_STAPO_stapo-8b_hf"),
    ("/models/grpo-8b/hf", {}, "grpo-8b_hf"),
    ("Qwen/Qwen3-8B", {}, "Qwen_Qwen3-8B"),
])
def test_eval_default_output_folder_is_unique_per_checkpoint(tmp_path, model, env, expected):
    if not model.startswith("/") and "global_step" in model:
        (tmp_path / model).mkdir(parents=True)
        (tmp_path / model / "config.json").write_text("{}")
        (tmp_path / model / "model.safetensors").write_text("")
    proc = _run(EVAL, cwd=tmp_path, MODEL=model, PYTHON=str(_fake_python(tmp_path)), **env)
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.splitlines()
    assert argv[argv.index("--out") + 1] == str(REPO / "results" / "eval" / expected)


@pytest.mark.parametrize("model", ["qwen3_1_7b", "qwen3_8b", "qwen3_14b"])
def test_throughput_settings_fit_the_longest_sequence(model):
    """Dynamic batch size in every pass, token budgets that hold the longest sequence (verl refuses a
    sequence longer than the budget), chunked entropy."""
    cfg = compose([f"model={model}"])
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    a, rollout, ref = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref
    # verl's engine worker asserts the update and the log-prob passes agree on dynamic batching
    assert a.use_dynamic_bsz and rollout.log_prob_use_dynamic_bsz and ref.log_prob_use_dynamic_bsz
    assert a.entropy_from_logits_with_chunking
    for budget in (a.ppo_max_token_len_per_gpu, rollout.log_prob_max_token_len_per_gpu,
                   ref.log_prob_max_token_len_per_gpu):
        assert budget >= longest and budget % longest == 0


def test_gpu_smoke_runs_compose_to_valid_one_node_configs(tmp_path):
    """GPU mode of run_scripts/gpu_smoke.sh (dry run): one command per method, each a valid verl config
    on one node with the local model, short lengths and a checkpoint at the last step."""
    from tests.helpers.verl_validation import validate
    from recipe.stapo.methods import PAPER_METHODS

    model = tmp_path / "Qwen3-1.7B-Base"
    model.mkdir()
    (model / "config.json").write_text("{}")
    proc = _run(REPO / "run_scripts" / "gpu_smoke.sh", cwd=tmp_path, MODEL="Qwen3-1.7B-Base", GPUS="8",
                STAPO_DRY_RUN="1", OUT="smoke")
    assert proc.returncode == 0, proc.stderr
    commands = [shlex.split(line) for line in proc.stdout.strip().splitlines()]
    assert [_value(c, "method") for c in commands] == list(PAPER_METHODS)
    for argv in commands:
        cfg = compose(argv[3:])
        validate(cfg)
        assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (1, 8)
        assert cfg.actor_rollout_ref.model.path == str(model)
        assert cfg.trainer.total_training_steps == cfg.trainer.save_freq == 2
        assert cfg.trainer.default_local_dir == str(tmp_path / "smoke" / cfg.recipe.method / "checkpoints")
        assert cfg.data.max_response_length <= 1024 and "wandb" not in cfg.trainer.logger


# ------------------------------------------------------------------------------------------------
# where a run's files go: the launch directory and the run's folder, whatever the driver's own directory
# ------------------------------------------------------------------------------------------------


def test_relative_overrides_are_taken_from_the_launch_directory_not_the_drivers(tmp_path, monkeypatch):
    """In submit mode the driver runs in Ray's copy of the project; STAPO_LAUNCH_DIR (exported by
    common.sh) is where the user launched."""
    from recipe.stapo.driver import RAY_ENV_VARS, resolve_paths

    launch, driver = tmp_path / "launch", tmp_path / "ray_working_dir"
    launch.mkdir(), driver.mkdir()
    monkeypatch.chdir(driver)
    monkeypatch.setenv("STAPO_LAUNCH_DIR", str(launch))
    for name in ("VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT", "TENSORBOARD_DIR", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STAPO_DATA_DIR", "rel/data")
    cfg = compose(["method=stapo", "recipe.token_dump.dir=dumps/run1", "trainer.default_local_dir=ck/p/e",
                   "trainer.rollout_data_dir=rollouts"])
    resolve_paths(cfg, log=lambda _: None)
    assert cfg.recipe.token_dump.dir == str(launch / "dumps/run1")
    assert cfg.trainer.default_local_dir == str(launch / "ck/p/e")
    assert cfg.trainer.rollout_data_dir == str(launch / "rollouts")
    assert cfg.data.train_files == str(launch / "rel/data/train.parquet")
    env_vars = OmegaConf.select(cfg, RAY_ENV_VARS)
    assert env_vars.STAPO_TOKEN_DUMP_DIR == str(launch / "dumps/run1")  # what the actors read
    assert env_vars.VERL_FILE_LOGGER_PATH == str(launch / "ck/p/e/metrics.jsonl")
    assert env_vars.TENSORBOARD_DIR == str(launch / "ck/p/e/tensorboard")
    assert "WANDB_DIR" not in env_vars
    assert not any(str(driver) in str(v) for v in OmegaConf.to_container(cfg, resolve=True).values())


def test_run_file_locations_set_by_the_user_are_kept_and_made_absolute(tmp_path, monkeypatch):
    from recipe.stapo.driver import RAY_ENV_VARS, resolve_paths

    monkeypatch.setenv("STAPO_LAUNCH_DIR", str(tmp_path))
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", "logs")
    monkeypatch.setenv("WANDB_DIR", "/abs/wandb")
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    cfg = compose(["method=stapo", f"++{RAY_ENV_VARS}.TENSORBOARD_DIR=tb"])
    resolve_paths(cfg, log=lambda _: None)
    env_vars = OmegaConf.select(cfg, RAY_ENV_VARS)
    assert env_vars.VERL_FILE_LOGGER_ROOT == str(tmp_path / "logs") and "VERL_FILE_LOGGER_PATH" not in env_vars
    assert env_vars.TENSORBOARD_DIR == str(tmp_path / "tb") and env_vars.WANDB_DIR == "/abs/wandb"


def _uploaded(root: Path) -> set[str]:
    """The files Ray's job client uploads from ``root`` with the recipe's excludes (Ray's own traversal,
    .gitignore included, as ``ray job submit --working-dir``)."""
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    from recipe.stapo.driver import WORKING_DIR_EXCLUDES

    found = set()
    _dir_travel(root, [_get_excludes(root, list(WORKING_DIR_EXCLUDES))],
                lambda p: found.add(str(p.relative_to(root))) if p.is_file() else None, include_gitignore=True)
    return found


def test_the_upload_ships_the_code_and_leaves_data_outputs_and_environments(tmp_path):
    shipped = ["recipe/stapo/data/prepare.py", "recipe/stapo/data/fixtures/dapo_sample.jsonl",
               "recipe/stapo/eval/results.py", "verl_patches/resume.py", "run_scripts/common.sh", "README.md"]
    left = ["data/stapo/train.parquet", "results/eval/x.json", "checkpoints/stapo/e/global_step_1/actor/m.pt",
            ".venv/bin/python", ".git/HEAD", "assets/tiny/model.safetensors", "wandb/run/x", "outputs/h/.hydra/c.yaml",
            "runs/dump/tokens.jsonl", "recipe/stapo/__pycache__/x.pyc", "stapo_recipe.egg-info/PKG-INFO"]
    for rel in shipped + left:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    (tmp_path / ".gitignore").write_text((REPO / ".gitignore").read_text())
    assert _uploaded(tmp_path) == set(shipped) | {".gitignore"}


def test_the_upload_of_this_checkout_holds_every_tracked_source_file():
    """Everything tracked but the tiny CPU assets (a cluster job never reads them)."""
    tracked = subprocess.run(["git", "ls-files", "recipe", "verl_patches", "stapo_core", "stapo_trl", "stapo_cpu",
                              "run_scripts"],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    shipped_assets = {f for f in tracked if f.startswith("stapo_cpu/shipped_assets/")}
    uploaded = _uploaded(REPO)
    assert tracked and shipped_assets and set(tracked) - shipped_assets <= uploaded
    assert not shipped_assets & uploaded


# ------------------------------------------------------------------------------------------------
# ablations.sh
# ------------------------------------------------------------------------------------------------

ABLATIONS = REPO / "run_scripts" / "ablations.sh"


def test_ablations_take_the_model_config_from_model_config_not_model(tmp_path):
    proc = _run(ABLATIONS, "q", cwd=tmp_path, STAPO_DRY_RUN="1", MODEL="/shared/models/Qwen3-8B-Base",
                MODEL_CONFIG="qwen3_8b")
    assert proc.returncode == 0, proc.stderr
    commands = [shlex.split(line) for line in proc.stdout.strip().splitlines()]
    assert [(_value(c, "model"), _value(c, "trainer.experiment_name"), _value(c, "actor_rollout_ref.actor.policy_loss.q"))
            for c in commands] == [("qwen3_8b", "qwen3_8b_stapo_q_0.5", 0.5), ("qwen3_8b", "qwen3_8b_stapo_q_0.9", 0.9)]
    assert "/shared/models" not in proc.stdout
    old = _run(ABLATIONS, "q", cwd=tmp_path, STAPO_DRY_RUN="1", MODEL="qwen3_8b")
    assert old.returncode == 2 and "MODEL_CONFIG" in old.stderr and not old.stdout
    bad = _run(ABLATIONS, "q", cwd=tmp_path, STAPO_DRY_RUN="1", MODEL_CONFIG="/shared/models/Qwen3-8B-Base")
    assert bad.returncode == 2 and "MODEL_CONFIG: unknown model config" in bad.stderr


def test_a_failed_ablation_run_does_not_stop_the_others(tmp_path):
    """Each run is attempted; the failed ones are listed and the loop exits 1."""
    fake = tmp_path / "failpython"
    fake.write_text('#!/usr/bin/env bash\nfor a in "$@"; do case "$a" in trainer.experiment_name=*) echo "${a#*=}";; esac; done\n'
                    'case "$*" in *tau_p=0.005*) exit 0;; *) exit 1;; esac\n')
    fake.chmod(0o755)
    proc = _run(ABLATIONS, "tau_p", cwd=tmp_path, PYTHON=str(fake))
    assert proc.stdout.split() == ["'qwen3_1_7b_stapo_tau_p_0.001'", "'qwen3_1_7b_stapo_tau_p_0.005'",
                                   "'qwen3_1_7b_stapo_tau_p_0.01'"]  # as Hydra receives them, quoted
    assert proc.returncode == 1
    assert "2 run(s) failed or were refused: qwen3_1_7b_stapo_tau_p_0.001 qwen3_1_7b_stapo_tau_p_0.01" in proc.stderr


# ------------------------------------------------------------------------------------------------
# which python the run scripts use (run_scripts/_python.sh)
# ------------------------------------------------------------------------------------------------


def _checkout(tmp_path: Path, venv: bool) -> Path:
    """The repository seen from another folder (its entries linked), with a project ``.venv`` (a link
    to this interpreter's environment) or without one."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in (".venv", ".git"):
            (checkout / entry.name).symlink_to(entry)
    if venv:
        (checkout / ".venv").symlink_to(Path(sys.prefix))
    return checkout


def _python3(folder: Path, with_requirements: bool) -> Path:
    """A folder whose ``python3`` is this interpreter, with its packages or without them (``-S``: no
    site-packages, as a system python3 that never had the requirements installed)."""
    folder.mkdir()
    (folder / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} {"" if with_requirements else "-S "}"$@"\n')
    (folder / "python3").chmod(0o755)
    return folder


def _shell_run(script: Path, *args: str, cwd: Path, path: str, **env) -> subprocess.CompletedProcess:
    """``script`` from a shell whose PATH is ``path`` and which sets no PYTHON."""
    full = {k: v for k, v in _env(**env).items() if k not in ("PYTHON", "VIRTUAL_ENV")}
    return subprocess.run(["bash", str(script), *args], cwd=cwd, env={**full, "PATH": path}, capture_output=True,
                          text=True, timeout=300)


def test_from_a_shell_without_the_venv_the_scripts_find_the_projects_venv(tmp_path):
    """PATH's python3 lacks the requirements (a shell that never activated .venv): the scripts run the
    project's .venv, and say nothing about it."""
    checkout = _checkout(tmp_path, venv=True)
    path = f"{_python3(tmp_path / 'bare', with_requirements=False)}:/usr/bin:/bin"
    proc = _shell_run(checkout / "run_scripts" / "common.sh", "stapo", "qwen3_8b", cwd=tmp_path, path=path,
                      LAUNCH="submit", STAPO_DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.strip().splitlines()
    argv = shlex.split(line)
    venv_python = str(checkout / ".venv" / "bin" / "python")
    assert argv[argv.index("--") + 1:][:3] == [venv_python, "-m", "recipe.stapo.main_stapo"]
    assert "[stapo] python:" not in proc.stderr
    # the upload leaves .venv out: the job starts only where the head node has this very path
    assert (f"[stapo] warning: the job runs {venv_python}, the project's .venv, which is not uploaded with the job"
            in proc.stderr)
    model = tmp_path / "Qwen3-1.7B-Base"
    model.mkdir()
    (model / "config.json").write_text("{}")
    smoke = _shell_run(checkout / "run_scripts" / "gpu_smoke.sh", cwd=tmp_path, path=path, MODEL=str(model),
                       STAPO_DRY_RUN="1", OUT="smoke")
    assert smoke.returncode == 0, smoke.stderr
    commands = [shlex.split(line) for line in smoke.stdout.strip().splitlines()]
    from recipe.stapo.methods import PAPER_METHODS

    assert [c[0] for c in commands] == [str(checkout / ".venv" / "bin" / "python")] * len(PAPER_METHODS)
    assert [_value(c, "method") for c in commands] == list(PAPER_METHODS)


def test_a_python3_with_the_requirements_is_used_and_named(tmp_path):
    checkout = _checkout(tmp_path, venv=True)
    env_bin = _python3(tmp_path / "env", with_requirements=True)
    proc = _shell_run(checkout / "run_scripts" / "common.sh", "stapo", "qwen3_8b", cwd=tmp_path,
                      path=f"{env_bin}:/usr/bin:/bin", LAUNCH="submit", STAPO_DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout.strip())
    assert argv[argv.index("--") + 1] == "python3"
    assert f"[stapo] python: {env_bin}/python3 (python3 on PATH, not the project's .venv" in proc.stderr


def test_without_a_venv_or_a_python3_with_the_requirements_the_scripts_say_how_to_get_one(tmp_path):
    checkout = _checkout(tmp_path, venv=False)
    bare = _python3(tmp_path / "bare", with_requirements=False)
    proc = _shell_run(checkout / "run_scripts" / "common.sh", "stapo", "qwen3_8b", cwd=tmp_path,
                      path=f"{bare}:/usr/bin:/bin", LAUNCH="submit", STAPO_DRY_RUN="1")
    assert proc.returncode == 2 and proc.stdout == ""
    assert (f"error: python3 ({bare}/python3) lacks the recipe's requirements (omegaconf, verl) and there is no "
            f"{checkout}/.venv: create it with 'bash run_scripts/test.sh'") in proc.stderr
    assert "Traceback" not in proc.stderr and "ModuleNotFoundError" not in proc.stderr


def test_every_run_script_finds_its_python_the_same_way():
    """Each script that runs the recipe's python sources run_scripts/_python.sh; none defaults to python3."""
    users = []
    for script in sorted((REPO / "run_scripts").glob("*.sh")):
        text = script.read_text()
        assert "${PYTHON:-python3}" not in text, script
        if '"$python"' in text:
            assert "source run_scripts/_python.sh" in text, script
            users.append(script.name)
    assert users == ["common.sh", "eval.sh", "gpu_smoke.sh"]
