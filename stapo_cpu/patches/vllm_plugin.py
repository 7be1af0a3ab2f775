"""vLLM's plugin hook into the CPU path (docs/cpu.md, "How the CPU patches reach every process"):
``load``, the ``vllm.general_plugins`` entry point of the distribution ``stapo-cpu-vllm-plugin``
(``stapo_cpu/patches/vllm_plugin_dist/``), which vLLM calls in each of its processes. With
``VERL_PLATFORM=cpu`` it applies the CPU wing's table, then the recipe's, and creates the run's folder
for vLLM's socket files where this node lacks it (:func:`stapo_cpu.patches.vllm_cpu.run_scratch`);
otherwise it does nothing, and resolving it imports only this module and :mod:`.selection`."""

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
