"""The CPU path: run verl 0.9.1's real trainer on a machine without a GPU.

Selected by the environment, never by import alone::

    VERL_PLATFORM=cpu                                # selects the "cpu" platform and the CPU patches
    VERL_USE_EXTERNAL_MODULES=verl_patches.activate  # makes every verl process apply the patches
    VERL_ENGINE_DEVICE=cuda                          # engine class lookup only (FSDP engine)

plus verl's vLLM rollout on vLLM's CPU build (config ``cpu_rollout/vllm.yaml``;
``recipe.stapo.cpu.cpu_env`` and ``recipe.stapo.cpu.cpu_overrides`` build both). The changes to
verl and vLLM are the ``scope: cpu`` entries of the recipe's patch table (:mod:`verl_patches.install`),
applied by :mod:`verl_patches.activate` when ``VERL_PLATFORM=cpu``, after
:func:`verl_patches.cpu.platform.pin_threads` fixed torch's thread count (``STAPO_CPU_THREADS``).
When the CPU path is not selected nothing is registered or patched, and importing this package
changes nothing. The code they run:

- :mod:`.platform`: the ``cpu`` platform (device cpu, gloo, no-op device calls), the gloo backend
  string, unpinned FSDP2 offload, the thread count;
- :mod:`.vllm_cpu` and :mod:`.vllm_plugin`: verl's vLLM rollout on vLLM's CPU build (weight sync,
  per-sample seeds, vLLM's AVX2 kernels under the instruction-set pin, the run's socket folder);
- :mod:`.shm`: what killed processes leave in /dev/shm;
- :mod:`.ordering`: under ``rollout.full_determinism``, per-sample request ids and a fixed batch
  order in verl's TransferQueue trainer (docs/reproducibility.md).
"""

from .selection import PLATFORM_ENV, cpu_selected

__all__ = ["PLATFORM_ENV", "cpu_selected"]
