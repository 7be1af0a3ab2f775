"""Run verl's real trainer (``python -m recipe.stapo.main_stapo``) on a machine without a GPU, with
the tiny assets of :mod:`stapo_cpu.assets`: the environment, the Hydra overrides (each commented
with what it cures) and a blocking runner. Used by the quickstart, the tests and users alike::

    from stapo_cpu.trainer import cpu_env, cpu_overrides, trainer_command
    cmd = trainer_command("stapo", cpu_overrides("assets/tiny", "results/run", steps=4))
    subprocess.run(cmd, env=cpu_env("results/run"), check=True)

The verl-side shims (platform, vLLM on CPU) are :mod:`stapo_cpu.patches`; docs/cpu.md explains each fix.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from recipe.stapo.driver import PATCH_MODULE
from recipe.stapo.eval.backends import CPU_VLLM_ENV
from recipe.stapo.methods import METHODS
from recipe.stapo.metrics import METRICS_FILE, read_metrics
from stapo_core.fileio import open_regular

from .assets import asset_paths
from .isa import DEFAULT_ISA, isa_env

REPO_ROOT = Path(__file__).resolve().parents[1]
#: modules every verl process imports, in this order: the CPU wing's patch table (the CPU platform first:
#: the core's patches import verl modules that resolve the device platform), then the recipe's
EXTERNAL_MODULES = ("stapo_cpu.activate", PATCH_MODULE)
#: what selects the CPU path in every process (see stapo_cpu.patches), and vLLM's CPU settings (read
#: only by processes that start vLLM; the eval's vLLM backend sets the same ones)
CPU_ENV_VARS = {"VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda", **CPU_VLLM_ENV}
#: the CPU path's rollout: verl's vLLM server rollout on vLLM's CPU build (docs/cpu.md)
CPU_ROLLOUT = "vllm"
#: FSDP mixed-precision policy computing in float32 (verl's default computes in bfloat16)
FP32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
#: torch intra-op threads in every process of a CPU run (see :func:`thread_env`)
DEFAULT_THREADS = 1
#: where CPU trainer runs on one machine take turns (:func:`machine_turn`); empty: no turns
RUN_LOCK_ENV = "STAPO_CPU_RUN_LOCK"
DEFAULT_RUN_LOCK = os.path.join(tempfile.gettempdir(), "stapo-cpu-trainer.lock")
#: how many CPU trainer runs may share the machine (default: one per core)
RUN_SLOTS_ENV = "STAPO_CPU_RUN_SLOTS"


def run_slots(environ: Mapping[str, str] = os.environ) -> int:
    """``STAPO_CPU_RUN_SLOTS``, else the machine's core count (a ``ValueError`` naming the variable for
    anything but a whole number >= 1)."""
    raw = environ.get(RUN_SLOTS_ENV, "").strip()
    if not raw:
        return max(1, os.cpu_count() or 1)
    if not (raw.isascii() and raw.isdigit() and int(raw) >= 1):
        raise ValueError(f"{RUN_SLOTS_ENV}={raw!r}: expected a whole number >= 1 (CPU trainer runs at a time)")
    return int(raw)


@contextlib.contextmanager
def machine_turn(log: Callable[[str], None] = print, poll_s: float = 2.0):
    """Hold one of the machine's turns for a CPU trainer run (docs/testing.md): an exclusive lock on one
    of ``STAPO_CPU_RUN_LOCK.<i>``, ``i < STAPO_CPU_RUN_SLOTS`` (default :data:`DEFAULT_RUN_LOCK`, one turn
    per core). Yields the seconds waited for the turn. A lock goes with the process that holds it."""
    path = os.environ.get(RUN_LOCK_ENV, DEFAULT_RUN_LOCK)
    if not path:
        yield 0.0
        return
    slots, start, said = run_slots(), time.time(), False
    handles = [open_regular(f"{path}.{i}", os.O_WRONLY | os.O_APPEND | os.O_CREAT) for i in range(slots)]
    try:
        while True:
            held = next((h for h in handles if _try_lock(h)), None)
            if held is not None:
                break
            if not said:
                log(f"[stapo] waiting for a turn: {slots} other CPU trainer run(s) hold this machine "
                    f"(locks {path}.*; {RUN_SLOTS_ENV} sets how many share it)")
                said = True
            time.sleep(poll_s)
        try:
            yield time.time() - start
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
    finally:
        for handle in handles:
            os.close(handle)


def _try_lock(handle) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def thread_env(threads: int = DEFAULT_THREADS) -> dict[str, str]:
    """Environment fixing the thread count of every process of a CPU run to ``threads``: torch's
    (``STAPO_CPU_THREADS``, read by :func:`stapo_cpu.patches.platform.pin_threads` in each verl process),
    OpenMP's and MKL's (docs/reproducibility.md says why each)."""
    if int(threads) < 1:
        raise ValueError(f"thread_env: threads must be >= 1, got {threads}")
    n = str(int(threads))
    return {"STAPO_CPU_THREADS": n, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "MKL_DYNAMIC": "FALSE"}


def cpu_env(run_dir: Optional[str | os.PathLike] = None, base: Optional[Mapping[str, str]] = None,
            metrics_file: str = METRICS_FILE, threads: int = DEFAULT_THREADS, isa: str = DEFAULT_ISA) -> dict[str, str]:
    """Environment for a CPU run: ``base`` (default ``os.environ``) plus :data:`CPU_ENV_VARS`,
    ``VERL_USE_EXTERNAL_MODULES`` starting with :data:`EXTERNAL_MODULES` (imported by every verl process,
    Ray workers included; other modules already listed follow), the repository on ``PYTHONPATH``,
    tokenizer parallelism off, :func:`thread_env` and :func:`isa_env`; with ``run_dir``,
    ``VERL_FILE_LOGGER_PATH=<run_dir>/<metrics_file>`` (verl's file logger writes one
    ``{"step": s, "data": {...}}`` JSON line per step there; a resumed run continues the file, each step
    once, :mod:`verl_patches.resume`).
    """
    env = dict(os.environ if base is None else base)
    modules = [m for m in env.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m and m not in EXTERNAL_MODULES]
    env.update({
        **CPU_ENV_VARS,
        "VERL_USE_EXTERNAL_MODULES": ",".join([*EXTERNAL_MODULES, *modules]),
        "TOKENIZERS_PARALLELISM": "false",
        **thread_env(threads),
        **isa_env(isa),
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p),
    })
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        env["VERL_FILE_LOGGER_PATH"] = str(Path(run_dir).resolve() / metrics_file)
    return env


def cpu_overrides(assets_dir: str | os.PathLike, out_dir: str | os.PathLike, *, steps: int = 2,
                  prompts: int = 4, n: int = 4, mini_batch_prompts: int = 2, response_length: int = 160,
                  prompt_length: int = 64, lr: float = 1e-4, seed: int = 0, use_v1: bool = True,
                  save_freq: int = -1, resume: bool = False, resume_from: Optional[str | os.PathLike] = None,
                  validate: bool = False, update_effect_responses: Optional[int] = None,
                  experiment_name: Optional[str] = None, isa: str = DEFAULT_ISA,
                  extra: Sequence[str] = ()) -> list[str]:
    """Hydra overrides running the recipe on CPU with the tiny assets in ``assets_dir``.

    Args:
        assets_dir: folder built by :func:`stapo_cpu.assets.build_assets`.
        out_dir: run folder: checkpoints go to ``out_dir/checkpoints``.
        steps: training steps. prompts / n: prompts per step and responses per prompt.
        mini_batch_prompts: prompts per PPO mini-batch (``prompts / mini_batch_prompts`` updates per step).
        response_length / prompt_length: max tokens (the tiny task's responses are ~60-110 tokens, its
            prompts ~40).
        lr: actor learning rate (constant, no warm-up). seed: data shuffling and sampling seed.
        use_v1: verl's TransferQueue trainer (True) or the legacy trainer (False).
        save_freq: checkpoint every ``save_freq`` steps (-1: never). resume: ``resume_mode=auto``
            (continue from the latest checkpoint in ``out_dir/checkpoints``) instead of ``disable``.
        resume_from: a ``global_step_<k>`` checkpoint folder to resume from (``resume_mode=resume_path``).
        validate: validate before training and at the end (``test_freq = steps``).
        update_effect_responses: responses per mini-batch whose log-probs are measured across each
            update (``actor/s2t/dlogp_*``, :mod:`verl_patches.update_effect`); None: every response
            of a mini-batch (``mini_batch_prompts * n``), so each one holding an S2T candidate is
            measured (0: off).
        experiment_name: defaults to the run folder's name.
        isa: :func:`isa_env`'s setting, also given to every Ray worker through the runtime environment.
        extra: more overrides, appended last (they win).

    The method is chosen by ``method=<name>``, given separately (see :func:`trainer_command`).
    """
    if prompts % mini_batch_prompts:
        raise ValueError(f"cpu_overrides: prompts={prompts} must be a multiple of mini_batch_prompts={mini_batch_prompts}")
    if min(steps, prompts, n, response_length, prompt_length) < 1:
        raise ValueError("cpu_overrides: steps, prompts, n, response_length and prompt_length must be >= 1")
    if update_effect_responses is None:
        update_effect_responses = mini_batch_prompts * n
    assets = asset_paths(assets_dir)
    if not assets.manifest.is_file():
        raise ValueError(f"cpu_overrides: no tiny assets in {assets.root} (build them with "
                         f"`python -m stapo_cpu.assets {assets.root}`)")
    out = Path(out_dir).resolve()
    sequences = prompts * n
    actor, rollout_key, ref = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref"
    overrides = [
        # data (no DataLoader worker processes: they cost ~75 s and leave a traceback at exit)
        f"data.train_files={hydra_quoted(assets.train)}", f"data.val_files={hydra_quoted(assets.val)}",
        f"data.max_prompt_length={prompt_length}", f"data.max_response_length={response_length}",
        f"data.train_batch_size={prompts}", f"data.val_batch_size={prompts}", "data.dataloader_num_workers=0",
        "data.filter_overlong_prompts_workers=1", f"data.seed={seed}",
        # model: the tiny Qwen3, eager attention (no FlashAttention on CPU), padded (no varlen kernels)
        "recipe.model=tiny_cpu", f"actor_rollout_ref.model.path={hydra_quoted(assets.model)}",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        # actor / ref: FSDP2 (FSDP1 needs an accelerator), float32 compute (as the rollout), no torch.compile
        f"{actor}.strategy=fsdp2", f"{ref}.strategy=fsdp2",
        f"+{actor}.fsdp_config.mixed_precision={FP32}", f"+{ref}.fsdp_config.mixed_precision={FP32}",
        f"{actor}.use_torch_compile=false", f"{ref}.use_torch_compile=false",
        f"{actor}.ppo_mini_batch_size={mini_batch_prompts}",
        f"{actor}.ppo_micro_batch_size_per_gpu={mini_batch_prompts * n}",
        f"{actor}.optim.lr={lr}", f"{actor}.optim.lr_warmup_steps=0",
        # the update effect of every response holding an S2T candidate (the tiny model's forward
        # costs milliseconds; the paper-scale config leaves it off)
        f"{actor}.policy_loss.update_effect_responses={update_effect_responses}",
        f"{rollout_key}.log_prob_micro_batch_size_per_gpu={sequences}",
        f"{ref}.log_prob_micro_batch_size_per_gpu={sequences}",
        # fixed micro-batches (one per mini-batch) instead of the GPU configs' token budgets
        f"{actor}.use_dynamic_bsz=false", f"{rollout_key}.log_prob_use_dynamic_bsz=false",
        f"{ref}.log_prob_use_dynamic_bsz=false",
        # rollout: verl's vLLM server on vLLM's CPU build, one replica, one agent-loop worker; float32 as the
        # trainer, no CUDA graphs, no sleep mode (it needs CUDA), random weights until the first weight sync
        f"{rollout_key}.name={CPU_ROLLOUT}", f"{rollout_key}.dtype=float32", f"{rollout_key}.enforce_eager=true",
        f"+{rollout_key}.enable_sleep_mode=false", f"{rollout_key}.free_cache_engine=false",
        f"{rollout_key}.load_format=dummy", f"{rollout_key}.n={n}", f"{rollout_key}.tensor_model_parallel_size=1",
        f"{rollout_key}.agent.num_workers=1", f"{rollout_key}.seed={seed}",
        # same seed, same numbers: a seed per sample and a fixed batch order (the wing's patches turn verl's
        # Triton-only batch-invariant kernels off: vLLM's CPU forward is batch-invariant without them)
        f"{rollout_key}.full_determinism=true",
        # the tiny model's requests: a step's prompts x n samples fit in one scheduler batch
        f"{rollout_key}.max_num_seqs=64", f"{rollout_key}.max_num_batched_tokens=4096",
        # validation: one sample per held-out problem (the paper-scale config draws JustRL's 32)
        f"{rollout_key}.val_kwargs.n=1",
        # the actor and reference engines enable torch's deterministic algorithms
        f"{actor}.fsdp_config.full_determinism=true", f"{ref}.fsdp_config.full_determinism=true",
        "reward.num_workers=1",
        # v1 trainer: one TransferQueue storage unit (it waits for all of them)
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        # Ray: one logical GPU slot, enough CPU slots for the actors; the selection reaches every worker
        "+ray_kwargs.ray_init.num_gpus=1", "ray_kwargs.ray_init.num_cpus=8",
        "+ray_kwargs.ray_init.include_dashboard=false",
        *_runtime_env_overrides(isa),
        # trainer
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        f"trainer.use_v1={str(use_v1).lower()}", "trainer.logger=[console,file]",
        "trainer.project_name=stapo_cpu", f"trainer.experiment_name={hydra_quoted(experiment_name or out.name)}",
        f"trainer.total_training_steps={steps}", "trainer.total_epochs=1000",
        f"trainer.save_freq={save_freq}", *_resume_overrides(resume, resume_from),
        f"trainer.default_local_dir={hydra_quoted(out / 'checkpoints')}",
        f"trainer.val_before_train={str(validate).lower()}", f"trainer.test_freq={steps if validate else -1}",
        f"{actor}.fsdp_config.seed={seed}",
    ]
    return overrides + list(extra)


def hydra_quoted(value: str | os.PathLike) -> str:
    """``value`` as a quoted string of Hydra's override grammar, read back as written: quotes, commas,
    brackets, '=', non-ASCII and ``${...}`` (escaped: never an interpolation) included. Backslashes
    before a quote, a ``${`` or the end are doubled, as the grammar reads them."""
    def escape(match: re.Match) -> str:  # a run of backslashes (maybe none), then a quote, '${' or the end
        backslashes, special = match.groups()
        return backslashes * 2 + ("\\" + special if special else "")

    return "'" + re.sub(r"(\\*)('|\$\{|$)", escape, str(value)) + "'"


def _resume_overrides(resume: bool, resume_from: Optional[str | os.PathLike]) -> list[str]:
    if resume_from is None:
        return [f"trainer.resume_mode={'auto' if resume else 'disable'}"]
    path = Path(resume_from).resolve()
    if not path.name.startswith("global_step_") or not path.is_dir():
        raise ValueError(f"cpu_overrides: resume_from={path} is not a verl checkpoint folder (global_step_<k>)")
    return ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={hydra_quoted(path)}"]


def _runtime_env_overrides(isa: str = DEFAULT_ISA) -> list[str]:
    """``ray_kwargs.ray_init.runtime_env.env_vars`` entries selecting the CPU path and the pinned
    instruction set (:func:`isa_env`) in Ray workers (quoted: a comma in an unquoted Hydra value
    would make a sweep)."""
    env = {**CPU_ENV_VARS, "VERL_USE_EXTERNAL_MODULES": ",".join(EXTERNAL_MODULES), **isa_env(isa)}
    return [f"++ray_kwargs.ray_init.runtime_env.env_vars.{key}={hydra_quoted(value)}" for key, value in env.items()]


def trainer_command(method: str, overrides: Sequence[str], python: str = sys.executable) -> list[str]:
    """``python -m recipe.stapo.main_stapo method=<method> <overrides...>`` as an argv list."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    return [python, "-m", "recipe.stapo.main_stapo", f"method={method}", *overrides]


def run_cpu_trainer(method: str, assets_dir: str | os.PathLike, run_dir: str | os.PathLike, *,
                    metrics_file: str = METRICS_FILE, timeout: Optional[float] = None,
                    log_file: Optional[str | os.PathLike] = None,
                    on_step: Optional[Callable[[int, dict], None]] = None, threads: int = DEFAULT_THREADS,
                    isa: str = DEFAULT_ISA, **overrides_kwargs) -> "CPURun":
    """Run ``python -m recipe.stapo.main_stapo method=<method>`` on CPU (blocking).

    ``overrides_kwargs`` go to :func:`cpu_overrides`; ``threads``: torch threads per process
    (:func:`thread_env`); ``isa``: the math libraries' instruction set
    (:func:`stapo_cpu.isa.isa_env`). stdout+stderr go to ``log_file`` (default
    ``run_dir/<metrics_file stem>.log``). ``on_step(step, metrics)`` is called for each step as
    soon as verl's file logger writes it. The run waits for its turn on the machine
    (:func:`machine_turn`); ``timeout`` counts from the start of the run, not the wait. Returns a
    :class:`CPURun` (return code, wall seconds, paths); it never raises on a failed or timed-out run
    (return code -9, ``timed_out``), so callers can report the log.
    """
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    log = Path(log_file) if log_file else run_dir / (Path(metrics_file).stem + ".log")
    metrics = run_dir / metrics_file
    cmd = trainer_command(method, cpu_overrides(assets_dir, run_dir, isa=isa, **overrides_kwargs))
    seen: set[int] = set()

    def report_new_steps() -> None:
        if on_step is None or not metrics.is_file():
            return
        for step, data in sorted(read_metrics(metrics).items()):
            if step not in seen:
                seen.add(step)
                on_step(step, data)

    # a fresh run starts a fresh file (a resumed one continues it: verl_patches.resume), and on_step
    # does not report a previous run's steps
    if not (overrides_kwargs.get("resume") or overrides_kwargs.get("resume_from")):
        metrics.unlink(missing_ok=True)
    with machine_turn() as waited_s, os.fdopen(open_regular(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as out:
        start, timed_out = time.time(), False
        proc = subprocess.Popen(cmd, env=cpu_env(run_dir, metrics_file=metrics_file, threads=threads, isa=isa),
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        while proc.poll() is None:
            if timeout is not None and time.time() - start > timeout:
                timed_out = True
                proc.kill()
                proc.wait()
                break
            report_new_steps()
            time.sleep(1.0)
        report_new_steps()
        wall_s = round(time.time() - start, 1)
    code = -9 if timed_out else proc.returncode
    return CPURun(method, code, wall_s, run_dir, metrics, log, timeout=timeout if timed_out else None,
                  waited_s=round(waited_s, 1))


@dataclass
class CPURun:
    """Outcome of :func:`run_cpu_trainer`; ``timeout``: the limit that stopped it (None: not stopped)."""

    method: str
    returncode: int
    wall_s: float
    run_dir: Path
    metrics: Path
    log: Path
    timeout: Optional[float] = None
    waited_s: float = 0.0

    @property
    def timed_out(self) -> bool:
        """Stopped at its time limit (return code -9)."""
        return self.timeout is not None

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def tail(self, lines: int = 60) -> str:
        """Last lines of the run's log (for error reports), after what stopped it when it hit its limit."""
        text = "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.is_file() else ""
        if self.timed_out:
            text = (f"run {self.method} stopped after {self.wall_s:.0f} s: its time limit is {self.timeout:g} s "
                    f"(raise the timeout, or give it a machine of its own); last lines of {self.log}:\n{text}")
        return text
