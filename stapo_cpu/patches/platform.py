"""A verl platform named ``cpu``, and the two small torch/verl patches the CPU path needs.

verl 0.9.1 falls back to its ``nvidia`` platform when no registered one is detected, which fails
without a GPU; :class:`PlatformCPU` (device ``cpu``, backend ``gloo``) never claims auto-detection,
so only ``VERL_PLATFORM=cpu`` selects it. Nothing happens at import: the CPU wing's patch table
(:mod:`stapo_cpu.patches.install`) applies :func:`register` and the ``wrap_*`` functions.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from typing import Any, Optional

import psutil
import torch

PLATFORM_NAME = "cpu"
#: environment variable fixing torch's intra-op thread count in every process of a CPU run
THREADS_ENV = "STAPO_CPU_THREADS"


def _host_memory() -> tuple[int, int]:
    """(available, total) host memory in bytes (what ``mem_get_info`` reports on CPU)."""
    mem = psutil.virtual_memory()
    return int(mem.available), int(mem.total)


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


class _CPUDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the ``torch.cuda``-style calls verl makes on its device module
    (``get_torch_device().<name>``) that ``torch.cpu`` lacks (:data:`_EXTRA`); an unknown name raises
    AttributeError naming it."""

    _EXTRA = {
        "empty_cache": _noop,
        "ipc_collect": _noop,
        "reset_peak_memory_stats": _noop,
        "set_per_process_memory_fraction": _noop,
        "memory_allocated": _zero,
        "memory_reserved": _zero,
        "max_memory_allocated": _zero,
        "max_memory_reserved": _zero,
        "memory_stats": lambda *a, **k: {},
        "mem_get_info": lambda *a, **k: _host_memory(),
        "get_device_name": lambda *a, **k: "CPU",
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
        "manual_seed": lambda seed: torch.manual_seed(seed),
        "manual_seed_all": lambda seed: torch.manual_seed(seed),
        "current_device": lambda: "cpu",
    }

    def __init__(self) -> None:
        super().__init__("stapo_cpu.patches.device_module", "torch.cpu with the torch.cuda-style calls verl uses")

    def __getattr__(self, name: str) -> Any:
        if name in self._EXTRA:
            return self._EXTRA[name]
        try:
            return getattr(torch.cpu, name)
        except AttributeError:
            raise AttributeError(f"CPU device module: torch.cpu has no {name!r} and stapo_cpu.patches.platform "
                                 f"provides no fallback for it") from None


#: the object ``get_torch_device()`` returns on the CPU platform
CPU_DEVICE_MODULE = _CPUDeviceModule()


#: what each of verl's ``PlatformBase`` methods answers on the CPU platform, whatever its arguments:
#: never auto-detected (only VERL_PLATFORM=cpu selects it); ``current_device`` is the string ``"cpu"``
#: (as ``torch.cpu.current_device()``: verl only uses it in ``.to(...)`` / ``device=`` /
#: ``torch.device(...)``, where an int would mean cuda); Ray still schedules workers on the logical
#: ``GPU`` resource (``ray_init.num_gpus``); no profiler, no IPC, no device capability
PLATFORM_ANSWERS = {
    "is_available": True,
    "is_platform_available": False,
    "current_device": "cpu",
    "device_count": 1,
    "communication_backend_name": "gloo",
    "visible_devices_envvar": "CUDA_VISIBLE_DEVICES",
    "ray_resource_name": "GPU",
    "is_ipc_supported": False,
    "get_device_capability": (None, None),
    "set_device": None,
    "synchronize": None,
    "set_allocator_settings": None,
    "empty_cache": None,
    "profiler_start": None,
    "profiler_stop": None,
    "cudart": None,
}


def _answer(value: Any):
    """A method returning ``value`` whatever its arguments."""
    return lambda self, *args, **kwargs: value


@functools.lru_cache(maxsize=1)
def platform_class() -> type:
    """Build (once) ``PlatformCPU``, verl's ``PlatformBase`` for CPU-only machines (device ``cpu``,
    backend ``gloo``, :data:`PLATFORM_ANSWERS`); deferred so importing this module imports no verl."""
    # verl's platform module loads when the patch is applied (inside `import verl`), not at this module's import
    from verl.plugin.platform import PlatformBase

    return type("PlatformCPU", (PlatformBase,), {
        "__module__": __name__,
        "device_name": "cpu",
        "vendor_name": "cpu",
        "device_module": property(lambda self: CPU_DEVICE_MODULE),
        "manual_seed": lambda self, seed: torch.manual_seed(seed),
        "manual_seed_all": lambda self, seed: torch.manual_seed(seed),
        "nvtx_range": lambda self, *args, **kwargs: contextlib.nullcontext(),
        "ray_noset_envvars": lambda self: [],
        **{name: _answer(value) for name, value in PLATFORM_ANSWERS.items()},
    })


def register() -> None:
    """Register :class:`PlatformCPU` as ``cpu`` in verl's ``PlatformRegistry`` (idempotent)."""
    # verl's platform module loads when the patch is applied (inside `import verl`), not at this module's import
    from verl.plugin.platform import PlatformRegistry

    if not is_registered():
        PlatformRegistry.register(platform=PLATFORM_NAME)(platform_class())


def is_registered() -> bool:
    """True when verl's ``PlatformRegistry`` holds :class:`PlatformCPU` as ``cpu``."""
    # verl's platform module loads when the patch is applied (inside `import verl`), not at this module's import
    from verl.plugin.platform import PlatformRegistry

    return PlatformRegistry.get(PLATFORM_NAME) is platform_class()


def normalise_backend(backend: Any) -> Any:
    """``"cpu:gloo,cpu:gloo"`` -> ``"gloo"``; anything else unchanged.

    verl builds its process-group backend as ``f"cpu:gloo,{device}:{backend}"``; with device ``cpu``
    and backend ``gloo`` that names the cpu device twice, which torch rejects.
    """
    if not isinstance(backend, str) or "," not in backend:
        return backend
    pairs = [part.strip().split(":", 1) for part in backend.split(",")]
    if all(len(p) == 2 and p[0] == "cpu" for p in pairs) and {p[1] for p in pairs} == {"gloo"}:
        return "gloo"
    return backend


def wrap_init_process_group(original):
    """``torch.distributed.init_process_group`` applying :func:`normalise_backend` to its backend."""

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any):
        if "backend" in kwargs:
            kwargs["backend"] = normalise_backend(kwargs["backend"])
        elif args:
            args = (normalise_backend(args[0]),) + tuple(args[1:])
        return original(*args, **kwargs)

    return init_process_group


def unpinned_offload_applies() -> bool:
    """The FSDP2 offload policy needs unpinning: no CUDA, and torch has the policy class."""
    if torch.cuda.is_available():
        return False
    # verl's FSDP engine loads only where it is used (probing it pulls in the engine stack)
    from verl.workers.engine.fsdp import transformer_impl

    return transformer_impl.CPUOffloadPolicy is not None


def wrap_offload_policy(original):
    """verl's ``CPUOffloadPolicy`` (in ``transformer_impl``'s namespace) built with ``pin_memory=False``."""

    @functools.wraps(original)
    def cpu_offload_policy(*args: Any, **kwargs: Any):
        kwargs["pin_memory"] = False
        return original(*args, **kwargs)

    return cpu_offload_policy


def pin_threads(environ: Optional[dict] = None) -> Optional[int]:
    """Set torch's intra-op thread count of this process to ``$STAPO_CPU_THREADS`` (docs/reproducibility.md).
    Returns the count set, or None when the variable is unset (nothing changed); ValueError naming
    the variable when it is not a positive integer."""
    env = os.environ if environ is None else environ
    raw = env.get(THREADS_ENV, "").strip()
    if not raw:
        return None
    try:
        threads = int(raw)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ValueError(f"{THREADS_ENV}={raw!r}: expected a positive integer (torch intra-op threads)")
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
