"""The preflight (``recipe.stapo.preflight``): every way a paper run can fail on the cluster, or run
silently wrong, is refused in the driver before Ray starts, each refusal naming the key or path and
the fix; a good config passes with a summary and the GPU memory table.

Every case runs in process on a stand-in for the cluster's storage (tests/helpers/cluster_files.py);
two tests run the real command line (``STAPO_DRY_RUN=check bash run_scripts/qwen3_1.7b_stapo.sh``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from recipe.stapo.driver import compose, prepare
from recipe.stapo.preflight import PreflightError, summary
from tests.helpers.cluster_files import QWEN3_CONFIGS, fake_cluster, use_fake_cluster, write_dataset, write_model
from tests.helpers.paths import REPO

PL = "actor_rollout_ref.actor.policy_loss"
ACTOR, ROLLOUT = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
#: what verl prints just before ray.init (verl.trainer.main_ppo.run_ppo)
RAY_INIT_MARK = "ray init kwargs"


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """The stand-in storage, its variables set as the run scripts set them; cwd is a scratch folder."""
    folders = use_fake_cluster(tmp_path / "shared", monkeypatch)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return {**folders, "root": tmp_path}


def paper(cluster, *overrides: str, method: str = "stapo", model: str = "qwen3_8b"):
    """A paper run's config as the run scripts compose it (64 GPUs), with ``overrides`` last."""
    return compose([f"method={method}", f"model={model}", "trainer.nnodes=8", "trainer.n_gpus_per_node=8",
                    "trainer.logger=[console]", f"trainer.default_local_dir={cluster['ckpt']}/{model}_{method}",
                    *overrides])


def passes(config, environ=None) -> list[str]:
    logged = []
    prepare(config, log=logged.append, environ=environ if environ is not None else {})
    return logged


def refused(config, environ=None) -> PreflightError:
    with pytest.raises(PreflightError) as info:
        prepare(config, log=lambda _: None, environ=environ if environ is not None else {})
    return info.value


def problem(err: PreflightError, key: str, *phrases: str) -> str:
    """The one refusal about ``key``, checked to contain every phrase and a fix."""
    matching = [str(p) for p in err.problems if p.key == key]
    assert len(matching) == 1, f"expected one problem about {key}, got:\n{err}"
    text = matching[0]
    assert "Fix: " in text and text.split("Fix: ", 1)[1].strip(), text
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in {text!r}"
    return text


# ------------------------------------------------------------------------------------------------
# a good config passes
# ------------------------------------------------------------------------------------------------


def test_paper_config_passes_with_summary_and_memory_table(cluster):
    config = paper(cluster)
    logged = "\n".join(passes(config))
    assert "preflight passed" in logged
    for name in ("rollout", "log_prob", "current", "update", "update_end"):
        assert f"  {name} " in logged, logged  # one row per pass of the step
    assert "target 79.1 GiB" in logged and "DOES NOT FIT" not in logged and "TIGHT" not in logged
    text = summary(config)
    for line in (f"{PL}.loss_mode = vanilla", f"{PL}.token_selection = s2t", f"{PL}.tau_p = 0.002", f"{PL}.q = 0.75",
                 f"{PL}.stats_from = current", f"{PL}.scope = mini_batch",
                 "reward.custom_reward_function = pkg://recipe.stapo.reward:compute_score", "GPUs = 64",
                 f"{ROLLOUT}.n = 8", "data.train_batch_size = 256 prompts = 2048 sequences per step",
                 "4 updates per step, 8 sequences per data-parallel rank",
                 "token budgets per GPU = update 32768, log-prob 49152"):
        assert line in text, f"{line!r} not in\n{text}"


# ------------------------------------------------------------------------------------------------
# paths
# ------------------------------------------------------------------------------------------------


def test_unwritable_checkpoint_folder_is_refused(cluster):
    blocker = cluster["root"] / "a_file"
    blocker.write_text("not a folder")
    err = refused(paper(cluster, f"trainer.default_local_dir={blocker}/ckpt"))
    problem(err, "trainer.default_local_dir", f"{blocker}/ckpt cannot be created or written", "CKPT_DIR")
    assert blocker.read_text() == "not a folder"


def test_missing_data_files_are_refused(cluster, monkeypatch):
    empty = cluster["root"] / "nodata"
    empty.mkdir()
    monkeypatch.setenv("STAPO_DATA_DIR", str(empty))
    err = refused(paper(cluster))
    problem(err, "data.train_files", f"{empty}/train.parquet does not exist", "recipe.stapo.data.prepare train")
    problem(err, "data.val_files", f"{empty}/aime24_val.parquet does not exist", "recipe.stapo.data.prepare bench")


def test_data_file_that_is_not_parquet_or_lacks_columns_is_refused(cluster):
    (cluster["data"] / "aime24_val.parquet").write_text("id,problem\n1,2+2\n")
    write_dataset(cluster["data"] / "train.parquet", drop=("reward_model",))
    err = refused(paper(cluster))
    problem(err, "data.val_files", "is not a parquet file")
    problem(err, "data.train_files", "has no column reward_model", "the run reads prompt, data_source and "
            "reward_model.ground_truth")


def test_a_training_set_smaller_than_one_batch_is_refused_naming_both_numbers(cluster):
    """verl's loader drops an incomplete batch: 255 prompts at 256 per step would train no step."""
    train = write_dataset(cluster["data"] / "train.parquet", rows=255)
    problem(refused(paper(cluster)), "data.train_files",
            f"{train} holds 255 prompts, fewer than one batch (data.train_batch_size=256)",
            "no training step would run",
            "train on at least 256 prompts, or set data.train_batch_size to at most 255")
    second = write_dataset(cluster["data"] / "more.parquet", rows=1)  # the files' rows together are the set
    assert "preflight passed" in "\n".join(passes(paper(cluster, f"data.train_files=[{train},{second}]")))
    problem(refused(paper(cluster, f"data.train_files=[{train},{second}]", "+data.gen_batch_size=512")),
            "data.train_files", f"{train}, {second} hold 256 prompts, fewer than one batch (data.gen_batch_size=512)",
            "set data.gen_batch_size to at most 256")


@pytest.mark.parametrize("case", ["missing", "empty", "no_config", "no_tokenizer", "no_weights"])
def test_model_folder_without_config_tokenizer_or_weights_is_refused(cluster, case):
    folder = cluster["root"] / "models2" / "Qwen3-8B-Base"
    if case == "empty":
        folder.mkdir(parents=True)
    elif case != "missing":
        write_model(folder, QWEN3_CONFIGS["Qwen3-8B-Base"], tokenizer=case != "no_tokenizer",
                    weights=case != "no_weights")
        if case == "no_config":
            (folder / "config.json").unlink()
    err = refused(paper(cluster, f"actor_rollout_ref.model.path={folder}"))
    phrase = {"missing": "does not exist", "empty": "is empty", "no_config": "no readable Hugging Face config.json",
              "no_tokenizer": "has no tokenizer", "no_weights": "has no weights"}[case]
    problem(err, "actor_rollout_ref.model.path", str(folder), phrase, "hf download")


# ------------------------------------------------------------------------------------------------
# names and identity
# ------------------------------------------------------------------------------------------------


def test_reward_function_typo_is_refused_with_the_closest_name(cluster):
    err = refused(paper(cluster, "reward.custom_reward_function.name=compute_score_lenientt"))
    problem(err, "reward.custom_reward_function.name", "'compute_score_lenientt'", "not a function of "
            "pkg://recipe.stapo.reward", "did you mean reward.custom_reward_function.name=compute_score_lenient?")


def test_unimportable_reward_module_is_refused(cluster):
    err = refused(paper(cluster, "reward.custom_reward_function.path=pkg://recipe.stapo.rewardz"))
    problem(err, "reward.custom_reward_function.path", "cannot be imported", "ModuleNotFoundError")


def test_unregistered_loss_mode_and_unknown_token_selection_are_refused(cluster):
    err = refused(paper(cluster, f"{PL}.loss_mode=stapoo", f"{PL}.token_selection=s3t"))
    problem(err, f"{PL}.loss_mode", "'stapoo'", "not a registered policy loss", "'vanilla'", "'gspo'")
    problem(err, PL, "token_selection='s3t'", "'s2t'", "'entropy_topk'")


@pytest.mark.parametrize("method, selection, expected", [("stapo", "none", "s2t"), ("entropy20", "s2t", "entropy_topk")])
def test_method_that_does_not_select_its_tokens_is_refused_unless_named_so(cluster, method, selection, expected):
    err = refused(paper(cluster, f"{PL}.token_selection={selection}", method=method))
    problem(err, f"{PL}.token_selection", f"='{selection}'", f"method={method} selects '{expected}'",
            f"'qwen3_8b_{method}' does not say otherwise", f"trainer.experiment_name=qwen3_8b_{method}_{selection}")
    named = paper(cluster, f"{PL}.token_selection={selection}", f"trainer.experiment_name=qwen3_8b_{method}_{selection}",
                  method=method)
    passes(named)
    assert f"{PL}.token_selection = {selection}" in summary(named)


# ------------------------------------------------------------------------------------------------
# numbers
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, key, phrase", [
    ("trainer.nnodes=abc", "trainer.nnodes", "='abc': the number of nodes must be a whole number >= 1"),
    ("trainer.nnodes=0", "trainer.nnodes", "=0: the number of nodes"),
    ("trainer.n_gpus_per_node=-8", "trainer.n_gpus_per_node", "=-8: the GPUs per node"),
    (f"{ROLLOUT}.n=0", f"{ROLLOUT}.n", "=0: the responses per prompt must be a whole number >= 1"),
    (f"{ROLLOUT}.n=1", f"{ROLLOUT}.n", "a group of one leaves the raw +-1 reward as the advantage"),
    ("data.train_batch_size=3", "data.train_batch_size",
     "3 prompts x 8 responses = 24 sequences per step do not split evenly over the 64 GPUs"),
    (f"{ACTOR}.ppo_mini_batch_size=48", f"{ACTOR}.ppo_mini_batch_size", "does not divide data.train_batch_size=256"),
    (f"{ACTOR}.ppo_mini_batch_size=4", f"{ACTOR}.ppo_mini_batch_size",
     "4 prompts x 8 responses = 32 sequences per update do not split evenly over the 64 data-parallel ranks"),
    (f"{ACTOR}.ppo_max_token_len_per_gpu=8192", f"{ACTOR}.ppo_max_token_len_per_gpu",
     "less than the longest sequence, data.max_prompt_length + data.max_response_length = 16384 tokens"),
    (f"{ROLLOUT}.log_prob_max_token_len_per_gpu=16000", f"{ROLLOUT}.log_prob_max_token_len_per_gpu",
     "=16000: less than the longest sequence"),
    (f"{ROLLOUT}.tensor_model_parallel_size=3", f"{ROLLOUT}.tensor_model_parallel_size",
     "do not divide the 64 GPUs"),
    ("recipe.gpu_mem_gb=abc", "recipe.gpu_mem_gb", "must be a positive number"),
])
def test_bad_number_is_refused_naming_the_key(cluster, override, key, phrase):
    problem(refused(paper(cluster, override)), key, phrase)


def test_micro_batch_must_divide_a_ranks_mini_batch_without_dynamic_batching(cluster):
    fixed = [f"{ACTOR}.use_dynamic_bsz=false", f"{ROLLOUT}.log_prob_use_dynamic_bsz=false",
             "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=false"]
    err = refused(paper(cluster, *fixed, f"{ACTOR}.ppo_micro_batch_size_per_gpu=3"))
    problem(err, f"{ACTOR}.ppo_micro_batch_size_per_gpu", "=3: does not divide the 8 sequences of a mini-batch")
    passes(paper(cluster, *fixed, f"{ACTOR}.ppo_micro_batch_size_per_gpu=2"))


def test_sequence_parallelism_lets_a_budget_go_below_the_longest_sequence(cluster):
    half = [f"{ACTOR}.ppo_max_token_len_per_gpu=8192", f"{ROLLOUT}.log_prob_max_token_len_per_gpu=8192"]
    passes(paper(cluster, *half, f"{ACTOR}.ulysses_sequence_parallel_size=2", method="justrl"))
    passes(paper(cluster, *half, f"{ACTOR}.ulysses_sequence_parallel_size=2", f"{PL}.stats_from=rollout"))
    problem(refused(paper(cluster, *half, f"{ACTOR}.ulysses_sequence_parallel_size=3", method="justrl")),
            f"{ACTOR}.ulysses_sequence_parallel_size", "=3: does not divide the 64 GPUs")


@pytest.mark.parametrize("method, overrides, what", [
    ("stapo", (), "s2t from the current policy (stats_from=current)"),
    ("entropy20", (f"{PL}.token_selection=entropy_topk_authors_code",  # named so: the identity check
                   "trainer.experiment_name=qwen3_8b_entropy20_entropy_topk_authors_code"),
     "entropy_topk_authors_code from the current policy (scope rank_micro_batch)"),
    ("justrl", (f"{PL}.s2t_monitor=true", f"{PL}.stats_from=current"), "the S2T monitor with stats_from=current"),
    ("stapo", (f"{PL}.stats_from=rollout", f"{PL}.update_effect_responses=2"), "update_effect_responses=2"),
])
def test_sequence_parallelism_with_a_current_policy_forward_is_refused(cluster, method, overrides, what):
    """verl's inference pass returns its output to one rank of each sequence-parallel group: the
    recipe's current-policy forwards are refused before Ray starts, naming the key and the reason."""
    half = [f"{ACTOR}.ppo_max_token_len_per_gpu=8192", f"{ROLLOUT}.log_prob_max_token_len_per_gpu=8192"]
    err = refused(paper(cluster, *half, f"{ACTOR}.ulysses_sequence_parallel_size=2", *overrides, method=method))
    problem(err, f"{ACTOR}.ulysses_sequence_parallel_size", f"not supported with {what}", "=1")
    passes(paper(cluster, *overrides, method=method))  # without sequence parallelism: fine


def test_a_pool_of_ranks_that_does_not_divide_the_data_parallel_ranks_is_refused_before_ray(cluster):
    """``ranks_per_pool`` is checked against the run's data-parallel size (GPUs / sequence parallel) here,
    not by the workers after Ray, the model load and the vLLM start; the authors' pool passes on 64 GPUs
    and its summary names the pool in tokens."""
    authors = [f"{PL}.stats_from=current", f"{PL}.scope=micro_batch", f"{ACTOR}.ppo_max_token_len_per_gpu=22528"]
    err = refused(paper(cluster, *authors, f"{PL}.ranks_per_pool=48", method="entropy20"))
    problem(err, f"{PL}.ranks_per_pool", "expected a divisor of the run's 64 data-parallel ranks",
            "one of [1, 2, 4, 8, 16, 32, 64]", "set it to a divisor of 64")
    half = [f"{ACTOR}.ppo_max_token_len_per_gpu=8192", f"{ROLLOUT}.log_prob_max_token_len_per_gpu=8192"]
    err = refused(paper(cluster, *half, f"{ACTOR}.ulysses_sequence_parallel_size=2", f"{PL}.ranks_per_pool=64",
                        method="entropy20"))
    problem(err, f"{PL}.ranks_per_pool", "run's 32 data-parallel ranks")
    config = paper(cluster, *authors, f"{PL}.ranks_per_pool=8", method="entropy20")
    passes(config)
    assert "token selection pool = up to 180,224 tokens per threshold" in summary(config)


def test_reference_budget_is_checked_where_a_reference_model_runs(cluster):
    key = "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"
    problem(refused(paper(cluster, f"{key}=1024", method="grpo")), key, "=1024: less than the longest sequence")
    passes(paper(cluster, f"{key}=1024", method="justrl"))  # no KL: no reference model


def test_token_dump_settings_and_folder_are_checked_when_it_is_on(cluster):
    blocker = cluster["root"] / "a_file"
    blocker.write_text("")
    err = refused(paper(cluster, f"recipe.token_dump.dir={blocker}/dump", "recipe.token_dump.responses=-3",
                        "recipe.token_dump.context=abc"))
    problem(err, "recipe.token_dump.dir", "cannot be created or written")
    problem(err, "recipe.token_dump.responses", "recipe.token_dump.responses=-3", "must be an integer >= 1")
    problem(err, "recipe.token_dump.context", "recipe.token_dump.context='abc'")
    passes(paper(cluster, "recipe.token_dump.responses=-3"))  # dump off: its settings are never read


def test_every_problem_is_listed_at_once(cluster):
    err = refused(paper(cluster, "trainer.nnodes=abc", f"{ROLLOUT}.n=1", "reward.custom_reward_function.name=nope",
                        f"{PL}.token_selection=none", "data.train_files=/nonexistent/train.parquet"))
    keys = {p.key for p in err.problems}
    assert {"trainer.nnodes", f"{ROLLOUT}.n", "reward.custom_reward_function.name", f"{PL}.token_selection",
            "data.train_files"} <= keys
    assert f"({len(err.problems)} problems; nothing was started)" in str(err)


# ------------------------------------------------------------------------------------------------
# GPU memory
# ------------------------------------------------------------------------------------------------


def _advised(text: str) -> list[str]:
    """The overrides a memory refusal's fix names first (``run with k=v k=v (...)``)."""
    return text.split("run with ", 1)[1].split(" (", 1)[0].split(" or with ")[0].split()


def test_config_that_does_not_fit_names_the_pass_and_a_budget_that_fits(cluster):
    key = f"{ROLLOUT}.log_prob_max_token_len_per_gpu"
    err = refused(paper(cluster, f"{key}=262144"))
    (text,) = [str(p) for p in err.problems if "pass 'log_prob'" in p.key]
    (budget,) = [int(o.split("=")[1]) for o in _advised(text) if o.startswith(f"{key}=")]
    assert 16384 <= budget < 262144
    passes(paper(cluster, f"{key}={budget}"))  # the value it names fits
    assert "pass 'log_prob'" in " ".join(p.key for p in refused(paper(cluster, f"{key}={budget + 2048}")).problems)


def test_a_model_too_large_for_one_gpu_is_refused_naming_more_gpus(cluster):
    one_gpu = ["trainer.nnodes=1", "trainer.n_gpus_per_node=1", f"{ROLLOUT}.tensor_model_parallel_size=1"]
    err = refused(paper(cluster, *one_gpu))
    (rollout,) = [str(p) for p in err.problems if "pass 'rollout'" in p.key]
    assert "only offload or more GPUs make it fit: run with trainer.n_gpus_per_node=" in rollout
    assert any("pass 'update" in p.key for p in err.problems)
    passes(paper(cluster, *one_gpu, *_advised(rollout)))


def test_target_gpu_memory_comes_from_gpu_mem_gb_and_warn_mode_refuses_nothing(cluster, monkeypatch):
    monkeypatch.setenv("GPU_MEM_GB", "24")
    err = refused(paper(cluster))
    assert all(p.key.startswith("GPU memory") for p in err.problems) and "24.0 GiB" in str(err)
    logged = "\n".join(passes(paper(cluster, "recipe.memory_check=warn")))
    assert "recipe.memory_check=warn" in logged and "DOES NOT FIT" in logged
    monkeypatch.setenv("GPU_MEM_GB", "141")
    assert "target 141.0 GiB" in "\n".join(passes(paper(cluster)))


@pytest.mark.parametrize("method", ["justrl", "grpo"])
def test_14b_on_one_node_is_refused_at_the_default_utilisation_and_passes_at_the_suggested_one(cluster, method):
    one_node = ["trainer.nnodes=1"]
    err = refused(paper(cluster, *one_node, method=method, model="qwen3_14b"))
    text = problem(err, f"GPU memory, pass 'rollout' ({ROLLOUT}.gpu_memory_utilization)",
                   f"run with {ROLLOUT}.gpu_memory_utilization=")
    (advised,) = _advised(text)
    assert float(advised.split("=")[1]) < 0.7
    logged = "\n".join(passes(paper(cluster, *one_node, advised, method=method, model="qwen3_14b")))
    assert "preflight passed" in logged and "DOES NOT FIT" not in logged and "TIGHT" not in logged


@pytest.mark.parametrize("model", ["qwen3_1_7b", "qwen3_8b"])
def test_1_7b_and_8b_pass_on_one_node_as_shipped(cluster, model):
    assert "preflight passed" in "\n".join(passes(paper(cluster, "trainer.nnodes=1", method="grpo", model=model)))


def test_a_pass_inside_the_margin_is_refused_unless_explicitly_accepted(cluster, monkeypatch):
    """Qwen3-14B on one node at gpu_memory_utilization 0.6: on a card reporting 68 GiB its rollout
    (about 66 GiB) fits the capacity but not the estimate's margin."""
    overrides = ["trainer.nnodes=1", f"{ROLLOUT}.gpu_memory_utilization=0.6"]
    monkeypatch.setenv("GPU_MEM_GB", "68")
    err = refused(paper(cluster, *overrides, method="justrl", model="qwen3_14b"))
    problem(err, f"GPU memory, pass 'rollout' ({ROLLOUT}.gpu_memory_utilization)", "not with the estimate's margin",
            "recipe.memory_accept_tight=true")
    logged = "\n".join(passes(paper(cluster, *overrides, "recipe.memory_accept_tight=true", method="justrl",
                                    model="qwen3_14b")))
    assert "TIGHT" in logged and "(recipe.memory_accept_tight=true): pass 'rollout'" in logged
    err = refused(paper(cluster, *overrides, "recipe.memory_accept_tight=yes", method="justrl", model="qwen3_14b"))
    problem(err, "recipe.memory_accept_tight", "must be true or false")
    # above the capacity the flag does not help
    monkeypatch.setenv("GPU_MEM_GB", "60")
    err = refused(paper(cluster, *overrides, "recipe.memory_accept_tight=true", method="justrl", model="qwen3_14b"))
    assert any("pass 'rollout'" in p.key for p in err.problems)


# ------------------------------------------------------------------------------------------------
# submit mode and the driver
# ------------------------------------------------------------------------------------------------


def test_submit_mode_leaves_unseen_paths_to_the_jobs_driver(cluster, monkeypatch):
    """LAUNCH=submit: what this machine cannot see is a note here; the job's driver (its environment
    has no LAUNCH) refuses the same config; the memory table uses the paper model's built-in shape."""
    remote = cluster["root"] / "not_mounted_here"
    monkeypatch.setenv("STAPO_DATA_DIR", f"{remote}/stapo/data")
    monkeypatch.setenv("STAPO_MODEL_DIR", f"{remote}/models")
    overrides = [f"trainer.default_local_dir={remote}/ckpt/run"]
    logged = "\n".join(passes(paper(cluster, *overrides), environ={"LAUNCH": "submit"}))
    assert f"{remote}/stapo/data/train.parquet is not visible here (LAUNCH=submit)" in logged
    assert f"{remote}/models/Qwen3-8B-Base is not visible here" in logged
    assert "built-in Qwen3-8B architecture" in logged
    err = refused(paper(cluster, *overrides), environ={})
    assert {"data.train_files", "data.val_files", "actor_rollout_ref.model.path"} <= {p.key for p in err.problems}
    # numbers and names are checked in submit mode as anywhere
    problem(refused(paper(cluster, *overrides, f"{ROLLOUT}.n=1"), environ={"LAUNCH": "submit"}), f"{ROLLOUT}.n")


def test_driver_refuses_before_ray(cluster, monkeypatch):
    """No --check: a refused config never reaches verl's run_ppo (which starts Ray)."""
    import verl.trainer.main_ppo as verl_main

    from recipe.stapo import main_stapo

    started = []
    monkeypatch.setattr(verl_main, "run_ppo", lambda *a, **k: started.append(a))
    with pytest.raises(PreflightError):
        main_stapo.run(paper(cluster, f"{ROLLOUT}.n=1"))
    assert started == []
    main_stapo.run(paper(cluster))
    assert len(started) == 1


def _script(cluster_env: dict, *args: str, **extra) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STAPO_", "LAUNCH", "CKPT_DIR", "GPU_MEM"))}
    env.update(cluster_env, STAPO_DRY_RUN="check", PYTHON=sys.executable, LOGGER="console", **extra)
    return subprocess.run(["bash", str(REPO / "run_scripts" / "qwen3_1.7b_stapo.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_check_command_passes_a_paper_run_and_prints_its_summary(tmp_path):
    proc = _script(fake_cluster(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for text in ("preflight passed", "GPU memory per GPU", "config OK (nothing started)",
                 f"{PL}.token_selection = s2t", "GPUs = 64"):
        assert text in proc.stderr, proc.stderr[-3000:]
    assert RAY_INIT_MARK not in proc.stdout + proc.stderr


def test_check_command_refuses_hostile_values_before_ray(tmp_path):
    env = fake_cluster(tmp_path)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = _script(env, f"{ROLLOUT}.n=1", "reward.custom_reward_function.name=compute_score_lenientt",
                   f"recipe.token_dump.dir={tmp_path}/dump", "recipe.token_dump.responses=abc",
                   CKPT_DIR=str(blocker), NNODES="abc")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for text in ("preflight refused the config (5 problems", "trainer.nnodes='abc'", f"{ROLLOUT}.n=1",
                 "compute_score_lenientt", "recipe.token_dump.responses='abc'", f"{blocker}/stapo/qwen3_1_7b_stapo"):
        assert text in out, out[-3000:]
    assert "Traceback" not in out and RAY_INIT_MARK not in out
    assert not (tmp_path / "dump").exists()


# ------------------------------------------------------------------------------------------------
# values verl would only trip over after Ray starts (recipe.stapo.preflight.values)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, key, phrase", [
    (f"{ACTOR}.optim.lr=abc", f"{ACTOR}.optim.lr", "='abc': must be a number (verl's FSDPOptimizerConfig.lr is a number)"),
    (f"{ACTOR}.ppo_epochs=0", f"{ACTOR}.ppo_epochs", "=0: must be a whole number >= 1"),
    ("trainer.test_freq=abc", "trainer.test_freq", "='abc': must be a whole number (verl's default for it is -1)"),
    ("trainer.total_training_steps=abc", "trainer.total_training_steps", "='abc': must be a whole number >= 1"),
    ("trainer.resume_mode=bogus", "trainer.resume_mode", "='bogus': must be one of auto, disable, resume_path"),
    (f"{ROLLOUT}.top_p=0", f"{ROLLOUT}.top_p", "=0: must be a number in (0, 1]"),
    (f"{ROLLOUT}.top_p=1.5", f"{ROLLOUT}.top_p", "=1.5: must be a number in (0, 1]"),
    (f"{ROLLOUT}.gpu_memory_utilization=0", f"{ROLLOUT}.gpu_memory_utilization", "=0: must be a number in (0, 1]"),
    (f"{ROLLOUT}.gpu_memory_utilization=-0.7", f"{ROLLOUT}.gpu_memory_utilization", "=-0.7: must be"),
    (f"{ROLLOUT}.val_kwargs.n=0", f"{ROLLOUT}.val_kwargs.n", "=0: must be a whole number >= 1"),
    (f"{ROLLOUT}.max_num_seqs=0", f"{ROLLOUT}.max_num_seqs", "=0: must be a whole number >= 1 (vLLM refuses it"),
    (f"{ROLLOUT}.max_num_batched_tokens=-1", f"{ROLLOUT}.max_num_batched_tokens", "=-1: must be a whole number >= 1"),
    (f"{ACTOR}.clip_ratio_high=-0.5", f"{ACTOR}.clip_ratio_high", "=-0.5: must be a number >= 0"),
    (f"{ACTOR}.clip_ratio_low=2", f"{ACTOR}.clip_ratio_low", "=2: must be a number in [0, 1)"),
    (f"{ACTOR}.clip_ratio_c=0.5", f"{ACTOR}.clip_ratio_c", "=0.5: must be a number > 1"),
    (f"{ROLLOUT}.temperature=0", f"{ROLLOUT}.temperature", "=0: must be a number > 0"),
    ("trainer.logger=[console,wandbb]", "trainer.logger", "'wandbb' is not one of verl's loggers"),
    ("recipe.gpu_mem_gb=true", "recipe.gpu_mem_gb", "must be a number, not true/false"),
])
def test_a_value_verl_refuses_only_after_ray_is_refused_naming_the_key(cluster, override, key, phrase):
    text = problem(refused(paper(cluster, override)), key, phrase)
    if key == "trainer.logger":
        assert "did you mean wandbb -> wandb" in text


@pytest.mark.parametrize("value, phrase", [
    ("", "GPU_MEM_GB='': set but empty"),
    ("[80]", "GPU_MEM_GB='[80]': not a positive number"),
    ("true", "GPU_MEM_GB='true': not a positive number"),
    ("0", "GPU_MEM_GB='0': not a positive number"),
])
def test_gpu_mem_gb_is_parsed_once_and_named(cluster, monkeypatch, value, phrase):
    monkeypatch.setenv("GPU_MEM_GB", value)
    err = refused(paper(cluster))
    assert [p.key for p in err.problems] == ["GPU_MEM_GB"]
    assert phrase in str(err) and "Fix: export GPU_MEM_GB=80" in str(err)


def test_a_second_launch_while_the_metrics_file_has_a_writer_is_refused_before_ray(cluster):
    """A local launch into a run folder whose trainer is still logging: refused in the driver (the
    logger would refuse it too, but only after Ray has started)."""
    from verl_patches.resume import claim_metrics_file

    run_dir = Path(cluster["ckpt"]) / "qwen3_8b_stapo"
    run_dir.mkdir(parents=True, exist_ok=True)
    passes(paper(cluster, "trainer.logger=[console,file]"))  # no writer: passes
    held = claim_metrics_file(run_dir / "metrics.jsonl")  # the running launch's logger
    try:
        err = refused(paper(cluster, "trainer.logger=[console,file]"))
        problem(err, "trainer.default_local_dir", f"{run_dir / 'metrics.jsonl'}: another process (pid {os.getpid()})")
    finally:
        held.close()
    passes(paper(cluster, "trainer.logger=[console,file]"))  # the writer is gone


def test_a_data_file_without_rows_is_named_as_empty_not_as_missing_columns(cluster):
    import pandas as pd

    pd.DataFrame([]).to_parquet(cluster["data"] / "aime24_val.parquet")  # 0 rows, and so no columns
    problem(refused(paper(cluster)), "data.val_files", f"{cluster['data']}/aime24_val.parquet has no rows")


# ------------------------------------------------------------------------------------------------
# what the run's processes read after Ray starts: environment variables and the reward's call
# ------------------------------------------------------------------------------------------------

RAY_ENV = "ray_kwargs.ray_init.runtime_env.env_vars"


@pytest.mark.parametrize("raw, phrase", [
    ("inf", "ZeroMQ's socket wait is a 32-bit count of milliseconds"),
    ("1e10", "ZeroMQ's socket wait is a 32-bit count of milliseconds"),
    ("0.0001", "a shorter wait fails every sync"),
    ("soon", "a wait is a positive number of seconds"),
])
def test_a_weight_sync_timeout_the_trainer_would_refuse_at_its_first_sync_is_refused_before_ray(cluster, raw, phrase):
    """Read by the trainer only at the first weight sync (after Ray, the model load and vLLM's start):
    checked here from where the workers will read it, the launching environment or the config's
    runtime env (which wins)."""
    name = "STAPO_WEIGHT_SYNC_TIMEOUT_S"
    problem(refused(paper(cluster), environ={name: raw}), name, f"{name}={raw!r}: expected seconds in [1, 2147483]",
            phrase, "(read by the trainer, at each weight sync")
    problem(refused(paper(cluster, f"++{RAY_ENV}.{name}={raw}")), f"{RAY_ENV}.{name}", phrase)
    passes(paper(cluster, f"++{RAY_ENV}.{name}=900"), environ={name: raw})  # the config's value is the one read
    passes(paper(cluster), environ={name: "1.5"})


def _reward_module(root: Path, source: str) -> Path:
    path = root / "my_reward.py"
    path.write_text(source)
    return path


@pytest.mark.parametrize("source, passing", [
    ("def score(solution_str, ground_truth):\n    return 0.0\n", False),
    ("def score(data_source, solution_str, ground_truth):\n    return 0.0\n", False),
    ("def score(*, data_source, solution_str, ground_truth, extra_info, must):\n    return 0.0\n", False),
    ("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n", True),
    ("def score(solution_str, ground_truth, **kwargs):\n    return 0.0\n", True),
    ("async def score(data_source, solution_str, ground_truth, extra_info, **kwargs):\n    return 0.0\n", True),
])
def test_a_reward_function_that_cannot_take_verls_call_is_refused_before_ray(cluster, source, passing):
    """verl's reward loop calls fn(data_source=, solution_str=, ground_truth=, extra_info=): a function
    that cannot take it fails at the first reward, after the first rollout."""
    module = _reward_module(cluster["root"], source)
    config = paper(cluster, f"reward.custom_reward_function.path={module}", "reward.custom_reward_function.name=score")
    if passing:
        passes(config)
    else:
        problem(refused(config), "reward.custom_reward_function.name", "cannot take the call verl's reward loop makes",
                "score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)",
                "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)")


def test_reward_kwargs_are_part_of_the_call_checked(cluster):
    module = _reward_module(cluster["root"], "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                             "    return 0.0\n")
    base = [f"reward.custom_reward_function.path={module}", "reward.custom_reward_function.name=score"]
    problem(refused(paper(cluster, *base, "+reward.custom_reward_function.reward_kwargs.scale=2")),
            "reward.custom_reward_function.name", "scale=...")


def test_the_recipes_own_reward_functions_take_verls_call(cluster):
    for name in ("compute_score", "compute_score_lenient"):
        passes(paper(cluster, f"reward.custom_reward_function.name={name}"))


def _minimal(**keys) -> "OmegaConf":
    config = OmegaConf.create({"trainer": {"device": "cuda", "logger": ["console"]}, "recipe": {}})
    for key, value in keys.items():
        OmegaConf.update(config, key.replace("__", "."), value, force_add=True)
    return config


@pytest.mark.parametrize("name, raw, phrase", [
    ("STAPO_REWARD_WORKERS", "abc", "STAPO_REWARD_WORKERS='abc': expected a whole number >= 1"),
    ("STAPO_REWARD_WORKERS", "0", "STAPO_REWARD_WORKERS='0'"),
    ("STAPO_SECRETS_FILE", "/nonexistent/secrets.env", "/nonexistent/secrets.env"),
])
def test_every_variable_the_runs_processes_read_is_read_before_ray(name, raw, phrase):
    from recipe.stapo.preflight.values import check_run_environment

    (found,) = check_run_environment(_minimal(), {name: raw})
    assert found.key == name and phrase in found.problem and found.fix, found
    (found,) = check_run_environment(_minimal(**{f"{RAY_ENV}.{name}": raw}), {})
    assert found.key == f"{RAY_ENV}.{name}" and phrase in found.problem, found
    assert check_run_environment(_minimal(**{f"{RAY_ENV}.{name}": ""}), {name: raw}) == []  # the config's wins


@pytest.mark.parametrize("raw, refused_", [("info", True), ("", True), ("10", True), ("DEBUG", False), ("WARNING", False)])
def test_verl_logging_level_is_read_as_verls_modules_read_it(raw, refused_):
    """Every verl module calls logger.setLevel(VERL_LOGGING_LEVEL) when imported: 'info' (lower case) or
    an empty value fails there, in the workers as in the driver."""
    from recipe.stapo.preflight.values import check_run_environment

    found = check_run_environment(_minimal(**{f"{RAY_ENV}.VERL_LOGGING_LEVEL": raw}), {})
    assert [p.key for p in found] == ([f"{RAY_ENV}.VERL_LOGGING_LEVEL"] if refused_ else []), found
    if refused_:
        assert f"VERL_LOGGING_LEVEL={raw!r} is not a logging level" in found[0].problem


def test_a_metrics_file_verls_logger_cannot_open_is_refused_before_ray(cluster, monkeypatch):
    """VERL_FILE_LOGGER_PATH (the driver passes it to the trainer in the runtime env) naming a folder, or a
    file under a file: verl's logger would fail when the trainer starts, after Ray."""
    folder = cluster["root"] / "a_folder"
    folder.mkdir()
    blocker = cluster["root"] / "a_file"
    blocker.write_text("")
    with_file = "trainer.logger=[console,file]"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(folder))
    problem(refused(paper(cluster, with_file)), f"{RAY_ENV}.VERL_FILE_LOGGER_PATH", "is a folder")
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", f"{blocker}/m.jsonl")
    problem(refused(paper(cluster, with_file)), f"{RAY_ENV}.VERL_FILE_LOGGER_PATH", "its folder cannot be written",
            "exists and is not a folder")
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(cluster["root"] / "new" / "m.jsonl"))
    passes(paper(cluster, with_file))
    assert not (cluster["root"] / "new").exists()  # the probe leaves nothing


@pytest.mark.parametrize("value, named, shown", [
    ("８０", "FULLWIDTH DIGIT EIGHT", "80"), ("٨٠", "ARABIC-INDIC DIGIT EIGHT", "80"), ("80\u00a0", "NO-BREAK SPACE", "80"),
])
def test_a_number_with_characters_other_than_ascii_is_named_not_an_omegaconf_error(cluster, monkeypatch, value, named,
                                                                                    shown):
    """Python's float reads full-width and Arabic-Indic digits (and strips a no-break space); the YAML's
    oc.decode does not, and failed with a parse error that did not name the variable."""
    monkeypatch.setenv("GPU_MEM_GB", value)
    problem(refused(paper(cluster)), "GPU_MEM_GB", "characters other than ASCII", named, f"export GPU_MEM_GB={shown}")


@pytest.mark.parametrize("source", ["env", "key"])
@pytest.mark.parametrize("value", ["1e9", "81920", "300"])
def test_a_gpu_memory_no_accelerator_has_is_refused(cluster, monkeypatch, source, value):
    """GPU_MEM_GB=1e9 (or MiB for GiB) made the memory check pass every config."""
    if source == "env":
        monkeypatch.setenv("GPU_MEM_GB", value)
        err = refused(paper(cluster))
    else:
        err = refused(paper(cluster, f"recipe.gpu_mem_gb={value}"))
    problem(err, "recipe.gpu_mem_gb", "more than any accelerator has (at most 288 GiB", "not MiB or bytes",
            "torch.cuda.get_device_properties(0).total_memory / 2**30")
    assert not [p for p in err.problems if p.key.startswith("GPU memory")]  # the estimate is not run on it


def test_gpu_mem_gb_and_recipe_gpu_mem_gb_must_agree(cluster, monkeypatch):
    """The YAML reads GPU_MEM_GB into recipe.gpu_mem_gb: an override of the key that disagrees with the
    variable would win without a word."""
    monkeypatch.setenv("GPU_MEM_GB", "40")
    problem(refused(paper(cluster, "recipe.gpu_mem_gb=139.8"), environ={"GPU_MEM_GB": "40"}), "recipe.gpu_mem_gb",
            "disagrees with the environment's GPU_MEM_GB='40'", "drop the override recipe.gpu_mem_gb=139.8")
    monkeypatch.setenv("GPU_MEM_GB", "139.8")
    passes(paper(cluster, "recipe.gpu_mem_gb=139.8"), environ={"GPU_MEM_GB": "139.8"})


def test_gpu_mem_gb_travels_with_a_submitted_job():
    """The job's own preflight checks the memory the launcher checked."""
    from recipe.stapo.driver import forwarded_env

    assert forwarded_env({"GPU_MEM_GB": "95", "PATH": "/bin"}) == {"GPU_MEM_GB": "95"}


def test_verls_cpu_platform_off_a_cpu_device_is_refused(cluster):
    """VERL_PLATFORM=cpu on the 64-GPU config selected a CPU platform in every process of a GPU run."""
    problem(refused(paper(cluster), environ={"VERL_PLATFORM": "cpu"}), "VERL_PLATFORM",
            "selects verl's CPU platform", "unset VERL_PLATFORM", "docs/cpu.md")


def test_an_empty_reward_path_is_refused_not_left_to_verls_default(cluster):
    """An empty path made verl grade with its own default for the data source (math_dapo without
    JustRL's strict box check): the run's reward silently changed."""
    problem(refused(paper(cluster, "reward.custom_reward_function.path=''")), "reward.custom_reward_function.path",
            "is empty: verl would then grade with its own default", "pkg://recipe.stapo.reward")
    passes(paper(cluster, "reward.custom_reward_function.path=pkg://verl.utils.reward_score",
                 "reward.custom_reward_function.name=default_compute_score"))  # verl's default, named: accepted


@pytest.mark.parametrize("name, value, key", [
    ("STAPO_TOKEN_DUMP_DIR", "/somewhere/dump", "recipe.token_dump.dir"),
    ("STAPO_TOKEN_DUMP_RESPONSES", "9", "recipe.token_dump.responses"),
])
def test_a_token_dump_variable_exported_in_the_shell_is_refused(cluster, name, value, key):
    """The config sets the dump's variables for every worker from recipe.token_dump: an exported one is
    never read (a dump asked for in the shell was silently off)."""
    problem(refused(paper(cluster), environ={name: value}), name, f"is exported as {value!r}, but every worker reads",
            f"set {key} instead, and unset {name}")


@pytest.mark.parametrize("name, value, phrase", [
    ("STAPO_DATA_DIR", "", "set but empty: it is the data folder"),
    ("STAPO_MODEL_DIR", "", "set but empty: it is the folder of the model folders"),
    ("STAPO_LAUNCH_DIR", "/nonexistent/launch", "is not a folder"),
])
def test_a_folder_variable_set_wrong_is_named_not_its_consequence(cluster, monkeypatch, name, value, phrase):
    """STAPO_DATA_DIR= made the data files /train.parquet, refused as missing without naming the variable."""
    monkeypatch.setenv(name, value)
    problem(refused(paper(cluster)), name, phrase)


def test_a_metrics_file_under_verl_file_logger_root_is_checked(cluster, monkeypatch):
    blocker = cluster["root"] / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(blocker))
    problem(refused(paper(cluster, "trainer.logger=[console,file]")), f"{RAY_ENV}.VERL_FILE_LOGGER_ROOT",
            f"the metrics file {blocker}/stapo/qwen3_8b_stapo.jsonl: its folder cannot be written")


@pytest.mark.parametrize("variable, value, phrase", [
    ("VERL_USE_EXTERNAL_MODULES", "verl_patches,no_such_module", "lists 'no_such_module', which cannot be imported"),
    ("STAPO_SECRETS_FILE", "/nonexistent/secrets.env", "STAPO_SECRETS_FILE=/nonexistent/secrets.env: cannot read it"),
    ("VERL_LOGGING_LEVEL", "debug", "VERL_LOGGING_LEVEL='debug' is not a logging level"),
])
def test_what_import_verl_reads_is_refused_before_hydra_loads_verls_config(tmp_path, variable, value, phrase):
    """A module verl cannot import, or a secrets file the patches cannot load, failed inside Hydra's
    config loading ("Could not load 'ppo_trainer'", "Error locating target ...") without naming either."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STAPO_", "LAUNCH", "CKPT_DIR", "GPU_MEM"))}
    env.update(fake_cluster(tmp_path), **{variable: value})
    proc = subprocess.run([sys.executable, "-m", "recipe.stapo.main_stapo", "--check"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "preflight refused the config (1 problem" in proc.stderr and phrase in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Could not load" not in proc.stderr and "Error locating" not in proc.stderr


# ------------------------------------------------------------------------------------------------
# the run's names and loggers, wandb (recipe.stapo.preflight.loggers)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, key", [
    ("trainer.experiment_name=''", "trainer.experiment_name"), ("trainer.experiment_name='  '", "trainer.experiment_name"),
    ("trainer.project_name=''", "trainer.project_name"), ("trainer.experiment_name=null", "trainer.experiment_name"),
])
def test_an_empty_run_name_is_refused(cluster, override, key):
    """An empty experiment name filed the run in its project's folder (verl's default checkpoint folder),
    as a hidden '.jsonl' under VERL_FILE_LOGGER_ROOT, as an unnamed wandb run."""
    problem(refused(paper(cluster, override)), key, "is empty: the project and experiment names name the run")


@pytest.mark.parametrize("project", ["team/stapo", "stapo:v2", "p" * 129])
def test_a_project_name_wandb_refuses_is_refused_with_the_wandb_logger(cluster, project):
    """wandb.init refused it when the trainer's tracker started, after Ray, the model load and vLLM's start."""
    wandb_offline = {"WANDB_MODE": "offline"}
    problem(refused(paper(cluster, f"trainer.project_name={project}", "trainer.logger=[console,wandb]"),
                    environ=wandb_offline), "trainer.project_name", "wandb refuses it as a project name")
    passes(paper(cluster, f"trainer.project_name={project}"), environ=wandb_offline)  # no wandb: a folder name


def test_an_empty_logger_list_is_refused(cluster):
    """A run that records no metric at all."""
    problem(refused(paper(cluster, "trainer.logger=[]")), "trainer.logger", "the run would record no metric at all")


def test_a_logger_whose_package_is_missing_is_refused(cluster, monkeypatch):
    """verl imports the backend's package when the tracker starts: ImportError after Ray."""
    from recipe.stapo.preflight import loggers

    monkeypatch.setitem(loggers.LOGGER_PACKAGES, "mlflow", "stapo_test_no_such_package")
    problem(refused(paper(cluster, "trainer.logger=[console,mlflow]")), "trainer.logger",
            "the mlflow logger needs the package stapo_test_no_such_package, which is not installed")


@pytest.fixture
def no_wandb_login(tmp_path, monkeypatch):
    """A netrc file without a wandb entry (wandb reads NETRC first), no WANDB_* variable."""
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.org login me password secret\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    for name in [n for n in os.environ if n.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    return netrc


def test_the_wandb_logger_without_credentials_is_refused(cluster, no_wandb_login, tmp_path):
    """wandb.init stopped with "No API key configured" when the tracker started, after Ray."""
    with_wandb = paper(cluster, "trainer.logger=[console,wandb]")
    problem(refused(with_wandb), "trainer.logger", "the wandb logger has no credentials",
            "no netrc entry for https://api.wandb.ai", "wandb login")
    problem(refused(paper(cluster, "trainer.logger=[console,wandb]"), environ={"WANDB_API_KEY": "too-short"}),
            "trainer.logger", "has a WANDB_API_KEY wandb refuses")
    key = "k" * 40
    for environ in ({"WANDB_MODE": "offline"}, {"WANDB_MODE": "disabled"}, {"WANDB_API_KEY": key},
                    {"LAUNCH": "submit"}):  # submit: the job's driver checks it on the head node
        passes(paper(cluster, "trainer.logger=[console,wandb]"), environ=environ)
    secrets = tmp_path / "secrets.env"
    secrets.write_text(f"WANDB_API_KEY={key}\n")
    secrets.chmod(0o600)
    passes(paper(cluster, "trainer.logger=[console,wandb]"), environ={"STAPO_SECRETS_FILE": str(secrets)})
    no_wandb_login.write_text(f"machine api.wandb.ai\n  login user\n  password {key}\n")  # what `wandb login` writes
    passes(paper(cluster, "trainer.logger=[console,wandb]"), environ={})


@pytest.mark.parametrize("name, value, phrase", [
    ("WANDB_RESUME", "bogus", "Input should be 'allow', 'must', 'never' or 'auto'"),
    ("WANDB_RUN_ID", "team/run", "Run ID cannot contain the characters"),
    ("WANDB_MODE", "offlin", "Input should be 'online', 'offline'"),
])
def test_a_wandb_variable_wandb_refuses_is_refused_naming_it(cluster, monkeypatch, name, value, phrase):
    """Read by wandb's own settings reader, as wandb.init reads it in the trainer after Ray (the driver
    passes WANDB_RUN_ID and WANDB_RESUME to every worker in the config's runtime env)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv(name, value)
    err = refused(paper(cluster, "trainer.logger=[console,wandb]"), environ=dict(os.environ))
    (found,) = [p for p in err.problems if p.key.endswith(name)]
    assert "wandb refuses it" in found.problem and phrase in found.problem and found.fix, found


@pytest.mark.parametrize("variable, logger", [("TENSORBOARD_DIR", "tensorboard"), ("WANDB_DIR", "wandb")])
def test_a_logger_folder_that_cannot_be_written_is_refused(cluster, monkeypatch, variable, logger):
    """The folder the driver passes to every worker (made absolute, in the config's runtime env)."""
    blocker = cluster["root"] / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv(variable, str(blocker))
    problem(refused(paper(cluster, f"trainer.logger=[console,{logger}]"), environ=dict(os.environ)),
            f"{RAY_ENV}.{variable}", "exists and is not a folder", f"the {logger} logger writes there")
    monkeypatch.setenv(variable, str(cluster["root"] / "new"))
    passes(paper(cluster, f"trainer.logger=[console,{logger}]"), environ=dict(os.environ))
    assert not (cluster["root"] / "new").exists()


# ------------------------------------------------------------------------------------------------
# values the bad-input sweep found passing, each failing or running wrong after Ray
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, key", [
    (f"{ACTOR}.use_kl_loss=flase", f"{ACTOR}.use_kl_loss"),  # a config class's bool (FSDPActorConfig)
    ("algorithm.norm_adv_by_std_in_grpo=maybe", "algorithm.norm_adv_by_std_in_grpo"),  # AlgoConfig
    ("trainer.use_v1=maybe", "trainer.use_v1"),  # a section without a config class
    ("data.filter_overlong_prompts=0", "data.filter_overlong_prompts"),
])
def test_a_bool_given_as_another_value_is_refused(cluster, override, key):
    """verl reads a bool by its truth: use_kl_loss=flase ran with the KL loss and a reference model."""
    problem(refused(paper(cluster, override)), key, "must be true or false", "verl reads any other value by its truth")


@pytest.mark.parametrize("override, key, phrase", [
    (f"{ACTOR}.strategy=bogus", f"{ACTOR}.strategy", "must be fsdp or fsdp2"),
    (f"{ROLLOUT}.name=bogus", f"{ROLLOUT}.name", "verl has no rollout 'bogus' in mode 'async'"),
    (f"{ROLLOUT}.mode=sync", f"{ROLLOUT}.mode", "verl has no rollout 'vllm' in mode 'sync'"),
])
def test_an_engine_verl_looks_up_after_ray_is_refused(cluster, override, key, phrase):
    problem(refused(paper(cluster, override)), key, phrase, "after Ray")


def test_a_rollout_whose_engine_is_not_installed_is_refused(cluster, monkeypatch):
    from recipe.stapo.preflight import values

    monkeypatch.setitem(values.ROLLOUT_PACKAGES, "sglang", "stapo_test_no_such_package")
    problem(refused(paper(cluster, f"{ROLLOUT}.name=sglang")), f"{ROLLOUT}.name",
            "the sglang rollout needs the package stapo_test_no_such_package, which is not installed")


def test_a_step_larger_than_the_trainers_memory_is_refused(cluster):
    """rollout.n=1e9 passed every check: the trainer holds the whole step and fails in its first step."""
    err = refused(paper(cluster, f"{ROLLOUT}.n=1000000000"))
    problem(err, f"{ROLLOUT}.n", "256 prompts x 1000000000 responses of up to 1024 + 15360 tokens", "more than this "
            "machine's", "the paper: 8")
    passes(paper(cluster, f"{ROLLOUT}.n=1000000000"), environ={"LAUNCH": "submit"})  # the job's driver checks it
    from omegaconf import OmegaConf

    from recipe.stapo.preflight.numbers import check_step_host_memory

    config = OmegaConf.create({"data": {"train_batch_size": 256, "max_prompt_length": 1024, "max_response_length": 15360},
                               "actor_rollout_ref": {"rollout": {"n": 8}}})
    found = []
    check_step_host_memory(config, found, memory=256 * 8 * 16384 * 24)  # the bound itself: fits
    assert found == []
    check_step_host_memory(config, found, memory=256 * 8 * 16384 * 24 - 1)
    assert [p.key for p in found] == [f"{ROLLOUT}.n"] and "at most 7 here" in found[0].fix


def test_a_random_strategy_seed_no_generator_takes_is_refused_at_the_bound_the_loss_fails(cluster):
    """The random strategy seeds rank r's generator with seed x 1,000,003 + r: a larger seed passed the
    preflight and failed in the first update ("Overflow when unpacking long long")."""
    import torch

    from recipe.stapo.preflight.names import random_seed_range
    from verl_patches.policy_loss_config import TokenSelectionLossConfig
    from verl_patches.token_selection import select_tokens

    low, high = random_seed_range(64)
    for seed in (low - 1, high + 1):
        problem(refused(paper(cluster, f"{PL}.strategy=random", f"{PL}.seed={seed}")), f"{PL}.seed",
                f"on 64 ranks the seed must lie in [{low}, {high}]")
    passes(paper(cluster, f"{PL}.strategy=random", f"{PL}.seed={high}"))
    passes(paper(cluster, f"{PL}.seed={high + 1}"))  # low_entropy draws nothing
    low, high = random_seed_range(1)  # one rank (rank 0), the loss's own generator at the bounds

    def select(seed: int):
        shape = (2, 4)
        return select_tokens(TokenSelectionLossConfig(token_selection="s2t", strategy="random", seed=seed),
                             log_prob=torch.full(shape, -7.0), entropy=torch.full(shape, 0.01),
                             advantages=torch.ones(shape), response_mask=torch.ones(shape))

    select(high), select(low)
    for seed in (high + 1, low - 1):
        with pytest.raises((ValueError, RuntimeError)):
            select(seed)


def test_the_cpu_device_without_verls_cpu_platform_is_refused(cluster):
    """trainer.device=cpu on the 64-GPU config passed, skipping the memory check; verl's GPU code paths
    would have run on the CPU. With VERL_PLATFORM=cpu the device is not refused."""
    problem(refused(paper(cluster, "trainer.device=cpu")), "trainer.device", "without VERL_PLATFORM=cpu",
            "a CPU run sets trainer.device=cpu, VERL_PLATFORM=cpu", "docs/cpu.md")
    passes(paper(cluster, "trainer.device=cpu"), environ={"VERL_PLATFORM": "cpu"})


def test_a_metrics_files_writer_lock_the_logger_cannot_take_is_refused(cluster):
    """A folder where the writer lock goes passed the preflight and stopped the logger with
    IsADirectoryError when the trainer started, after Ray."""
    from verl_patches.resume import writer_lock_path

    metrics = cluster["ckpt"] / "qwen3_8b_stapo" / "metrics.jsonl"
    writer_lock_path(metrics).mkdir(parents=True)
    problem(refused(paper(cluster, "trainer.logger=[console,file]")), f"{RAY_ENV}.VERL_FILE_LOGGER_PATH",
            "its writer lock", "is not a file", "remove it")
    writer_lock_path(metrics).rmdir()
    passes(paper(cluster, "trainer.logger=[console,file]"))
