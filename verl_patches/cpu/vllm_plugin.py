"""vLLM's plugin hook into the CPU path: ``load`` is the ``vllm.general_plugins`` entry point of this
project (pyproject.toml), which vLLM calls in each of its processes (API server, engine core,
workers) before it builds an engine. With ``VERL_PLATFORM=cpu`` it imports :mod:`verl_patches`,
which applies the patch table there, vLLM's CPU entries included (docs/cpu.md); otherwise nothing.
verl's own import of the patches reaches only the processes that import verl before vLLM builds its
model (the workers, through verl's worker extension), not vLLM's engine core."""

from __future__ import annotations

import importlib

from .selection import cpu_selected


def load() -> None:
    if cpu_selected():
        importlib.import_module("verl_patches")
