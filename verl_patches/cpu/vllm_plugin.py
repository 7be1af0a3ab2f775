"""vLLM's plugin hook into the CPU path: ``load`` is the ``vllm.general_plugins`` entry point of this
project (pyproject.toml), which vLLM calls in each of its processes (API server, engine core,
workers) before it builds an engine. With ``VERL_PLATFORM=cpu`` it imports :mod:`verl_patches`,
which applies the patch table there, vLLM's CPU entries included (docs/cpu.md), and creates the run's
folder for vLLM's socket files where this node lacks it (the driver made it on its own node only;
see :func:`verl_patches.cpu.vllm_cpu.run_scratch`); otherwise nothing.
verl's own import of the patches reaches only the processes that import verl before vLLM builds its
model (the workers, through verl's worker extension), not vLLM's engine core."""

from __future__ import annotations

import importlib
import os

from .selection import cpu_selected

#: vLLM's setting naming the folder of its socket files
RPC_BASE_PATH_ENV = "VLLM_RPC_BASE_PATH"


def load() -> None:
    if not cpu_selected():
        return
    importlib.import_module("verl_patches")
    folder = os.environ.get(RPC_BASE_PATH_ENV)
    if folder:
        os.makedirs(folder, exist_ok=True)
