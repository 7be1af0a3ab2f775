"""Whether this process selected the CPU path, and switching it on (see the package docstring)."""

from __future__ import annotations

import os

PLATFORM_ENV = "VERL_PLATFORM"

_ACTIVE = False


def cpu_selected() -> bool:
    """True when this process selected the CPU path (``VERL_PLATFORM=cpu``)."""
    return os.environ.get(PLATFORM_ENV, "").strip().lower() == "cpu"


def is_active() -> bool:
    """True once :func:`activate` ran in this process."""
    return _ACTIVE


def activate() -> None:
    """Fix torch's thread count (``STAPO_CPU_THREADS``), register the CPU platform and the HF
    rollout and apply the CPU patches, the v1 trainer's ordering ones included (idempotent)."""
    global _ACTIVE
    if _ACTIVE:
        return
    from . import hf_rollout, ordering, platform

    platform.pin_threads()
    platform.register()
    platform.patch_init_process_group()
    platform.patch_fsdp2_offload_pinning()
    hf_rollout.register()
    ordering.apply()
    _ACTIVE = True
