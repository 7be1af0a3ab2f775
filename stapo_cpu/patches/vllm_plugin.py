"""vLLM's plugin hook into the CPU path: ``load`` is the ``vllm.general_plugins`` entry point of the
distribution ``stapo-cpu-vllm-plugin`` (``stapo_cpu/patches/vllm_plugin_dist/``), which only the CPU
environment installs (``run_scripts/_venv.sh``; a GPU install of the recipe has no vLLM plugin).
vLLM calls it in each of its processes (API server, engine core, workers) before it builds an
engine. With ``VERL_PLATFORM=cpu`` it applies the CPU wing's patch table there (:mod:`stapo_cpu.activate`),
then the recipe's (:mod:`verl_patches.activate`), and creates the run's folder for vLLM's socket files
where this node lacks it (the driver made it on its own node only, see
:func:`stapo_cpu.patches.vllm_cpu.run_scratch`); otherwise it does nothing, and resolving it imports
only this module and :mod:`.selection`.
verl's own import of the patches reaches only the processes that import verl before vLLM builds its
model (the workers, through verl's worker extension), not vLLM's engine core."""

from __future__ import annotations

import os

from .selection import cpu_selected

#: vLLM's setting naming the folder of its socket files
RPC_BASE_PATH_ENV = "VLLM_RPC_BASE_PATH"


def load() -> None:
    if not cpu_selected():
        return
    # importing them applies the wing's table, then the recipe's: on the CPU path only
    import stapo_cpu.activate  # noqa: F401
    import verl_patches.activate  # noqa: F401

    folder = os.environ.get(RPC_BASE_PATH_ENV)
    if folder:
        os.makedirs(folder, exist_ok=True)
