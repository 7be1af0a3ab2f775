"""Every change the recipe makes to verl 0.9.1, in one table, and the function that applies it.

:func:`install` runs when :mod:`verl_patches.activate` is imported (how that happens in every process:
the intro of :func:`table`); importing this module applies nothing. The behaviour lives in the modules
each entry names. ``python -m verl_patches`` prints the table (docs/verl_patches.md is that output).
"""

from __future__ import annotations

from .env_file import load_secrets_file
from .registry import Patch, apply, apply_on_import, check_verl_version, render_table

_ENGINE_WORKERS = "verl.workers.engine_workers"
_LEGACY_TRAINER = "verl.trainer.ppo.ray_trainer:RayPPOTrainer"
_V1_TRAINER = "verl.trainer.ppo.v1.trainer_base:PPOTrainer"
_FSDP_ENGINE = "verl/workers/engine/fsdp/transformer_impl.py"

#: the recipe's patches, in the order they are applied
PATCHES: tuple[Patch, ...] = (
    # -- TRL beside verl (the recipe's TRL adapter installs TRL 1.x) ------------------------------
    Patch(
        name="trl_without_value_head",
        target="verl.models.transformers.monkey_patch:is_trl_available",
        wrapper="verl_patches.trl_compat:wrap_is_trl_available",
        changes="reports TRL as unavailable when the installed TRL has no AutoModelForCausalLMWithValueHead",
        why="verl imports that class in apply_monkey_patch whenever TRL is installed; TRL 1.x (the trl extra) "
            "dropped it, so every model build failed",
        relies_on="apply_monkey_patch reading the module-level is_trl_available only to patch the value-head class",
        drop_when="verl imports the value-head class only where the installed TRL has it",
        anchors=("verl/utils/import_utils.py: def is_trl_available():",
                 "if is_trl_available():", "from trl import AutoModelForCausalLMWithValueHead"),
    ),
    # -- token selection (STAPO's S2T, 20-Entropy) in the actor -----------------------------------
    Patch(
        name="ppo_loss_token_selection",
        target=f"{_ENGINE_WORKERS}:ppo_loss",
        wrapper="verl_patches.losses:wrap_ppo_loss",
        changes="token selection inside the loss (scope=micro_batch; a rule of its own scope: 20-Entropy's "
                "entropy_topk_authors_code, per rank with the authors' weighting); a sequence-level ratio over every response token "
                "(sequence_ratio=all_tokens); a mini-batch whose every token is silenced gets a token/sequence "
                "count of 1 instead of 0 (all-zero sums give a loss of 0, not NaN)",
        why="verl's ppo_loss hands the policy loss no entropy and no extra batch field",
        relies_on="engine_workers binding partial(ppo_loss, config=...) by its module-level name in init_model",
        drop_when="verl lets a policy loss see the model output and the micro-batch",
        anchors=("verl/workers/utils/losses.py: def ppo_loss(config: ActorConfig, model_output, data: TensorDict, "
                 "dp_group=None)",
                 "self.loss_fn = partial(ppo_loss, config=actor_config)",
                 # geo_mean's mean over the kept sequences corrects this micro-batch mean
                 "verl/trainer/ppo/core_algos.py: pg_loss = torch.mean(pg_losses)"),
    ),
    Patch(
        name="mini_batch_fold",
        target=f"{_ENGINE_WORKERS}:TrainingWorker.train_batch",
        wrapper="verl_patches.mini_batch:wrap_train_batch",
        changes="before each mini-batch's update: its position in the step, the keep mask folded into "
                "response_mask/loss_mask (scope=mini_batch), the current-policy forward (stats_from=current; S2T: "
                "the positive-advantage sequences only, spread over the data-parallel ranks by tokens), "
                "the S2T monitor (s2t_monitor), the token dump's scoring, the probe of the update (the update "
                "effect's and the token dump's rows); after it: the probe's second forward; their metrics join verl's",
        why="S2T's quantile is pooled over the whole mini-batch, and verl counts the loss tokens before the "
            "first micro-batch: the mask must be in place before that count",
        relies_on="train_mini_batch calling train_batch once per mini-batch, flagging the last with "
                  "update_lr_scheduler=True; train_batch returning a TensorDict with a 'metrics' entry",
        drop_when="verl offers a per-mini-batch hook before its token count",
        anchors=("def train_batch(self, data: TensorDict)",
                 "update_lr_scheduler=batch_idx == total_num_iterations - 1",
                 "actor_output = self.train_batch(mini_batch_td)",
                 f"{_FSDP_ENGINE}: batch_num_tokens = data[\"loss_mask\"].sum()"),
    ),
    Patch(
        name="statistic_only_entropy",
        target=f"{_ENGINE_WORKERS}:TrainingWorker.set_loss_fn",
        wrapper="verl_patches.current_stats:wrap_set_loss_fn",
        changes="with stats_from=current, scope=micro_batch and no entropy bonus, the update's entropy is "
                "computed without autograd",
        why="the entropy is only S2T's statistic there; with autograd verl keeps every chunk's float32 "
            "softmax for a backward that contributes nothing (2.6x peak memory of the loss path)",
        relies_on="the engine computing entropy through engine.compute_entropy_from_logits",
        drop_when="verl computes a statistic-only entropy without autograd",
        anchors=("def set_loss_fn(self, loss_fn)",
                 f"{_FSDP_ENGINE}: entropy_rmpad = self.compute_entropy_from_logits("),
    ),
    Patch(
        name="selection_pool_groups",
        target=f"{_ENGINE_WORKERS}:ActorRolloutRefWorker.init_model",
        wrapper="verl_patches.selection_pool:wrap_init_model",
        changes="with policy_loss.ranks_per_pool=k, once the actor is built, every rank creates the process groups "
                "of k contiguous data-parallel ranks its token selection pools over (all groups, on every rank, "
                "in one order); a k that does not divide the data-parallel size stops the worker naming the key",
        why="20-Entropy's authors computed their top-20% threshold within one sequence-parallel group of 8 GPUs; "
            "verl offers no process group between one rank and the whole data-parallel group, and "
            "torch.distributed.new_group must be called by every rank at the same point",
        relies_on="init_model building the actor (self.actor, a TrainingWorker with loss_fn = partial(ppo_loss, "
                  "config=...)) on every rank of the worker group; engine.get_data_parallel_group()",
        drop_when="never (a recipe setting); rewrite if verl builds the actor elsewhere",
        anchors=("def init_model(self):",
                 "self.loss_fn = partial(ppo_loss, config=actor_config)",
                 "self.actor = self.actor_worker_cls(config=actor_training_config)"),
    ),
    Patch(
        name="chunked_sum_pi_squared",
        target="verl.utils.torch_functional:calculate_sum_pi_squared_from_logits",
        wrapper="verl_patches.sum_pi_squared:wrap_calculate_sum_pi_squared",
        changes="sum_n pi_n^2 is computed 2048 rows of logits at a time, in float32",
        why="verl computes it over the whole (tokens x vocab) logits at once; under autocast its two float32 "
            "logsumexp temporaries need about 10 bytes per logit (75 GB at a 49k-token budget and Qwen3's vocabulary)",
        relies_on="the FSDP engine calling it as verl_F.calculate_sum_pi_squared_from_logits(logits) (a module "
                  "attribute looked up at each call)",
        drop_when="verl chunks the sum of squared probabilities",
        anchors=("def calculate_sum_pi_squared_from_logits(logits: torch.Tensor)",
                 f"{_FSDP_ENGINE}: verl_F.calculate_sum_pi_squared_from_logits(logits_rmpad)"),
    ),
    # -- the weight sync to vLLM ----------------------------------------------------------------
    Patch(
        name="weight_sync_timeout",
        target="verl.workers.rollout.vllm_rollout.bucketed_weight_transfer:BucketedWeightSender._init_socket",
        wrapper="verl_patches.weight_sync:wrap_init_socket",
        changes="the trainer's weight-sync socket gives up on a send or receive after $STAPO_WEIGHT_SYNC_TIMEOUT_S "
                "seconds (600 by default)",
        why="when the vLLM side of the sync fails, verl waits for its acknowledgement forever: the run hangs "
            "instead of ending with an error",
        relies_on="BucketedWeightSender creating its ZeroMQ REQ socket in _init_socket and blocking on "
                  "socket.recv() for each acknowledgement",
        drop_when="verl bounds the weight sync's waits",
        anchors=("def _init_socket(self):",
                 "self.socket = self.zmq_context.socket(zmq.REQ)", "self.socket.recv()"),
        obsolete_if="zmq.RCVTIMEO",
    ),
    Patch(
        name="weight_sync_timeout_error",
        target="verl.workers.rollout.vllm_rollout.bucketed_weight_transfer:BucketedWeightSender.async_send_weights",
        wrapper="verl_patches.weight_sync:wrap_async_send_weights",
        changes="a send or receive that gave up raises WeightSyncTimeout naming the socket, the wait and where "
                "the receiver's error is logged",
        why="ZeroMQ's own exception says only 'Resource temporarily unavailable'",
        relies_on="async_send_weights letting the socket's zmq.Again propagate",
        drop_when="verl bounds the weight sync's waits",
        anchors=("async def async_send_weights(self, weights):",
                 "self._init_socket()"),
        obsolete_if="zmq.RCVTIMEO",
    ),
    # -- resuming a run (relaunching the same command) -------------------------------------------
    Patch(
        name="resumable_file_logger",
        target="verl.utils.tracking:FileLogger",
        wrapper="verl_patches.resume:wrap_file_logger",
        changes="the metrics file is kept on open; the first step a process logs ends the earlier launches' "
                "history there (the records it replaces are copied to <file>.superseded.<n> first), a step logged "
                "again is merged into its record: every step appears once; an unreadable line is moved to "
                "<file>.unreadable; a second writer of the file, under any name, is refused",
        why="verl's FileLogger opens its file with 'wb', so a relaunch (the way to resume) wipes every earlier step",
        relies_on="Tracking building FileLogger(project_name, experiment_name) by its module-level name; the path "
                  "rule VERL_FILE_LOGGER_PATH, else VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl",
        drop_when="verl's file logger appends and de-duplicates steps on resume",
        anchors=("def __init__(self, project_name: str, experiment_name: str):",
                 'self.logger["file"] = FileLogger(project_name, experiment_name)',
                 'os.getenv("VERL_FILE_LOGGER_PATH", None)', 'os.getenv("VERL_FILE_LOGGER_ROOT", ".")',
                 'f"{self.experiment_name}.jsonl"'),
    ),
    Patch(
        name="retention_counts_earlier_launches",
        target="verl.utils.checkpoint.fsdp_checkpoint_manager:FSDPCheckpointManager.save_checkpoint",
        wrapper="verl_patches.resume:wrap_checkpoint_save",
        changes="before a manager's first save, the global_step_<k>/<role> folders of earlier launches (k below the "
                "step saved) join the list verl prunes from, so max_actor_ckpt_to_keep counts them",
        why="verl prunes only the checkpoints saved by its own process: those from before a resume are never removed "
            "(~100 GB each at 8B)",
        relies_on="save_checkpoint(local_path=<dir>/global_step_<n>/<role>, ...) pruning previous_saved_paths (oldest "
                  "first) on rank 0",
        drop_when="verl's checkpoint manager discovers existing checkpoints for retention",
        anchors=("def save_checkpoint(self, local_path: str,",
                 "self.register_checkpoint(local_path, max_ckpt_to_keep)",
                 "verl/utils/checkpoint/checkpoint_manager.py: self.previous_saved_paths.append(new_path)",
                 "verl/utils/checkpoint/checkpoint_manager.py: "
                 "self.remove_previous_save_local_path(self.previous_saved_paths[:keep_start])"),
    ),
    # -- the trainers (driver side) ---------------------------------------------------------------
    Patch(
        name="legacy_keep_rollout_entropy",
        target=f"{_LEGACY_TRAINER}._compute_old_log_prob",
        wrapper="verl_patches.trainers:wrap_legacy_old_log_prob",
        changes="the rollout-time entropy stays in the batch as 'entropy'",
        why="token selection with rollout statistics reads it in the actor; the legacy trainer drops "
            "'entropys' after logging its mean",
        relies_on="_compute_old_log_prob returning (DataProto with 'entropys', mfu)",
        drop_when="the legacy trainer keeps the entropy (the v1 trainer does)",
        anchors=("def _compute_old_log_prob(self, batch: DataProto):",
                 'result = {"old_log_probs": log_probs.float(), "entropys": entropy.float()}',
                 'old_log_prob.batch.pop("entropys")'),
    ),
    Patch(
        name="legacy_entropy_quantiles",
        target=f"{_LEGACY_TRAINER}._update_actor",
        wrapper="verl_patches.trainers:wrap_legacy_update_actor",
        changes="logs actor/entropy_p50/p80/p95 for every method; the kept entropy is not shipped to the "
                "actor unless token selection reads it",
        why="baselines are compared to STAPO on the entropy distribution, not only its mean",
        relies_on="_update_actor(batch) returning a DataProto whose meta_info['metrics'] is logged",
        drop_when="never (a recipe metric); rewrite when the legacy trainer is removed",
        anchors=("def _update_actor(self, batch: DataProto)",
                 'actor_output_metrics = reduce_metrics(actor_output.meta_info["metrics"])'),
    ),
    Patch(
        name="v1_old_log_prob_stats",
        target=f"{_V1_TRAINER}._compute_old_log_prob",
        wrapper="verl_patches.trainers:wrap_v1_old_log_prob",
        changes="logs actor/entropy_p50/p80/p95 and computes sum_pi_squared when "
                "actor.calculate_sum_pi_squared=true, stored per response token",
        why="the same quantiles as the legacy trainer; sum_pi_squared gives the closed-form gradient-norm "
            "metrics; the v1 trainer ignores calculate_sum_pi_squared",
        relies_on="_compute_old_log_prob(batch, metrics) with batch.extra_info forwarded to the worker and "
                  "the entropy kept in TransferQueue under 'entropy'",
        drop_when="the v1 trainer honours calculate_sum_pi_squared (the quantiles stay a recipe metric)",
        anchors=("def _compute_old_log_prob(self, batch: KVBatchMeta, metrics: dict)",
                 'fields = ["entropy", "log_probs", "response_mask"]',
                 'data["entropy"] = response_from_nested(data.pop("entropy"), data["response_mask"])'),
        obsolete_if="calculate_sum_pi_squared",
    ),
    Patch(
        name="legacy_ungraded_count",
        target="verl.trainer.ppo.ray_trainer:compute_data_metrics",
        wrapper="verl_patches.trainers:wrap_legacy_data_metrics",
        changes="adds reward/ungraded: how many of the step's responses the reward marked ungraded (their answer "
                "could not be checked; the lenient reward's 'ungraded': true), when the reward reports the key",
        why="an answer the grader could not check is scored -1 like a wrong one; verl turns the reward's extra "
            "info into validation metrics only, so a training run would hide how often that happens",
        relies_on="RayPPOTrainer.fit calling the module-level compute_data_metrics(batch=...) once per step, after "
                  "the reward's extra info was put into batch.non_tensor_batch",
        drop_when="verl logs the reward's extra info as training metrics",
        anchors=("verl/trainer/ppo/metric_utils.py: def compute_data_metrics(batch: DataProto,",
                 "metrics.update(compute_data_metrics(batch=batch, use_critic=self.use_critic))"),
    ),
    Patch(
        name="v1_ungraded_count",
        target=f"{_V1_TRAINER}._compute_metrics",
        wrapper="verl_patches.trainers:wrap_v1_compute_metrics",
        changes="adds reward/ungraded, as legacy_ungraded_count, read from each response's extra_fields in the "
                "TransferQueue (padding rows left out)",
        why="as legacy_ungraded_count; the TransferQueue trainer keeps the reward's extra info only in the queue",
        relies_on="fit calling _compute_metrics(batch, metrics, ...) once per step before kv_clear, the agent loop "
                  "storing the reward's extra info as extra_fields['reward_extra_info'], padding rows tagged is_padding",
        drop_when="verl logs the reward's extra info as training metrics",
        anchors=("def _compute_metrics(self, batch: KVBatchMeta, metrics, timing_raw,",
                 "self._compute_metrics(batch, metrics, self.timing_raw, global_steps=self.global_steps, epoch=",
                 'extra_field.get("reward_extra_info", {})', 'tag.get("is_padding", False)'),
    ),
)


def install() -> list[str]:
    """Check the verl version, load ``$STAPO_SECRETS_FILE`` (:mod:`verl_patches.env_file`), then apply
    every patch that applies in this process (idempotent). Returns the names of the patches this call
    applied."""
    check_verl_version()
    load_secrets_file()
    return [patch.name for patch in PATCHES if (apply_on_import if patch.kind == "wrap" else apply)(patch)]


def table() -> str:
    """The core table as a Markdown document (what ``python -m verl_patches`` prints)."""
    return render_table(PATCHES, "How the recipe plugs into verl", "python -m verl_patches", "verl_patches/install.py", [
        "No verl file is edited or copied. Everything the recipe changes in verl is in `verl_patches/`, "
        "applied in every process (the driver, verl's task runner, every Ray worker) by one module, "
        "`verl_patches.activate`: `import verl` imports the modules named in the environment variable "
        "`VERL_USE_EXTERNAL_MODULES`, and the recipe sets it to `verl_patches.activate` in the driver (local "
        "Ray workers inherit it) and passes it to remote workers through "
        "`ray_kwargs.ray_init.runtime_env.env_vars` in its trainer YAML. Importing `verl_patches.activate` "
        "checks that the installed verl is the release the patches were written for (another release is "
        "refused unless `STAPO_ALLOW_VERL_VERSION` names it: [cluster.md](cluster.md#trying-a-newer-verl)), "
        "then applies each change below once "
        "(`verl_patches/registry.py`); importing any other module of `verl_patches` changes nothing. "
        "Every change below runs on a GPU; what only the CPU path needs (a CPU platform, vLLM's CPU build) "
        "is a table of its own, in the CPU wing (docs/cpu_patches.md), which a GPU run never loads. The "
        "recipe's policy-loss settings reach the workers as a "
        "config class of their own (`verl_patches.policy_loss_config.TokenSelectionLossConfig`, named by `_target_` "
        "in the YAML), which verl instantiates in every process. Both of verl's trainers work: the "
        "TransferQueue trainer (`trainer.use_v1=true`, verl's default) and the legacy one.",
    ])
