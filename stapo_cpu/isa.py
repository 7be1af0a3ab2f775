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
    """Environment holding torch's CPU math libraries (ATen, MKL with ``MKL_CBWR=AVX2,STRICT``,
    oneDNN) to AVX2 in every process on x86 (``machine``: default ``platform.machine()``), so that an
    AVX-512 machine sums in the order an AVX2-only one does (docs/cpu.md, docs/reproducibility.md).
    Each variable is read when its library loads: it must be in a process's environment before torch
    is imported. ``isa="native"`` returns nothing (each library picks); other CPUs (ARM) get nothing.
    """
    if isa not in ISAS:
        raise ValueError(f"isa_env: isa must be one of {ISAS}, got {isa!r}")
    if isa == "native" or (machine or platform.machine()).lower() not in X86:
        return {}
    return {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "MKL_CBWR": "AVX2,STRICT",
            "ONEDNN_MAX_CPU_ISA": "AVX2"}
