"""The instruction set torch's CPU math libraries are held to in every process of a CPU run
(:func:`isa_env`: why, and what it sets)."""

from __future__ import annotations

import platform
from typing import Optional

#: instruction set the math libraries of every process of a CPU run are held to (see :func:`isa_env`)
DEFAULT_ISA = "avx2"
#: the settings :func:`isa_env` accepts: ``avx2`` pins, ``native`` leaves each library to pick
ISAS = ("avx2", "native")
#: the x86 ``platform.machine()`` names (the pin is an x86 one; other CPUs get no variable)
X86 = ("x86_64", "amd64", "i386", "i686")


def isa_env(isa: str = DEFAULT_ISA, machine: Optional[str] = None) -> dict[str, str]:
    """Environment holding torch's CPU math libraries to one instruction set in every process.

    Left alone, ATen, MKL and oneDNN each pick their kernels by the CPU's instruction set, and the
    AVX2 and AVX-512 kernels sum in different orders, so the same run gives different numbers on an
    AVX2-only and an AVX-512 machine. ``isa="avx2"`` (the default) sets, on x86 (``machine``: default
    ``platform.machine()``):

    - ``ATEN_CPU_CAPABILITY=avx2``: ATen's own vectorised kernels (softmax, reductions, elementwise);
    - ``MKL_ENABLE_INSTRUCTIONS=AVX2`` and ``MKL_CBWR=AVX2,STRICT``: MKL's matrix products take its
      AVX2 code path, with results that do not depend on memory alignment;
    - ``ONEDNN_MAX_CPU_ISA=AVX2``: oneDNN's kernels.

    Each is read when its library loads, so it must be in a process's environment before torch is
    imported: :func:`stapo_cpu.trainer.cpu_env` puts it there for the trainer and Ray's workers
    inherit it (and get it from the runtime environment, :func:`stapo_cpu.trainer.cpu_overrides`).
    AVX2 is what every x86 CPU of the last decade has; an AVX-512 machine then computes what an
    AVX2-only one does (docs/reproducibility.md has the measurement and the cost). ``isa="native"``
    returns nothing (each library picks, as without the recipe); other CPUs (ARM) get nothing either.
    """
    if isa not in ISAS:
        raise ValueError(f"isa_env: isa must be one of {ISAS}, got {isa!r}")
    if isa == "native" or (machine or platform.machine()).lower() not in X86:
        return {}
    return {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "MKL_CBWR": "AVX2,STRICT",
            "ONEDNN_MAX_CPU_ISA": "AVX2"}
