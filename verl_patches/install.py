"""Every change the recipe makes to verl 0.9.1, in one table, and the function that applies it.

:func:`install` (idempotent) runs when :mod:`verl_patches.activate` is imported, in every process
that imports verl: the environment variable ``VERL_USE_EXTERNAL_MODULES=verl_patches.activate``,
which ``import verl`` reads, puts it there (the recipe's driver sets it; the trainer YAML passes it
to remote Ray workers). Importing this module applies nothing. No verl file is edited or copied.
The behaviour lives in the modules each entry names; this module only wires it.

``python -m verl_patches`` prints the table (docs/verl_patches.md is that output).
"""

from __future__ import annotations

from .cpu.selection import cpu_selected
from .env_file import load_secrets_file
from .registry import Patch, apply, apply_on_import, check_verl_version, render_table

_ENGINE_WORKERS = "verl.workers.engine_workers"
_LEGACY_TRAINER = "verl.trainer.ppo.ray_trainer:RayPPOTrainer"
_V1_TRAINER = "verl.trainer.ppo.v1.trainer_base:PPOTrainer"

#: the recipe's patches, in the order they are applied (the CPU ones first: verl modules imported by
#: the recipe's patches resolve the device platform when they are imported)
PATCHES: tuple[Patch, ...] = (
    # -- the CPU path (only with VERL_PLATFORM=cpu; docs/cpu.md) ----------------------------------
    Patch(
        name="cpu_platform",
        target="verl.plugin.platform:PlatformRegistry",
        register="verl_patches.cpu.platform:register",
        registered="verl_patches.cpu.platform:is_registered",
        scope="cpu",
        changes="registers a platform 'cpu' (device cpu, gloo collectives, no-op device calls)",
        why="verl has no CPU platform and falls back to nvidia/NCCL on a machine without a GPU",
        relies_on="PlatformRegistry.register(platform=name)(PlatformBase subclass), selected by VERL_PLATFORM",
        drop_when="verl ships a CPU platform",
    ),
    Patch(
        name="cpu_gloo_backend",
        target="torch.distributed:init_process_group",
        wrapper="verl_patches.cpu.platform:wrap_init_process_group",
        scope="cpu",
        changes="backend 'cpu:gloo,cpu:gloo' becomes 'gloo'",
        why="verl builds f'cpu:gloo,{device}:{backend}', which names the cpu device twice on the CPU platform",
        relies_on="verl.utils.distributed.initialize_global_process_group(_ray) passing backend= to torch",
        drop_when="verl builds the backend string without duplicating the cpu device",
    ),
    Patch(
        name="cpu_master_port",
        target="verl.single_controller.ray.base:get_master_addr_port",
        wrapper="verl_patches.cpu.ports:wrap_get_master_addr_port",
        scope="cpu",
        changes="a worker group's MASTER_PORT is drawn at random between 20000 and the kernel's ephemeral port "
                "range (checked free), not from the ephemeral range",
        why="verl binds port 0 and closes it; rank 0 binds the port only after its worker has started, and "
            "meanwhile any outgoing connection on the machine may take it (EADDRINUSE): CPU runs share one "
            "machine with other runs",
        relies_on="RayWorkerGroup._get_master_addr_port calling the module-level remote function "
                  "get_master_addr_port.options(...).remote(master_port_range=...); ray.remote keeping the "
                  "plain function as _function",
        drop_when="verl holds the port it picks until the process group binds it",
    ),
    Patch(
        name="cpu_unpinned_offload",
        target="verl.workers.engine.fsdp.transformer_impl:CPUOffloadPolicy",
        wrapper="verl_patches.cpu.platform:wrap_offload_policy",
        applies="verl_patches.cpu.platform:unpinned_offload_applies",
        scope="cpu",
        changes="FSDP2 CPUOffloadPolicy(pin_memory=True) is built with pin_memory=False (only without CUDA)",
        why="pinning host memory needs an accelerator (the reference model of KL-regularised GRPO offloads)",
        relies_on="transformer_impl building CPUOffloadPolicy by its module-level name",
        drop_when="verl pins only when an accelerator is present",
    ),
    Patch(
        name="cpu_sample_priority",
        target="verl.experimental.agent_loop.agent_loop:AgentLoopWorker._run_agent_loop",
        wrapper="verl_patches.cpu.ordering:wrap_run_agent_loop",
        scope="cpu",
        changes="under full determinism each sample's priority is its index in its group (its request id)",
        why="the v1 agent loop gives the n samples of a prompt one request id, so they are seeded by arrival order",
        relies_on="_run_agent_loop(..., session_id=<index>, priority=...) keyword arguments",
        drop_when="verl's v1 agent loop sends a per-sample request id",
    ),
    Patch(
        name="cpu_counting_uids",
        target="verl.trainer.ppo.v1.trainer_base:uuid",
        wrapper="verl_patches.cpu.ordering:wrap_uuid_module",
        scope="cpu",
        changes="under full determinism the v1 trainer's prompt uids come from a per-process counter",
        why="uuid4() prompt uids differ run to run and decide the batch order",
        relies_on="trainer_base calling uuid.uuid4() through its module-level 'uuid' name",
        drop_when="verl derives prompt uids deterministically under full determinism",
    ),
    Patch(
        name="cpu_sorted_prompt_uids",
        target="verl.trainer.ppo.v1.replay_buffer:ReplayBuffer._select_prompt_uids",
        wrapper="verl_patches.cpu.ordering:wrap_select_prompt_uids",
        scope="cpu",
        changes="under full determinism the sampleable keys are sorted before selection",
        why="the keys are a set, and their order decides which prompts form the batch",
        relies_on="_select_prompt_uids(partition_id, sampleable_keys, batch_size) with a stable sort by step",
        drop_when="verl orders the replay buffer's batches deterministically",
    ),
    Patch(
        name="cpu_sorted_batch",
        target="verl.trainer.ppo.v1.replay_buffer:ReplayBuffer._materialize_batch",
        wrapper="verl_patches.cpu.ordering:wrap_materialize_batch",
        scope="cpu",
        changes="under full determinism the batch rows are ordered by (prompt uid, sample, output)",
        why="TransferQueue lists samples in completion order (timing), which decides every float sum's order",
        relies_on="_materialize_batch(partition_id, selected_prompt_uids, partition_snapshot) keeping the snapshot's order",
        drop_when="verl orders the replay buffer's batches deterministically",
    ),
    Patch(
        name="cpu_replay_poll",
        target="verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.__init__",
        wrapper="verl_patches.cpu.replay_poll:wrap_replay_buffer_init",
        scope="cpu",
        changes="the v1 replay buffer checks for finished rollouts every 0.2 s instead of every 2 s",
        why="a CPU step's rollout takes 3-6 s, which the 2 s poll rounds up to the next multiple of 2 s",
        relies_on="ReplayBuffer.__init__ storing poll_interval, which _wait_for_next_poll sleeps between checks",
        drop_when="verl makes the replay buffer's poll interval a config key",
    ),
    Patch(
        name="vllm_cpu_build_version",
        target="importlib.metadata:version",
        wrapper="verl_patches.cpu.vllm_cpu:wrap_metadata_version",
        applies="verl_patches.cpu.vllm_cpu:cpu_build_only",
        changes="version('vllm') answers with the version of the installed 'vllm-cpu' distribution (applied only "
                "where vllm-cpu is installed and vllm is not, with or without VERL_PLATFORM=cpu)",
        why="verl's vLLM rollout refuses to import without a distribution named 'vllm'; vLLM's CPU build "
            "installs the same 'vllm' package under the distribution name 'vllm-cpu'",
        relies_on="verl.workers.rollout.vllm_rollout and verl.third_party.vllm importing version from "
                  "importlib.metadata after the patches are applied (verl imports them lazily)",
        drop_when="vLLM's CPU build is published as the 'vllm' distribution, or verl reads vllm.__version__",
    ),
    Patch(
        name="cpu_vllm_keep_linear_weight",
        target="vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm",
        wrapper="verl_patches.cpu.vllm_cpu:wrap_dispatch_cpu_unquantized_gemm",
        scope="cpu",
        changes="vLLM's CPU linear layers keep layer.weight beside the copy packed for the GEMM "
                "(remove_weight=False); applied in the process that imports vLLM, when it does",
        why="verl's weight sync loads each step's weights into layer.weight and repacks them with "
            "process_weights_after_loading; with the weight dropped the sync fails ('Parameter' object "
            "has no attribute 'weight_loader')",
        relies_on="vLLM's linear layers calling dispatch_cpu_unquantized_gemm through the module attribute "
                  "(imported inside process_weights_after_loading), which re-creates the packed copy",
        drop_when="vLLM's CPU backend supports in-place weight reloading",
    ),
    Patch(
        name="cpu_vllm_isa_pin",
        target="torch.cpu:get_capabilities",
        wrapper="verl_patches.cpu.vllm_cpu:wrap_get_capabilities",
        applies="verl_patches.cpu.vllm_cpu:isa_pinned",
        scope="cpu",
        changes="under the recipe's AVX2 pin (ATEN_CPU_CAPABILITY=avx2) torch.cpu.get_capabilities() reports no "
                "AVX-512 or AMX flag, so vLLM loads its _C_AVX2 kernels and AVX2 attention code",
        why="vLLM picks its compiled kernels by the CPU's flags, which the environment variables pinning torch's "
            "libraries do not reach: an AVX-512 machine would sample with other kernels than an AVX2-only one",
        relies_on="vLLM's import_kernels and attention backend asking torch.cpu._is_avx512_supported() & co., "
                  "which read the module-level get_capabilities; vLLM's processes applying the table (import of "
                  "verl, or the vllm.general_plugins entry point) before vLLM first loads its kernels",
        drop_when="vLLM lets an environment variable choose its CPU kernels' instruction set",
    ),
    Patch(
        name="cpu_vllm_no_batch_invariant_kernels",
        target="verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMHttpServer.__init__",
        wrapper="verl_patches.cpu.vllm_cpu:wrap_server_init",
        scope="cpu",
        changes="under rollout.full_determinism the vLLM engine starts without VLLM_BATCH_INVARIANT",
        why="vLLM's batch-invariant kernels need Triton, which has no CPU backend (TypeError at the first "
            "forward); vLLM's CPU forward is batch-invariant without them (benchmarks/bench_vllm_determinism.py)",
        relies_on="vLLMHttpServer.__init__ setting VLLM_BATCH_INVARIANT in its own environment, read by the "
                  "engine processes launch_server starts later",
        drop_when="vLLM's batch-invariant mode runs on CPU",
    ),
    Patch(
        name="cpu_vllm_request_seeds",
        target="verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMHttpServer.generate",
        wrapper="verl_patches.cpu.vllm_cpu:wrap_server_generate",
        scope="cpu",
        changes="under rollout.full_determinism each request is seeded by (seed, step, prompt, verl's per-sample "
                "request id) instead of all by one seed",
        why="one seed for every request makes the n samples of a prompt identical (no group to compare); a "
            "seed per sample makes its tokens independent of which requests vLLM batches it with",
        relies_on="generate(prompt_ids, sampling_params, request_id, ...) using sampling_params.setdefault('seed'), "
                  "the agent loop's request id det-<index> under full determinism",
        drop_when="verl seeds vLLM requests per sample under full determinism",
    ),
    Patch(
        name="cpu_vllm_unlink_ring_buffers",
        target="vllm.distributed.device_communicators.shm_broadcast:MessageQueue.wait_until_ready",
        wrapper="verl_patches.cpu.vllm_cpu:wrap_wait_until_ready",
        scope="cpu",
        changes="the writer of a vLLM message queue unlinks its shared-memory ring buffer's name once every "
                "local reader has mapped it (the memory stays mapped until the last process ends)",
        why="vLLM unlinks the name at shutdown, which its engine processes never reach when the Ray cluster "
            "ends: every run left 160-240 MiB segments in /dev/shm",
        relies_on="local readers mapping the buffer (create_from_handle) before subscribing, and the writer's "
                  "wait_until_ready returning after every local subscription",
        drop_when="verl shuts its vLLM engines down before the Ray cluster ends",
    ),
    Patch(
        name="cpu_vllm_rendezvous_file",
        target="vllm.v1.executor.multiproc_executor:get_file_store_init_method",
        wrapper="verl_patches.cpu.vllm_cpu:wrap_file_store_init_method",
        scope="cpu",
        changes="vLLM's file:// rendezvous file goes to $VLLM_RPC_BASE_PATH (the run's folder for vLLM's "
                "socket files, cpu_vllm_run_scratch) instead of the temp folder",
        why="the file is removed by nobody; one was left in /tmp per vLLM engine start",
        relies_on="MultiprocExecutor calling the module-level name get_file_store_init_method",
        drop_when="vLLM removes its rendezvous file",
    ),
    Patch(
        name="cpu_vllm_run_scratch",
        target="verl.trainer.main_ppo:run_ppo",
        wrapper="verl_patches.cpu.vllm_cpu:wrap_run_ppo",
        scope="cpu",
        changes="a run of verl's vLLM rollout gets a fresh folder for vLLM's socket files ($VLLM_RPC_BASE_PATH, "
                "in the driver and in Ray's runtime environment), removed when run_ppo returns or raises, "
                "together with the shared memory and named semaphores the run's killed processes left in "
                "/dev/shm (those no process maps or holds open, by inode); before it starts, the folders of "
                "drivers that no longer run and the named semaphores nobody holds (what runs killed whole left)",
        why="vLLM's engine processes are killed, not shut down, when the Ray cluster ends: every run left "
            "socket files in the temp folder and, from its killed processes, /dev/shm entries",
        relies_on="run_ppo(config, task_runner_class) starting Ray with config.ray_kwargs.ray_init.runtime_env "
                  "and returning when training ends; the driver importing run_ppo from verl.trainer.main_ppo "
                  "after the patches are applied",
        drop_when="verl shuts its vLLM engines down before the Ray cluster ends",
    ),
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
    ),
    # -- calibrating the memory model (docs/memory.md) ------------------------------------------
    Patch(
        name="memory_probe_infer",
        target=f"{_ENGINE_WORKERS}:TrainingWorker.infer_batch",
        wrapper="verl_patches.memory_probe:wrap_infer_batch",
        changes="on CUDA, resets PyTorch's peak memory before a forward pass (log-prob; reference on a "
                "forward-only engine; the recipe's current-policy and update-effect forwards inside the update) "
                "and logs on rank 0 its allocated and reserved peaks, the device-wide figure, the memory outside "
                "PyTorch's allocator and its largest micro-batch's tokens ('[stapo] memory peak: ...')",
        why="verl's perf/max_memory_* never reset, so they give one peak for all passes; the memory model "
            "is calibrated term by term (python -m recipe.stapo.memory.calibration)",
        relies_on="compute_log_prob and compute_ref_log_prob calling TrainingWorker.infer_batch once per pass, "
                  "the engine's forward_step once per micro-batch",
        drop_when="verl logs a peak per pass",
    ),
    Patch(
        name="memory_probe_update",
        target=f"{_ENGINE_WORKERS}:TrainingWorker.train_mini_batch",
        wrapper="verl_patches.memory_probe:wrap_train_mini_batch",
        changes="the same for the update (a forward inside it is logged as its own pass; the update's line "
                "covers both)",
        why="the update's peak, for the memory model's calibration",
        relies_on="update_actor calling TrainingWorker.train_mini_batch once per step",
        drop_when="verl logs a peak per pass",
    ),
    Patch(
        name="memory_probe_rollout",
        target=f"{_ENGINE_WORKERS}:ActorRolloutRefWorker.update_weights",
        wrapper="verl_patches.memory_probe:wrap_update_weights",
        changes="on CUDA, logs on rank 0 the device-wide memory when the weight sync returns, vLLM awake with "
                "its weights and KV cache ('[stapo] memory peak: pass=rollout ...')",
        why="vLLM's share and the fixed overhead are only visible device-wide; the rollout is calibrated from it",
        relies_on="the colocated trainer calling ActorRolloutRefWorker.update_weights before each rollout, "
                  "which resumes vLLM's weights and KV cache",
        drop_when="verl logs the device-wide memory of the rollout",
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
    ),
)


def install() -> list[str]:
    """Check the verl version, load ``$STAPO_SECRETS_FILE`` (:mod:`verl_patches.env_file`), then apply
    every patch that belongs in this process (idempotent): the CPU ones when ``VERL_PLATFORM=cpu``
    selects the CPU path (after fixing the thread count), then the recipe's. Returns the names of the
    patches this call applied."""
    check_verl_version()
    load_secrets_file()

    applied = []
    if cpu_selected():
        # torch (platform.py) only on the CPU path, after the thread count is known
        from .cpu.platform import pin_threads

        pin_threads()
    for patch in PATCHES:
        if patch.scope == "cpu" and not cpu_selected():
            continue
        if (apply_on_import if patch.kind == "wrap" else apply)(patch):
            applied.append(patch.name)
    return applied


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
        "refused unless `STAPO_ALLOW_VERL_VERSION` names it), then applies each change below once "
        "(`verl_patches/registry.py`); importing any other module of `verl_patches` changes nothing. "
        "Changes with scope `cpu` are applied only when `VERL_PLATFORM=cpu` selects the CPU path "
        "(docs/cpu.md); there vLLM's engine core, which does not import verl, applies them through a vLLM "
        "plugin that only the CPU environment installs (a GPU install has no vLLM plugin). The recipe's "
        "policy-loss settings reach the workers as a "
        "config class of their own (`verl_patches.policy_loss_config.TokenSelectionLossConfig`, named by `_target_` "
        "in the YAML), which verl instantiates in every process. Both of verl's trainers work: the "
        "TransferQueue trainer (`trainer.use_v1=true`, verl's default) and the legacy one.",
    ])
