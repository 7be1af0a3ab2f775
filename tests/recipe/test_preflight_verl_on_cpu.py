"""verl's own validation before Ray (``recipe.stapo.preflight.verl_config``) and the resume inputs
(``recipe.stapo.preflight.paths.check_resume``): what verl's trainer, workers and dataset would refuse
after Ray starts, or run silently wrong, is refused by the driver's preflight in verl's words, naming
the key, file or column. Every case builds its input and runs ``recipe.stapo.driver.prepare`` on a
paper run (64 GPUs) composed on the stand-in cluster storage of tests/helpers/cluster_files.py."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recipe.stapo.preflight.verl_config import SAMPLE_ROWS
from tests.helpers.cluster_files import QWEN3_CONFIGS, write_dataset, write_model
from tests.recipe.test_preflight_on_cpu import ACTOR, ROLLOUT, cluster, paper, passes, problem, refused  # noqa: F401

RAY_AFTER = "after Ray"
FIXED_BATCHES = [f"{ACTOR}.use_dynamic_bsz=false", f"{ROLLOUT}.log_prob_use_dynamic_bsz=false",
                 "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=false"]


def _rows(n: int, **columns) -> pa.Table:
    """``n`` rows in verl's RL format, ``columns`` replacing or adding columns."""
    table = {"data_source": ["math_dapo"] * n,
             "prompt": [[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(n)],
             "reward_model": [{"style": "rule", "ground_truth": str(i + 1)} for i in range(n)],
             "extra_info": [{"index": i} for i in range(n)]}
    return pa.table({**table, **columns})


# ------------------------------------------------------------------------------------------------
# verl's dataset on the first rows of every data file
# ------------------------------------------------------------------------------------------------


def test_a_prompt_column_of_plain_text_is_refused_naming_the_file_and_the_column(cluster):
    """verl's dataset applies the chat template to each prompt and drops a row it fails on as if it were
    too long: plain-text prompts left no row, and the trainer stopped after Ray with num_samples=0,
    naming neither the file nor the column."""
    train = cluster["data"] / "train.parquet"
    pq.write_table(_rows(256, prompt=[f"What is {i} + 1?" for i in range(256)]), train)
    problem(refused(paper(cluster)), "data.train_files", f"{train}, column prompt", "chat template fails on row 0",
            "'str object' has no attribute 'role'", f"first {SAMPLE_ROWS} rows", "num_samples=0",
            "a list of chat messages")


def test_one_malformed_row_among_good_ones_is_refused_naming_its_row(cluster):
    """A row the template cannot take is dropped silently while the others train: named with its row."""
    prompts = [[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(256)]
    prompts[3] = [{"content": "no role"}]
    val = cluster["data"] / "aime24_val.parquet"
    pq.write_table(_rows(256, prompt=prompts), val)
    text = problem(refused(paper(cluster)), "data.val_files", f"{val}, column prompt", "fails on row 3",
                   f"on 0 more of the first {SAMPLE_ROWS} rows")
    assert "num_samples=0" not in text


def test_a_row_verls_dataset_cannot_read_is_refused_with_its_error(cluster):
    """``extra_info`` as text: verl's ``__getitem__`` reads it as a mapping, at the first batch after Ray."""
    train = cluster["data"] / "train.parquet"
    pq.write_table(_rows(256, extra_info=["index 0"] * 256), train)
    problem(refused(paper(cluster)), "data.train_files", "verl's dataset refuses the first rows", str(train),
            "'str' object has no attribute 'get'")


def test_training_files_whose_columns_differ_are_refused_as_verl_joins_them(cluster):
    """verl concatenates the training files into one dataset, which refuses columns of different types."""
    second = cluster["data"] / "more.parquet"
    pq.write_table(_rows(4, extra_info=[json.dumps({"index": i}) for i in range(4)]), second)
    problem(refused(paper(cluster, f"data.train_files=[{cluster['data'] / 'train.parquet'},{second}]")),
            "data.train_files", "verl's dataset refuses the first rows", str(second))


def test_prompts_all_longer_than_the_prompt_length_are_refused(cluster):
    """verl drops every prompt longer than data.max_prompt_length (data.filter_overlong_prompts): none left."""
    problem(refused(paper(cluster, "data.max_prompt_length=4")), "data.max_prompt_length",
            f"none of the first {SAMPLE_ROWS} rows", "the shortest: ", "num_samples=0")
    passes(paper(cluster, "data.max_prompt_length=64"))


def test_the_model_folder_verl_cannot_load_is_refused_with_the_loaders_words(cluster):
    """A tokenizer file that is not one: verl's model config (HFModelConfig) fails on it in the trainer."""
    folder = write_model(cluster["root"] / "models2" / "Qwen3-8B-Base", QWEN3_CONFIGS["Qwen3-8B-Base"])
    (folder / "tokenizer.json").write_text("{}")
    err = refused(paper(cluster, f"actor_rollout_ref.model.path={folder}"))
    (found,) = [p for p in err.problems if p.key.startswith("actor_rollout_ref.model")]
    assert "verl's HFModelConfig" in found.problem and RAY_AFTER in found.problem, found


# ------------------------------------------------------------------------------------------------
# verl's config classes, its optimizer builder and validate_config
# ------------------------------------------------------------------------------------------------


def test_an_optimizer_name_in_the_wrong_case_is_refused_with_the_class_it_means(cluster):
    """verl's builder looks the class up by name in torch.optim: 'adamw' failed at the model's init."""
    problem(refused(paper(cluster, f"{ACTOR}.optim.optimizer=adamw")), f"{ACTOR}.optim.optimizer",
            "='adamw'", "no class 'adamw' in torch.optim", f"did you mean {ACTOR}.optim.optimizer=AdamW?")


def test_a_tensor_parallel_group_larger_than_a_node_is_refused(cluster):
    problem(refused(paper(cluster, f"{ROLLOUT}.tensor_model_parallel_size=16")),
            f"{ROLLOUT}.tensor_model_parallel_size", "=16", "within one node of 8 GPUs",
            "trainer.n_gpus_per_node=8")


SIX_GPU_NODES = ["trainer.n_gpus_per_node=6", "data.train_batch_size=192", f"{ACTOR}.ppo_mini_batch_size=48"]


@pytest.mark.parametrize("override, heads, kv_heads, who", [
    (f"{ROLLOUT}.tensor_model_parallel_size=3", 32, 8, "vLLM"),  # 3 divides the 6 GPUs of a node, not the heads
    (f"{ACTOR}.ulysses_sequence_parallel_size=3", 32, 8, "verl's sequence parallelism"),
    (f"{ROLLOUT}.tensor_model_parallel_size=6", 36, 4, "vLLM"),  # the heads split, the key-value heads do not
])
def test_heads_the_parallel_group_does_not_split_are_refused(cluster, override, heads, kv_heads, who):
    """Read from the model's config.json: vLLM refuses such a tensor-parallel size when its engine
    starts, verl asserts it for sequence parallelism when it patches the model, both after Ray."""
    shape = dict(QWEN3_CONFIGS["Qwen3-8B-Base"], num_attention_heads=heads, num_key_value_heads=kv_heads)
    folder = write_model(cluster["root"] / "models2" / "Qwen3-8B-Base", shape)
    key = override.split("=")[0]
    problem(refused(paper(cluster, *SIX_GPU_NODES, override, f"actor_rollout_ref.model.path={folder}", method="justrl")),
            key, f"{heads} attention heads and {kv_heads} key-value heads", who, "use a size among")
    passes(paper(cluster, *SIX_GPU_NODES, method="justrl"))  # without that group: passes


@pytest.mark.parametrize("override, key, phrase", [
    # types verl's config classes declare (Hydra builds them without checking any)
    (f"{ACTOR}.entropy_coeff=abc", f"{ACTOR}.entropy_coeff", "must be a number (verl's FSDPActorConfig.entropy_coeff"),
    (f"{ACTOR}.use_torch_compile=yes", f"{ACTOR}.use_torch_compile", "must be true or false"),
    (f"{ACTOR}.data_loader_seed=1.5", f"{ACTOR}.data_loader_seed", "must be a whole number"),
    (f"{ACTOR}.kl_loss_type=[low_var_kl]", f"{ACTOR}.kl_loss_type", "must be text"),
    (f"{ACTOR}.optim.lr_warmup_steps=abc", f"{ACTOR}.optim.lr_warmup_steps", "must be a whole number or null"),
    (f"{ACTOR}.optim.num_cycles=abc", f"{ACTOR}.optim.num_cycles", "must be a number (verl's FSDPOptimizerConfig"),
    (f"{ACTOR}.optim.zero_indexed_step=2", f"{ACTOR}.optim.zero_indexed_step", "must be true or false"),
    (f"{ACTOR}.checkpoint.save_contents=model", f"{ACTOR}.checkpoint.save_contents", "must be a list"),
    (f"{ACTOR}.fsdp_config.param_offload=maybe", f"{ACTOR}.fsdp_config.param_offload", "must be true or false"),
    (f"{ROLLOUT}.seed=abc", f"{ROLLOUT}.seed", "must be a whole number (verl's RolloutConfig.seed"),
    (f"{ROLLOUT}.enforce_eager=maybe", f"{ROLLOUT}.enforce_eager", "verl reads any other value by its truth"),
    (f"{ROLLOUT}.val_kwargs.do_sample=maybe", f"{ROLLOUT}.val_kwargs.do_sample", "SamplingConfig.do_sample is true or false"),
    (f"{ROLLOUT}.agent.num_workers=abc", f"{ROLLOUT}.agent.num_workers", "must be a whole number"),
    (f"{ROLLOUT}.checkpoint_engine.update_weights_bucket_megabytes=1.5",
     f"{ROLLOUT}.checkpoint_engine.update_weights_bucket_megabytes", "must be a whole number"),
    ("actor_rollout_ref.model.enable_gradient_checkpointing=maybe", "actor_rollout_ref.model.enable_gradient_checkpointing",
     "HFModelConfig.enable_gradient_checkpointing is true or false"),
    ("algorithm.gamma=abc", "algorithm.gamma", "must be a number (verl's AlgoConfig.gamma"),
    ("algorithm.kl_ctrl.kl_coef=abc", "algorithm.kl_ctrl.kl_coef", "KLControlConfig.kl_coef"),
    (f"{ACTOR}.ppo_epochs=null", f"{ACTOR}.ppo_epochs", "must be a whole number >= 1"),
    # types of verl's defaults, in the sections it reads without a config class
    ("trainer.save_freq=abc", "trainer.save_freq", "must be a whole number (verl's default for it is -1)"),
    ("trainer.val_before_train=yes", "trainer.val_before_train", "must be true or false"),
    ("data.shuffle=maybe", "data.shuffle", "verl reads any other value by its truth"),
    ("trainer.critic_warmup=abc", "trainer.critic_warmup", "must be a whole number"),
    ("data.dataloader_num_workers=two", "data.dataloader_num_workers", "must be a whole number"),
    ("trainer.log_val_generations=null", "trainer.log_val_generations", "must be a whole number"),
    # what verl's config classes, its optimizer builder (torch's own checks) and validate_config refuse
    (f"{ACTOR}.optim.lr=-1e-6", f"{ACTOR}.optim.lr", "Invalid learning rate: -1e-06"),
    (f"{ACTOR}.optim.weight_decay=-0.1", f"{ACTOR}.optim.weight_decay", "Invalid weight_decay value: -0.1"),
    (f"{ACTOR}.optim.betas=[0.9,1.5]", f"{ACTOR}.optim.betas", "Invalid beta parameter at index 1: 1.5"),
    (f"{ACTOR}.optim.optimizer_impl=torch.optimz", f"{ACTOR}.optim.optimizer_impl", "Failed to import module 'torch.optimz'"),
    (f"{ACTOR}.optim.lr_scheduler_type=linear", f"{ACTOR}.optim.lr_scheduler_type",
     "assert self.lr_scheduler_type in"),
    (f"{ACTOR}.loss_agg_mode=token_mean", f"{ACTOR}.loss_agg_mode", "Invalid loss_agg_mode: token_mean"),
    (f"+{ACTOR}.ppo_mini_batchsize=64", f"{ACTOR}.ppo_mini_batchsize", "unexpected keyword argument 'ppo_mini_batchsize'"),
    (f"{ROLLOUT}.expert_parallel_size=3", f"{ROLLOUT}.expert_parallel_size",
     "expert_parallel_size must be equal to tensor_model_parallel_size * data_parallel_size"),
    (f"{ROLLOUT}.trace.max_samples_per_step_per_worker=-1", f"{ROLLOUT}.trace.max_samples_per_step_per_worker",
     "must be a non-negative integer or null"),
    (f"{ROLLOUT}.mode=sync", f"{ROLLOUT}.mode", "verl has no rollout 'vllm' in mode 'sync'"),
])
def test_a_verl_key_with_a_value_verl_refuses_after_ray_is_refused_before_it(cluster, override, key, phrase):
    """A sample of verl's keys across its config classes and plain sections, each out of range or of
    the wrong type: refused by the preflight in verl's words, naming the key."""
    text = problem(refused(paper(cluster, override)), key, phrase)
    assert RAY_AFTER in text or "verl reads any other value" in text or "(torch's own check)" in text, text


def test_what_verls_validate_config_refuses_is_named_by_the_key_it_names(cluster):
    """validate_config's own checks (here: both micro-batch settings of the log-prob pass)."""
    problem(refused(paper(cluster, *FIXED_BATCHES, f"{ROLLOUT}.log_prob_micro_batch_size=8")),
            f"{ROLLOUT}.log_prob_micro_batch_size", "verl's validate_config refuses it",
            f"You have set both '{ROLLOUT}.log_prob_micro_batch_size' AND")


def test_a_reference_section_is_built_as_the_worker_builds_it(cluster):
    """The worker renames the reference's log-prob keys before building its config: what verl refuses
    there is named by the key the user set."""
    key = "actor_rollout_ref.ref.log_prob_micro_batch_size"
    problem(refused(paper(cluster, *FIXED_BATCHES, f"{key}=8", method="grpo")), key, "verl's FSDPActorConfig",
            "You have set both 'actor.ppo_micro_batch_size' AND")
    passes(paper(cluster, *FIXED_BATCHES, method="grpo"))


# ------------------------------------------------------------------------------------------------
# resuming: verl's checkpoint tracker and resume_from_path
# ------------------------------------------------------------------------------------------------


def _checkpoint(run_dir, step: int, world: int = 64):
    actor = run_dir / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True)
    (actor / f"model_world_size_{world}_rank_0.pt").write_bytes(b"")
    return actor.parent


@pytest.mark.parametrize("content, phrase", [
    ("abc", "ValueError: invalid literal for int() with base 10: 'abc'"),
    ("", "ValueError: invalid literal for int() with base 10: ''"),
    ("global_step_100", "invalid literal for int() with base 10: 'global_step_100'"),
    (None, "IsADirectoryError"),
])
def test_a_checkpoint_tracker_verl_cannot_read_is_refused(cluster, content, phrase):
    """verl reads latest_checkpointed_iteration.txt as int() of its text, after Ray, the model load and vLLM's start."""
    run_dir = cluster["ckpt"] / "qwen3_8b_stapo"
    _checkpoint(run_dir, 100)
    tracker = run_dir / "latest_checkpointed_iteration.txt"
    tracker.mkdir() if content is None else tracker.write_text(content)
    problem(refused(paper(cluster)), "trainer.default_local_dir", str(tracker), phrase,
            "write the step of a checkpoint", "100 there", "trainer.resume_mode=disable")
    passes(paper(cluster, "trainer.resume_mode=disable"))


def test_a_tracker_naming_a_step_whose_folder_is_gone_is_refused(cluster):
    """verl trained from step 0 without a word when the tracker's checkpoint folder was missing."""
    run_dir = cluster["ckpt"] / "qwen3_8b_stapo"
    _checkpoint(run_dir, 100)
    (run_dir / "latest_checkpointed_iteration.txt").write_text("200")
    problem(refused(paper(cluster)), "trainer.default_local_dir", "names step 200",
            f"{run_dir / 'global_step_200'} does not exist", "from step 0 without a word", "(100 there)")
    (run_dir / "latest_checkpointed_iteration.txt").write_text("100\n")  # what verl writes: passes
    passes(paper(cluster))


def test_a_checkpoint_saved_on_another_gpu_count_is_refused(cluster):
    run_dir = cluster["ckpt"] / "qwen3_8b_stapo"
    _checkpoint(run_dir, 100, world=8)
    (run_dir / "latest_checkpointed_iteration.txt").write_text("100")
    problem(refused(paper(cluster)), "trainer.default_local_dir", "holds no model shards for 64 GPUs",
            "saved for: 8")
    passes(paper(cluster, "trainer.nnodes=1"))


def test_resume_from_path_with_a_trailing_slash_is_normalised_and_a_folder_inside_is_refused(cluster):
    """verl takes the step from what follows 'global_step_' in the path: '100/' or '100/actor' stopped the
    trainer after Ray. The driver makes the path absolute, which drops a trailing slash."""
    step = _checkpoint(cluster["ckpt"] / "elsewhere", 100)
    config = paper(cluster, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={step}/")
    passes(config)
    assert config.trainer.resume_from_path == str(step)
    problem(refused(paper(cluster, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={step}/actor")),
            "trainer.resume_from_path", "verl takes the step to resume at from the folder's name",
            "the global_step_<k> folder itself")


@pytest.mark.parametrize("key", [f"{ROLLOUT}.temperature", f"{ROLLOUT}.gpu_memory_utilization"])
def test_a_null_the_value_checks_refuse_is_their_problem_not_the_memory_models_traceback(cluster, key):
    """The memory estimate read the null as a number: a TypeError traceback out of the preflight."""
    problem(refused(paper(cluster, f"{key}=null")), key, "=None: must be a number")


@pytest.mark.parametrize("betas, words", [("[0.9,0.999,0.5]", "too many values to unpack"),
                                          ("[0.9]", "index out of range")])
def test_what_torchs_optimizer_reads_only_at_its_first_step_is_refused_naming_the_key(cluster, betas, words):
    """Three betas: AdamW takes them, then fails at the first update after Ray (too many values to unpack);
    one beta: AdamW fails on it when built. Neither message names the key: the line torch raised at does."""
    problem(refused(paper(cluster, f"{ACTOR}.optim.betas={betas}")), f"{ACTOR}.optim.betas", words)


def test_a_list_where_verl_has_a_number_is_refused(cluster):
    """Lists were let through wherever verl's default is not a config class's field: `save_freq=[5]` passed,
    then the trainer compared the list with 0 after Ray."""
    problem(refused(paper(cluster, "trainer.save_freq=[5]")), "trainer.save_freq", "must be a whole number")
