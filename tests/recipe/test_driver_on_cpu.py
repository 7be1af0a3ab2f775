"""The driver (``python -m recipe.stapo.main_stapo``): config mistakes fail before Ray starts, naming
the key; ``--check`` / ``STAPO_DRY_RUN=1`` validates without starting anything; the config verl
receives is fully resolved in the launching shell (its environment, absolute paths) and carries no
secret. In process, verl's ``run_ppo`` replaced by a recorder (the real command line:
tests/recipe/test_preflight_on_cpu.py)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from recipe.stapo.driver import (CALCULATE_ENTROPY, compose, ensure_loss_statistics, forwarded_env,
                                       job_runtime_env, prepare)
from tests.helpers.cluster_files import QWEN3_CONFIGS, use_fake_cluster, write_dataset, write_model

PL = "actor_rollout_ref.actor.policy_loss"


@pytest.fixture(autouse=True)
def wandb_offline(monkeypatch):
    """The default config logs to wandb, and the preflight refuses it without credentials: these tests
    log offline (the smoke test's way), as a machine without a wandb login would."""
    monkeypatch.setenv("WANDB_MODE", "offline")


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """Stand-in shared storage (data, models, checkpoints) in the environment, cwd a scratch folder."""
    folders = use_fake_cluster(tmp_path / "shared", monkeypatch)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return folders


@pytest.fixture
def no_ray(monkeypatch):
    """verl's run_ppo (which starts Ray) replaced by a recorder: the configs it would have received."""
    import verl.trainer.main_ppo as verl_main

    received = []
    monkeypatch.setattr(verl_main, "run_ppo", lambda config, task_runner_class: received.append(config))
    return received


def test_unregistered_loss_mode_fails_in_driver_before_ray(cluster, no_ray):
    """No --check: on a config that passes verl's validation, the driver would go on to start Ray."""
    from recipe.stapo import main_stapo

    with pytest.raises(ValueError) as info:
        main_stapo.run(compose(["method=stapo", f"{PL}.loss_mode=stapoo", "trainer.nnodes=1", "trainer.n_gpus_per_node=1"]))
    assert f"{PL}.loss_mode='stapoo': not a registered policy loss" in str(info.value)
    assert "'vanilla'" in str(info.value) and "'gspo'" in str(info.value)  # the registry is listed
    assert no_ray == []


def test_unregistered_loss_mode_fails_in_prepare_naming_the_key(cluster):
    with pytest.raises(ValueError, match=rf"{PL}\.loss_mode='stapoo'"):
        prepare(compose(["method=stapo", f"{PL}.loss_mode=stapoo"]), log=lambda _: None)


@pytest.mark.parametrize("method", ["stapo", "entropy20"])
def test_current_statistics_switch_the_entropy_on(method):
    """Inside the loss (scope=micro_batch) the current statistics come from the update's forward."""
    logged = []
    cfg = compose([f"method={method}", f"{PL}.stats_from=current", f"{PL}.scope=micro_batch"])
    assert OmegaConf.select(cfg, CALCULATE_ENTROPY) is False
    assert ensure_loss_statistics(cfg, log=logged.append) == [f"{CALCULATE_ENTROPY}=true"]
    assert OmegaConf.select(cfg, CALCULATE_ENTROPY) is True
    assert len(logged) == 1 and CALCULATE_ENTROPY in logged[0] and "stats_from=current" in logged[0]


@pytest.mark.parametrize("overrides", [["method=stapo"], ["method=justrl"], ["method=entropy20"],
                                       ["method=entropy20", f"{PL}.stats_from=current"],  # mini-batch forward
                                       ["method=stapo", f"{PL}.stats_from=current", f"{PL}.scope=micro_batch",
                                        f"{CALCULATE_ENTROPY}=true"]])
def test_no_change_where_no_statistic_is_missing(overrides):
    cfg = compose(overrides)
    before = OmegaConf.select(cfg, CALCULATE_ENTROPY)
    assert ensure_loss_statistics(cfg, log=pytest.fail) == []
    assert OmegaConf.select(cfg, CALCULATE_ENTROPY) is before


def test_check_validates_the_whole_config_without_ray(cluster, no_ray, capsys):
    from recipe.stapo import main_stapo

    argv = ["main_stapo.py", "method=stapo", "--check"]
    assert main_stapo.check_requested(argv, environ={}) and argv == ["main_stapo.py", "method=stapo"]
    assert main_stapo.check_requested(["main_stapo.py"], environ={"STAPO_DRY_RUN": "1"})
    assert not main_stapo.check_requested(["main_stapo.py"], environ={"STAPO_DRY_RUN": "0"})
    main_stapo.run(compose(["method=stapo", "model=qwen3_1_7b", f"{PL}.stats_from=current",
                            f"{PL}.scope=micro_batch"]), check=True)
    out = capsys.readouterr().out
    assert "config OK" in out and f"{CALCULATE_ENTROPY}=true" in out
    assert "recipe.model = qwen3_1_7b" in out and "preflight passed" in out
    with pytest.raises(ValueError, match=rf"{PL}\.q=1\.5"):
        main_stapo.run(compose(["method=stapo", f"{PL}.q=1.5"]), check=True)
    assert no_ray == []


def test_config_verl_receives_is_resolved_in_the_launching_shell(tmp_path, monkeypatch):
    """The shell's STAPO_* values and absolute paths are baked in before ``run_ppo``: a Ray worker
    with another environment and working directory sees the same config."""
    import verl.trainer.main_ppo as verl_main

    from recipe.stapo import main_stapo

    write_model(tmp_path / "models" / "Qwen3-8B-Base", QWEN3_CONFIGS["Qwen3-8B-Base"])
    for name in ("train", "aime24_val"):
        write_dataset(tmp_path / "rel" / "data" / f"{name}.parquet")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LAUNCH", raising=False)
    monkeypatch.setenv("STAPO_DATA_DIR", "rel/data")
    monkeypatch.setenv("STAPO_MODEL_DIR", "models")
    received = []
    monkeypatch.setattr(verl_main, "run_ppo", lambda config, task_runner_class: received.append(config))
    cfg = compose(["method=stapo", "model=qwen3_8b", "trainer.default_local_dir=ckpt/run1",
                   "recipe.token_dump.dir=dumps"])
    main_stapo.run(cfg)
    (config,) = received
    # the worker's environment differs: nothing is left to resolve there
    monkeypatch.delenv("STAPO_DATA_DIR")
    monkeypatch.setenv("STAPO_MODEL_DIR", "/elsewhere")
    monkeypatch.chdir("/")
    raw = OmegaConf.to_container(config, resolve=False)
    assert "${" not in OmegaConf.to_yaml(raw)
    assert config.data.train_files == str(tmp_path / "rel/data/train.parquet")
    assert config.data.val_files == str(tmp_path / "rel/data/aime24_val.parquet")
    assert config.actor_rollout_ref.model.path == str(tmp_path / "models/Qwen3-8B-Base")
    assert config.trainer.default_local_dir == str(tmp_path / "ckpt/run1")
    env_vars = config.ray_kwargs.ray_init.runtime_env.env_vars
    assert env_vars.STAPO_TOKEN_DUMP_DIR == str(tmp_path / "dumps") == config.recipe.token_dump.dir
    assert env_vars.VERL_USE_EXTERNAL_MODULES.split(",")[0] == "verl_patches.activate"


def test_hub_model_id_is_kept(cluster, monkeypatch):
    monkeypatch.delenv("STAPO_MODEL_DIR", raising=False)
    logged = []
    cfg = prepare(compose(["method=justrl", "model=qwen3_1_7b"]), log=logged.append)
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen3-1.7B-Base"
    assert any("not a local folder" in line for line in logged)


SECRETS = {"WANDB_API_KEY": "wandb-secret-0123456789", "HF_TOKEN": "hf_secret_0123456789"}


def test_secrets_never_reach_the_hydra_config(cluster, monkeypatch):
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    cfg = prepare(compose(["method=stapo"]), log=lambda _: None)
    text = OmegaConf.to_yaml(cfg)
    for key, value in SECRETS.items():
        assert value not in text and key not in text


def test_submitted_job_carries_exactly_the_allowed_variables():
    environ = {"PATH": "/usr/bin", "HOME": "/root", "AWS_SECRET_ACCESS_KEY": "x", "WANDB_API_KEY": "k",
               "WANDB_PROJECT_SECRET_THING": "no", "STAPO_DRY_RUN": "1", "HF_TOKEN": "t", "HF_HOME": "/hf", "STAPO_DATA_DIR": "/d",
               "STAPO_MODEL_DIR": "/m", "VERL_USE_EXTERNAL_MODULES": "mymod", "CUDA_VISIBLE_DEVICES": "0"}
    assert forwarded_env(environ) == {"HF_HOME": "/hf", "HF_TOKEN": "t", "STAPO_DATA_DIR": "/d",
                                      "STAPO_MODEL_DIR": "/m", "VERL_USE_EXTERNAL_MODULES": "mymod",
                                      "WANDB_API_KEY": "k"}
    runtime_env = job_runtime_env(environ)
    assert runtime_env["env_vars"] == {"HF_HOME": "/hf", "HF_TOKEN": "t", "STAPO_DATA_DIR": "/d",
                                       "STAPO_MODEL_DIR": "/m", "VERL_USE_EXTERNAL_MODULES": "verl_patches.activate,mymod",
                                       "WANDB_API_KEY": "k", "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1"}
    assert {"/.git", "/.venv", "/data", "/checkpoints"} <= set(runtime_env["excludes"])  # anchored at the root
    # without a list of the submitting shell's, the node's own list (the CPU path's platform first) reaches the driver
    del environ["VERL_USE_EXTERNAL_MODULES"]
    assert "VERL_USE_EXTERNAL_MODULES" not in job_runtime_env(environ)["env_vars"]


def test_the_patch_module_goes_first_unless_a_module_is_listed_before_it():
    """The recipe's patch module is put first when missing; where it is listed, a module before it (a
    platform the patches need registered first, docs/cpu.md) keeps its place."""
    from recipe.stapo.driver import ensure_patch_module_env

    for given, expected in (("", "verl_patches.activate"), ("mymod", "verl_patches.activate,mymod"),
                            ("first.mod,verl_patches.activate,mymod", "first.mod,verl_patches.activate,mymod")):
        environ = {"VERL_USE_EXTERNAL_MODULES": given} if given else {}
        ensure_patch_module_env(environ)
        assert environ["VERL_USE_EXTERNAL_MODULES"] == expected


def _run_env(overrides, environ):
    from recipe.stapo.driver import ensure_wandb_resume

    cfg = compose(overrides)
    return ensure_wandb_resume(cfg, environ), cfg


def test_wandb_run_id_is_fixed_by_project_and_experiment():
    """verl's wandb.init passes no id: the driver gives every worker one that a resumed run repeats."""
    first, cfg = _run_env(["method=stapo", "trainer.experiment_name=a/b c"], {})
    again, _ = _run_env(["method=stapo", "trainer.experiment_name=a/b c"], {})
    other, _ = _run_env(["method=stapo", "trainer.experiment_name=a/b d"], {})
    project, _ = _run_env(["method=stapo", "trainer.experiment_name=a/b c", "trainer.project_name=p2"], {})
    assert first == again and first["WANDB_RESUME"] == "allow"
    assert len({first["WANDB_RUN_ID"], other["WANDB_RUN_ID"], project["WANDB_RUN_ID"]}) == 3
    assert not set("/\\#?%: ") & set(first["WANDB_RUN_ID"]) and first["WANDB_RUN_ID"].startswith("a-b-c-")
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.WANDB_RUN_ID == first["WANDB_RUN_ID"]
    mine, _ = _run_env(["method=stapo"], {"WANDB_RUN_ID": "mine", "WANDB_RESUME": "must"})
    assert mine == {"WANDB_RUN_ID": "mine", "WANDB_RESUME": "must"}
    none, cfg = _run_env(["method=stapo", "trainer.logger=[console,file]"], {})
    assert none == {} and "WANDB_RUN_ID" not in cfg.ray_kwargs.ray_init.runtime_env.env_vars


# ------------------------------------------------------------------------------------------------
# what Hydra and omegaconf would report as a lexer error or a traceback, named
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, named, fixed", [
    ("recipe.token_dump.responses=８", "'８' (FULLWIDTH DIGIT EIGHT)", "write it in ASCII: recipe.token_dump.responses=8"),
    ("trainer.save_freq=–1", "'–' (EN DASH)", "write it in ASCII: trainer.save_freq=-1"),
    ("trainer.nnodes=٨", "'٨' (ARABIC-INDIC DIGIT EIGHT)", "write it in ASCII: trainer.nnodes=8"),
    ("trainer.experiment_name=données", "'é' (LATIN SMALL LETTER E WITH ACUTE)",
     "quote the value: trainer.experiment_name='données'"),
])
def test_an_override_hydras_grammar_cannot_read_is_named_with_its_fix(override, named, fixed):
    """Hydra's lexer stopped at the character with "LexerNoViableAltException" and a caret."""
    with pytest.raises(ValueError) as info:
        compose(["method=stapo", override])
    text = str(info.value)
    assert named in text and fixed in text and "Hydra's override grammar reads unquoted" in text, text
    assert "LexerNoViableAltException" not in text
    if "quote the value" in fixed:  # the fix it names is read
        assert compose(["method=stapo", fixed.split(": ", 1)[1]]).trainer.experiment_name == "données"


@pytest.mark.parametrize("override", ["~actor_rollout_ref.actor.optim", "~actor_rollout_ref.actor.clip_ratio_low=0.2"])
def test_an_override_deleting_a_key_is_refused_naming_it(override):
    """A deleted key passed every check, and verl filled it with its config class's default: without its
    optim section the actor trained at FSDPOptimizerConfig's learning rate of 1e-3, not the recipe's 1e-6."""
    with pytest.raises(ValueError) as info:
        compose(["method=stapo", override])
    assert f"{override}: deletes a key, which verl then fills with its config class's default" in str(info.value)
    assert compose(["method=stapo", "actor_rollout_ref.actor.optim.lr=null"]).actor_rollout_ref.actor.optim.lr is None


@pytest.mark.parametrize("override, hint", [("+recipe.token_dump.respones=4", " (did you mean recipe.token_dump.responses?)"),
                                            ("++recipe.memory_chek=warn", " (did you mean recipe.memory_check?)"),
                                            ("+recipe.zzz=1", "")])
def test_a_key_added_to_the_recipes_section_that_it_does_not_have_is_refused(override, hint):
    """Hydra lets ``+key=`` add any key; in the recipe's own section nothing would read a new one (a typo
    trained silently with the default)."""
    with pytest.raises(ValueError) as info:
        compose(["method=stapo", override])
    key = override.lstrip("+").split("=")[0]
    assert f"{override}: {key} is not a key of the recipe's config, so nothing would read it{hint}; its keys: " \
        "recipe.method, recipe.model, recipe.token_dump, recipe.token_dump.dir" in str(info.value)
    assert compose(["method=stapo", "++recipe.memory_check=warn"]).recipe.memory_check == "warn"


def test_main_names_an_unreadable_override_before_hydra_reads_it(tmp_path):
    """The command line's overrides are Hydra's to parse: main names the character before Hydra's lexer error."""
    import os
    import subprocess
    import sys

    from tests.helpers.paths import REPO

    proc = subprocess.run([sys.executable, "-m", "recipe.stapo.main_stapo", "method=stapo",
                           "recipe.token_dump.responses=８", "--check"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "STAPO_LAUNCH_DIR": str(tmp_path)})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "override refused (nothing was started)" in proc.stderr
    assert "write it in ASCII: recipe.token_dump.responses=8" in proc.stderr
    assert "LexerNoViableAltException" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("override, key, missing", [
    ("trainer.experiment_name=${oc.env:STAPO_TEST_UNSET_VARIABLE}", "trainer.experiment_name",
     "Environment variable 'STAPO_TEST_UNSET_VARIABLE' not found"),
    ("trainer.nnodes=${trainer.no_such_key}", "trainer.nnodes", "Interpolation key 'trainer.no_such_key' not found"),
])
def test_an_interpolation_that_cannot_be_resolved_is_a_problem_naming_its_key(cluster, no_ray, monkeypatch, override,
                                                                              key, missing):
    """It was omegaconf's traceback out of main_stapo, naming the key that interpolates the broken one."""
    from recipe.stapo import main_stapo
    from recipe.stapo.preflight import PreflightError

    monkeypatch.delenv("STAPO_TEST_UNSET_VARIABLE", raising=False)
    with pytest.raises(PreflightError) as info:
        main_stapo.run(compose(["method=stapo", override]))
    (found,) = info.value.problems
    assert found.key == key and missing in found.problem and found.fix, found
    if "oc.env" in override:
        assert "export STAPO_TEST_UNSET_VARIABLE=<value>" in found.fix
    assert no_ray == []


def test_a_value_verls_config_classes_refuse_is_a_problem_naming_the_key(cluster, no_ray):
    """verl's own validation (its config dataclasses) raised a ValueError main_stapo showed as a traceback."""
    from recipe.stapo import main_stapo
    from recipe.stapo.preflight import PreflightError

    with pytest.raises(PreflightError) as info:
        main_stapo.run(compose(["method=stapo", "model=qwen3_1_7b", "trainer.nnodes=1", "trainer.n_gpus_per_node=8",
                                "trainer.logger=[console]", "actor_rollout_ref.actor.loss_agg_mode=bogus"]))
    (found,) = info.value.problems
    assert found.key == "actor_rollout_ref.actor.loss_agg_mode" and "Invalid loss_agg_mode: bogus" in found.problem, found
    assert no_ray == []


# ------------------------------------------------------------------------------------------------
# credentials never come as overrides
# ------------------------------------------------------------------------------------------------

SECRET = "wandb-secret-0123456789abcdef"


@pytest.mark.parametrize("key", ["ray_kwargs.ray_init.runtime_env.env_vars.WANDB_API_KEY", "x.HF_TOKEN", "x.hf_token",
                                 "x.RAY_AUTH_TOKEN", "x.aws_secret_access_key", "db.password", "x.OpenAI-Api-Key",
                                 "x.apikey", "x.token", "x.CLIENT_SECRET"])
def test_a_key_naming_a_credential_is_one(key):
    from recipe.stapo.driver import credential_keys

    assert credential_keys(key) == [key]


def test_no_key_of_the_recipes_configs_is_taken_for_a_credential():
    """TOKEN only as a key's last word: token budgets, the token dump and the tokenizer are not credentials."""
    from recipe.stapo.driver import MODELS, credential_keys
    from recipe.stapo.methods import METHODS

    def keys(node, prefix=""):
        for key, value in node.items():
            yield f"{prefix}{key}"
            if isinstance(value, dict):
                yield from keys(value, f"{prefix}{key}.")

    checked = set()
    for method in METHODS:
        for model in MODELS:
            checked |= set(keys(OmegaConf.to_container(compose([f"method={method}", f"model={model}"]))))
    assert {"actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "recipe.token_dump.dir",
            "ray_kwargs.ray_init.runtime_env.env_vars.STAPO_TOKEN_DUMP_DIR", "data.tokenizer"} <= checked
    assert [k for k in sorted(checked) if credential_keys(k)] == []
    for key in ("STAPO_SECRETS_FILE", "WANDB_IDENTITY_TOKEN_FILE", "max_num_batched_tokens", "token_selection"):
        assert credential_keys(f"ray_kwargs.ray_init.runtime_env.env_vars.{key}") == []


@pytest.mark.parametrize("override, keys", [
    (f"+ray_kwargs.ray_init.runtime_env.env_vars.WANDB_API_KEY={SECRET}",
     "ray_kwargs.ray_init.runtime_env.env_vars.WANDB_API_KEY"),
    (f"++ray_kwargs.ray_init.runtime_env.env_vars={{HF_TOKEN:{SECRET},A:{{db_password:{SECRET}}}}}",
     "ray_kwargs.ray_init.runtime_env.env_vars.HF_TOKEN, ray_kwargs.ray_init.runtime_env.env_vars.A.db_password"),
    (f"+x.hf_token={SECRET}８", "x.hf_token"),  # also unreadable to Hydra: named without repeating the value
])
def test_an_override_carrying_a_credential_is_refused_naming_its_key_and_the_ways_to_pass_it(override, keys):
    """What verl receives (and prints, and gives wandb as the run's config) is composed here: refused."""
    with pytest.raises(ValueError) as info:
        compose(["method=stapo", override])
    text = str(info.value)
    assert f"override refused: {keys}: names a credential" in text and SECRET not in text
    assert "export " in text and "STAPO_SECRETS_FILE" in text and "WANDB_API_KEY, HF_TOKEN, VLLM_API_KEY" in text


def test_main_refuses_a_credential_before_hydra_records_the_overrides(tmp_path):
    """Hydra writes every override to <launch dir>/outputs/.../.hydra/overrides.yaml once it starts."""
    import os
    import subprocess
    import sys

    from tests.helpers.paths import REPO

    override = f"+ray_kwargs.ray_init.runtime_env.env_vars.WANDB_API_KEY={SECRET}"
    proc = subprocess.run([sys.executable, "-m", "recipe.stapo.main_stapo", "method=stapo", override, "--check"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "STAPO_LAUNCH_DIR": str(tmp_path)})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "override refused (nothing was started)" in proc.stderr and "WANDB_API_KEY: names a credential" in proc.stderr
    assert SECRET not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no outputs/ folder: Hydra never started
